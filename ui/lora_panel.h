#pragma once
// The LoRAs of the form: the LoRA folders, every file found there with an enable box, a weight
// slider and its trigger words (kohya's ss_tag_frequency), and what a job and a restored PNG
// take from it. Names are file stems, as the prompt's <lora:NAME:W> tags use them.
#include <QString>
#include <QStringList>
#include <QWidget>
#include <map>
#include <vector>

#include "core/engine/png_parameters.h"
#include "core/engine/preset.h"
#include "core/job/request.h"

class QLabel;
class QVBoxLayout;

namespace diffract::ui {

class LoraPanel : public QWidget {
  Q_OBJECT
 public:
  explicit LoraPanel(QWidget* parent = nullptr);

  QStringList folders() const { return m_folders; }
  // Lists the LoRAs of `folders` again; enabled rows that are still there keep their state.
  void setFolders(const QStringList& folders);
  void refresh();
  int count() const { return static_cast<int>(m_rows.size()); }
  QStringList names() const;
  // The row of `name` (case-insensitive): enabled, at `weight` (-2..2); false when it is not listed.
  bool enable(const QString& name, bool on, double weight = 1.0);
  bool isEnabled(const QString& name) const;
  double weight(const QString& name) const;
  QStringList triggerWords(const QString& name) const;
  // The enabled LoRAs, and the folders for the prompt's tags.
  void fillRequest(job::GenerationRequest& r) const;
  // A restored PNG's LoRAs: those its prompt's tags do not name are enabled here (or listed as
  // missing); a tag naming no file here is looked up by the PNG's "Lora hashes" among the files
  // (renamed since) and rewritten to that file's name, or listed as missing. Returns the prompt
  // to restore (p.prompt, with such tags rewritten).
  QString restore(const engine::PngParameters& p, QStringList& restored, QStringList& notRestored);
  // A preset's LoRAs: those enabled at their weights, every other row off; `missing` lists the
  // names no row has.
  void applyPreset(const std::vector<engine::Preset::Lora>& loras, QStringList& missing);

 signals:
  void foldersChanged(const QStringList& folders);
  // "Add trigger words" on a row: text for the prompt.
  void insertText(const QString& text);

 private:
  struct Row;
  Row* row(const QString& name) const;
  void chooseFolder();

  QStringList m_folders;
  QLabel* m_summary = nullptr;
  QVBoxLayout* m_list = nullptr;
  std::vector<Row*> m_rows;
  std::map<QString, QString> m_hashes;  // "path|size|time" -> the file's short hash
};

}  // namespace diffract::ui
