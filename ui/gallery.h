#pragma once
// The output folder as thumbnails with their parameters, read off the GUI thread.
#include <QDateTime>
#include <QFutureWatcher>
#include <QImage>
#include <QList>
#include <QString>
#include <QWidget>

class QLabel;
class QListWidget;
class QPushButton;

namespace diffract::ui {

class GalleryView : public QWidget {
  Q_OBJECT
 public:
  struct Entry {
    QString path;
    QImage thumbnail;
    QSize size;            // of the full image
    QString parameters;    // A1111 "parameters" text, if any
    QString metadataJson;  // the "diffract" chunk, if any
    QDateTime modified;
    // A lane group (a lanes-*/ folder): `path` is its lanes.json, the thumbnail its lanes tiled,
    // `lanes` how many; double-clicking it reopens the comparison.
    int lanes = 0;
  };
  static constexpr int kThumbnailSize = 160;

  explicit GalleryView(QWidget* parent = nullptr);
  // Shows `dir`'s PNGs, newest first, each as soon as a worker has read it; returns at once,
  // loaded() follows the last (a listing still running is cancelled).
  void setFolder(const QString& dir);
  QString folder() const { return m_folder; }
  void refresh() { setFolder(m_folder); }
  // Adds one image (a render just saved) at the front, read off the GUI thread.
  void addFile(const QString& path);
  const QList<Entry>& entries() const { return m_entries; }
  QStringList selectedPaths() const;

  // Reading one PNG as an entry (thumbnail and text chunks); false with `error` set when unreadable.
  static bool readEntry(const QString& path, Entry* entry, QString* error);
  // Reading a lane group's lanes.json (engine::read_lane_group) and its lanes' images as an entry.
  static bool readLanesEntry(const QString& lanesJson, Entry* entry, QString* error);
  // The actions behind the buttons, without their dialogs.
  static QString saveCopy(const QString& from, const QString& to);  // the error, or ""
  QString deleteFiles(const QStringList& paths);                     // the error, or ""

 signals:
  void loaded();
  void restoreRequested(const QString& path);
  void lanesRequested(const QString& lanesJson);
  void compareRequested(const QString& a, const QString& b);
  void useAsInputRequested(const QString& path);

 private:
  struct Loaded {
    Entry entry;
    QString error;  // set when the file could not be read
  };
  void insertItem(int row, const Entry& entry);
  bool contains(const QString& path) const;
  bool lanesSelected() const;
  void updateStatus();
  void updateButtons();
  void saveSelectedAs();
  void deleteSelected();

  QString m_folder;
  QList<Entry> m_entries;
  QListWidget* m_list = nullptr;
  QLabel* m_status = nullptr;
  QPushButton* m_saveAs = nullptr;
  QPushButton* m_delete = nullptr;
  QPushButton* m_compare = nullptr;
  QPushButton* m_useAsInput = nullptr;
  QStringList m_problems;
  QFutureWatcher<Loaded>* m_listing = nullptr;
};

}  // namespace diffract::ui
