#pragma once
// The ControlNets of the form: the ControlNet folders, and units, each a model, a control image
// (opened, dropped, or the input image), a preprocessor (none, canny with its thresholds), the
// scale and the part of the steps it acts on, with a preview of the control image it makes.
#include <QDir>
#include <QImage>
#include <QSize>
#include <QString>
#include <QStringList>
#include <QWidget>
#include <string>
#include <vector>

#include "core/engine/png_parameters.h"
#include "core/engine/preset.h"
#include "core/job/request.h"
#include "ui/control_preprocessors.h"

class QLabel;
class QPushButton;
class QVBoxLayout;

namespace diffract::ui {

class ControlNetPanel : public QWidget {
  Q_OBJECT
 public:
  // The settings of one unit (its image apart).
  struct Unit {
    bool enabled = true;
    QString model;  // a ControlNet folder
    ControlPreprocess preprocess;
    double scale = 1.0, start = 0.0, end = 1.0;
  };
  static constexpr int kMaxUnits = 4;

  explicit ControlNetPanel(QWidget* parent = nullptr);

  QStringList folders() const { return m_folders; }
  // Lists the ControlNets of `folders` (and the Hugging Face cache) again in every unit's model list.
  void setFolders(const QStringList& folders);
  void refresh();
  QStringList models() const;  // the folders listed

  int unitCount() const { return static_cast<int>(m_units.size()); }
  int addUnit();  // its index, or -1 at kMaxUnits
  void removeUnit(int index);
  void clear();   // no units
  Unit unit(int index) const;
  void setUnit(int index, const Unit& unit);  // a model not listed is added to that unit's list
  void setImage(int index, const QImage& image, const QString& source);
  bool loadImage(int index, const QString& path, QString* error);
  QImage sourceImage(int index) const;
  // What the unit gives the model for a job of `size`, and the preview it shows.
  QImage controlImage(int index, const QSize& size = {}) const;

  // The enabled units with a model and an image, their control images made at r's size. An
  // enabled unit without one of them: an error naming it (the request is then left unchanged).
  QString fillRequest(job::GenerationRequest& r) const;
  // The enabled units fillRequest took, in its order: how each made its image, for the PNG.
  std::vector<Unit> requestUnits() const;
  // `metadata_json` with each "controlnets" entry's preprocessor (and canny's thresholds) from `units`.
  static std::string addPreprocessors(const std::string& metadata_json, const std::vector<Unit>& units);

  // A preset's ControlNets as units (images kept where a unit stays); `missing` lists models not found.
  void applyPreset(const std::vector<engine::Preset::ControlNet>& controlnets, QStringList& missing);
  std::vector<engine::Preset::ControlNet> presetControlNets() const;  // the enabled units with a model
  // A restored PNG's ControlNets: each a unit with its saved control image (from `folder`), as
  // given to the model (preprocessor none), or listed as not restored.
  void restore(const engine::PngParameters& p, const QDir& folder, QStringList& restored, QStringList& notRestored);

 signals:
  void foldersChanged(const QStringList& folders);
  // "Use input" on a unit: the window answers with setImage(index, the input image).
  void inputImageWanted(int index);
  void notice(const QString& text);

 protected:
  bool eventFilter(QObject* watched, QEvent* event) override;

 private:
  struct Row;
  void chooseFolder();
  void fillModels(Row* row, const QString& keep);
  void updatePreview(Row* row);
  void updateSummary();
  int indexOf(const Row* row) const;

  QStringList m_folders;
  std::vector<std::pair<QString, QString>> m_models;  // (label, folder)
  QLabel* m_summary = nullptr;
  QPushButton* m_add = nullptr;
  QVBoxLayout* m_list = nullptr;
  std::vector<Row*> m_units;
};

}  // namespace diffract::ui
