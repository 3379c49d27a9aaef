#pragma once
#include <QGroupBox>
#include <QList>
#include <QString>

#include <optional>
#include <vector>

#include "core/engine/lanes.h"
#include "core/job/request.h"
#include "ui/controlnet_panel.h"

class QComboBox;
class QLabel;
class QLineEdit;
class QListWidget;
class QPushButton;
class QSpinBox;

namespace diffract::ui {

// A job waiting its turn: the request as the fields were when it was added (control images made),
// how its control images were made, and its lanes when it is a lane group.
struct QueuedJob {
  job::GenerationRequest request;
  std::vector<ControlNetPanel::Unit> controlUnits;
  std::optional<engine::LaneSet> lanes;
  QString label;  // "a red apple · 30 steps · 512×512 · seed 5"
  int grid = 0;       // a variation grid's id (0: none) and this job's cell in it
  int gridCell = -1;
};

// "a red apple · 30 steps · 512×512 · seed 5" (and "· 3 lanes").
QString describeJob(const QueuedJob& job);

// The jobs waiting behind the running one, in the order they will run: move one up or down,
// remove one, clear them all; each with an estimate of how long it takes, and the total.
class JobQueuePanel : public QGroupBox {
  Q_OBJECT
 public:
  explicit JobQueuePanel(QWidget* parent = nullptr);

  void add(QueuedJob job);
  std::optional<QueuedJob> takeNext();
  int count() const { return static_cast<int>(m_jobs.size()); }
  const QueuedJob& at(int row) const { return m_jobs[row]; }
  void moveUp(int row);
  void moveDown(int row);
  void remove(int row);
  void clear();
  QListWidget* list() const { return m_list; }
  QSpinBox* variations() const { return m_variations; }
  QComboBox* gridX() const { return m_gridX; }
  QLineEdit* gridXValues() const { return m_gridXValues; }
  QComboBox* gridY() const { return m_gridY; }  // "" data: no y axis
  QLineEdit* gridYValues() const { return m_gridYValues; }
  QString totalText() const;

  // The measured cost of a step (ms per megapixel of one image), from the jobs that finished;
  // 0: not known yet (estimates say so).
  void setStepCost(double msPerMegapixelStep);
  // Seconds `job` should take at the measured cost; < 0 when unknown.
  double estimateSeconds(const QueuedJob& job) const;

 signals:
  void changed();
  // "Queue N seeds": the form's job N times, the seed counting up from the form's.
  void variationsRequested(int count);
  // "Queue grid": the form's job over the x axis's values and, when yParameter is not empty, the
  // y axis's (engine::parse_grid_axis reads them).
  void gridRequested(const QString& xParameter, const QString& xValues, const QString& yParameter,
                     const QString& yValues);
  // Jobs taken off the queue without running (Remove, Clear).
  void removed(const QList<diffract::ui::QueuedJob>& jobs);

 private:
  void refresh();

  QList<QueuedJob> m_jobs;
  QListWidget* m_list = nullptr;
  QLabel* m_total = nullptr;
  QPushButton* m_up = nullptr;
  QPushButton* m_down = nullptr;
  QPushButton* m_remove = nullptr;
  QPushButton* m_clear = nullptr;
  QSpinBox* m_variations = nullptr;
  QComboBox* m_gridX = nullptr;
  QLineEdit* m_gridXValues = nullptr;
  QComboBox* m_gridY = nullptr;
  QLineEdit* m_gridYValues = nullptr;
  double m_msPerMegapixelStep = 0;
};

}  // namespace diffract::ui
