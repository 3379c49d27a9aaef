#pragma once
#include <QString>
#include <QStringList>
#include <QWidget>

#include <vector>

#include "core/engine/preset.h"

class QComboBox;
class QLabel;

namespace diffract::ui {

// The preset row: a combo of the shipped presets (compiled-in resources) then the user's
// (userPresetDir()), "Save as preset…", and the active preset's prompt template under it.
class PresetBar : public QWidget {
  Q_OBJECT
 public:
  explicit PresetBar(QWidget* parent = nullptr);

  static QString userPresetDir();
  const std::vector<engine::Preset>& presets() const { return m_presets; }
  // Reads both folders again and selects `select` by name ("" or unknown: no preset). Returns
  // one line per preset that was skipped and why.
  QStringList reload(const QString& select = QString());
  // Makes index (0: no preset) current without touching the form (templateChanged follows).
  void select(int index);
  // The active preset's name (without the changed mark), or "" for none.
  QString currentName() const;
  // The active preset, or nullptr for none.
  const engine::Preset* current() const;
  // Marks the active preset as changed since it was applied: the combo shows "NAME (changed)",
  // so a name never stands for settings it no longer describes. Selecting a preset clears it.
  void setModified(bool modified);
  bool isModified() const { return m_modified; }
  // The prompt template in force: the preset's, or "{subject}".
  const QString& promptTemplate() const { return m_template; }
  // Writes p into userPresetDir() and selects it; returns the file, or throws diffract::Error.
  QString save(const engine::Preset& p);

 signals:
  // The user picked a preset in the combo: the form takes its settings.
  void applied(const diffract::engine::Preset& preset);
  // The template in force changed (active: a preset is selected).
  void templateChanged(const QString& promptTemplate, bool active);
  // "Save as preset…" was confirmed with this name.
  void saveRequested(const QString& name);

 private:
  QComboBox* m_combo = nullptr;
  QLabel* m_templateLabel = nullptr;
  std::vector<engine::Preset> m_presets;
  QString m_template = QString::fromLatin1(engine::kSubjectPlaceholder);
  bool m_modified = false;
};

}  // namespace diffract::ui
