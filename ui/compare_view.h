#pragma once
// Two images against each other: a swipe view, side by side, a difference heatmap, PSNR / SSIM
// and the parameters that differ. The image maths runs off the GUI thread.
#include <QImage>
#include <QList>
#include <QPair>
#include <QString>
#include <QStringList>
#include <QWidget>

class QComboBox;
class QLabel;
class QSlider;
class QStackedWidget;
class QTableWidget;

namespace diffract::ui {

class ImageView;

// OpenCV-backed; the images must have the same size (else psnr / ssim are NaN and the heatmap is null).
struct ImageComparison {
  double psnr = 0;   // dB, 8-bit RGB, data range 255; +inf for equal images
  double ssim = 0;   // core/metrics' definition (scikit-image's gaussian SSIM); NaN below 11x11
  QImage heatmap;    // |a - b| averaged over channels, scaled so the largest is hottest, INFERNO colours
  QString error;     // why nothing was computed
};
ImageComparison compareImages(const QImage& a, const QImage& b);

struct ParameterDifference {
  QString key;
  QString a;  // "—" when the key is absent on that side
  QString b;
};
// The top-level keys of two "diffract" metadata JSONs whose values differ (timings and strategy
// statistics left out: they describe the run, not its settings), sorted by key.
QList<ParameterDifference> differingParameters(const QString& metadataA, const QString& metadataB);

// The swipe view: `a` left of the divider, `b` right of it, both scaled to fit.
class SwipeView : public QWidget {
  Q_OBJECT
 public:
  explicit SwipeView(QWidget* parent = nullptr);
  void setImages(const QImage& a, const QImage& b);
  void setPosition(double fraction);  // 0: all b, 1: all a
  double position() const { return m_position; }
  QSize sizeHint() const override { return {512, 512}; }
  QSize minimumSizeHint() const override { return {128, 128}; }

 signals:
  void dragged(double fraction);  // the user moved the divider with the mouse

 protected:
  void paintEvent(QPaintEvent* event) override;
  void mousePressEvent(QMouseEvent* event) override;
  void mouseMoveEvent(QMouseEvent* event) override;

 private:
  QRectF targetRect() const;
  QImage m_a, m_b;
  double m_position = 0.5;
};

class CompareView : public QWidget {
  Q_OBJECT
 public:
  struct Item {
    QString label;
    QImage image;
    QString metadataJson;
  };
  // Compares items[a] with items[b]; the two menus pick any other pair from `items`.
  CompareView(QList<Item> items, int a, int b, QWidget* parent = nullptr);
  // A compare window of its own over `parent`, deleted when closed.
  static CompareView* openWindow(QList<Item> items, int a, int b, QWidget* parent);
  // The images as items (file name, pixels, "diffract" chunk); on the first unreadable one,
  // no items and the reason. Blocking: call it off the GUI thread.
  static QPair<QList<Item>, QString> readFiles(const QStringList& paths);
  const ImageComparison& comparison() const { return m_comparison; }

 signals:
  void computed();  // metrics and heatmap are on show

 private:
  void compare();

  QList<Item> m_items;
  QComboBox* m_pickA = nullptr;
  QComboBox* m_pickB = nullptr;
  QComboBox* m_mode = nullptr;
  QStackedWidget* m_pages = nullptr;
  SwipeView* m_swipe = nullptr;
  QSlider* m_slider = nullptr;
  ImageView* m_left = nullptr;
  ImageView* m_right = nullptr;
  ImageView* m_heatmap = nullptr;
  QLabel* m_metrics = nullptr;
  QTableWidget* m_table = nullptr;
  ImageComparison m_comparison;
  int m_generation = 0;  // drops results of a comparison that was superseded
};

}  // namespace diffract::ui
