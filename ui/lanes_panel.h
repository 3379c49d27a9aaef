#pragma once
#include <QGroupBox>
#include <QString>

#include <vector>

#include "core/engine/lanes.h"

class QComboBox;
class QLabel;
class QPushButton;
class QTableWidget;

namespace diffract::ui {

// The lanes group: when ticked, Generate runs the prompt through every lane at once, each with its
// own strategy (and its devices, skip or threshold), steps and sampler. Lane setups come from
// the shipped presets (lanes/) and the user's own; the line below the table says which lanes
// will share a device and so run one after another.
class LanesPanel : public QGroupBox {
  Q_OBJECT
 public:
  enum Column { Name, Strategy, Devices, Skip, Threshold, Steps, Sampler, Precision, ColumnCount };

  explicit LanesPanel(QWidget* parent = nullptr);

  bool lanesEnabled() const { return isChecked(); }
  // The table as a lane set (named after the chosen setup, or "Custom lanes").
  engine::LaneSet laneSet() const;
  void setLaneSet(const engine::LaneSet& set);
  // Why the table cannot run (engine::validate_lane_set's words), or empty.
  QString problem() const;
  int laneCount() const;
  void addLane(const engine::Lane& lane);
  void removeLane(int row);
  QTableWidget* table() const { return m_table; }
  QComboBox* setups() const { return m_setups; }

  // Shipped setups (compiled-in resources) then the user's (userLaneDir()), each once; selects
  // `select` by name when given. Returns the files that could not be read.
  QStringList reloadSetups(const QString& select = QString());
  bool selectSetup(const QString& name);
  static QString userLaneDir();
  // Writes the table as the user's setup `name` and selects it; returns the error, or "".
  QString saveSetup(const QString& name);
  // The sharing line for `group` on `enabledGpus` (engine::plan_lanes), and each lane that
  // cannot run with its reason.
  void showPlan(const job::GenerationRequest& group, const std::vector<int>& enabledGpus);
  QString planText() const;

 signals:
  void changed();  // a lane, the baseline or the setup changed, or lanes were switched on or off

 private:
  void setRow(int row, const engine::Lane& lane);
  engine::Lane laneAt(int row) const;
  void updateRow(int row);  // enables the cells the row's strategy reads
  void refreshBaselines();

  QComboBox* m_setups = nullptr;
  QTableWidget* m_table = nullptr;
  QComboBox* m_baseline = nullptr;
  QPushButton* m_remove = nullptr;
  QLabel* m_plan = nullptr;
  std::vector<engine::LaneSet> m_sets;  // the setups in the combo, after its "Custom" entry
  bool m_filling = false;
};

}  // namespace diffract::ui
