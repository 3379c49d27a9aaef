#pragma once
#include <QGroupBox>
#include <QList>
#include <QSet>

#include <optional>
#include <vector>

#include "core/engine/devices.h"
#include "core/parallel/registry.h"

class QCheckBox;
class QLabel;
class QVBoxLayout;

namespace diffract::ui {

// The devices group: one enable box per GPU with its memory (kept ticked or not by index, so a
// GPU unticked stays unticked when the list is read again), "CPU" when there is none, and a line
// saying where the job will run.
class DevicesPanel : public QGroupBox {
  Q_OBJECT
 public:
  explicit DevicesPanel(QWidget* parent = nullptr);

  // Lists the GPUs again off the GUI thread (a CUDA context per device takes a second or more);
  // a list set meanwhile (setDevices) wins over the one in flight.
  void refresh();
  // The GPUs shown (tests give their own); generation: internal, 0 from callers.
  void setDevices(const std::vector<engine::DeviceInfo>& devices, int generation = 0);
  std::vector<int> enabledGpus() const;
  // The GPU shown as cuda:`index` (its memory as last read); nothing when there is none.
  std::optional<engine::DeviceInfo> gpu(int index) const;
  // The unticked GPUs by index (what the settings keep); setting them ticks the others.
  QSet<int> disabledGpus() const { return m_disabledGpus; }
  void setDisabledGpus(const QSet<int>& disabled);
  // Enables only `device` ("cpu", or "cuda:N" of a GPU shown); false when no such device is here.
  bool useOnly(const QString& device);
  // The summary line for the choice the enabled GPUs and `strategy` make.
  void showChoice(const engine::DeviceChoice& choice, const parallel::StrategyInfo& strategy);

 signals:
  // A GPU was ticked or unticked, or the list changed.
  void gpusChanged();

 private:
  QVBoxLayout* m_rows = nullptr;
  QList<QCheckBox*> m_gpuChecks;  // property "gpuIndex": the N of cuda:N
  std::vector<engine::DeviceInfo> m_gpus;  // as listed
  QLabel* m_cpuLabel = nullptr;
  QLabel* m_summary = nullptr;
  QSet<int> m_disabledGpus;  // a GPU never unticked is enabled
  int m_generation = 0;
};

}  // namespace diffract::ui
