#include "ui/devices_panel.h"

#include <QCheckBox>
#include <QFutureWatcher>
#include <QHBoxLayout>
#include <QLabel>
#include <QStringList>
#include <QToolButton>
#include <QVBoxLayout>
#include <QtConcurrent/QtConcurrentRun>
#include <exception>

namespace diffract::ui {

DevicesPanel::DevicesPanel(QWidget* parent) : QGroupBox(tr("Devices"), parent) {
  setObjectName(QStringLiteral("devicesGroup"));
  auto* layout = new QVBoxLayout(this);
  m_rows = new QVBoxLayout;
  layout->addLayout(m_rows);
  m_cpuLabel = new QLabel(tr("CPU"));
  m_cpuLabel->setObjectName(QStringLiteral("cpuDeviceLabel"));
  m_cpuLabel->setToolTip(tr("No GPU found: generating on the CPU"));
  m_rows->addWidget(m_cpuLabel);
  auto* footer = new QHBoxLayout;
  m_summary = new QLabel;
  m_summary->setObjectName(QStringLiteral("deviceSummaryLabel"));
  m_summary->setWordWrap(true);
  m_summary->setTextFormat(Qt::PlainText);
  auto* refreshButton = new QToolButton;
  refreshButton->setObjectName(QStringLiteral("refreshDevicesButton"));
  refreshButton->setText(tr("Refresh"));
  refreshButton->setToolTip(tr("Read the GPUs' memory in use again"));
  footer->addWidget(m_summary, 1);
  footer->addWidget(refreshButton);
  layout->addLayout(footer);
  connect(refreshButton, &QToolButton::clicked, this, &DevicesPanel::refresh);
}

void DevicesPanel::refresh() {
  const int generation = ++m_generation;
  m_summary->setText(tr("Looking for GPUs…"));
  auto* watcher = new QFutureWatcher<std::vector<engine::DeviceInfo>>(this);
  connect(watcher, &QFutureWatcherBase::finished, this, [this, watcher, generation] {
    watcher->deleteLater();
    if (generation == m_generation) setDevices(watcher->result(), generation);
  });
  watcher->setFuture(QtConcurrent::run([]() -> std::vector<engine::DeviceInfo> {
    try {
      return engine::list_devices();
    } catch (const std::exception& e) {
      qWarning("listing the GPUs failed: %s", e.what());  // shown as CPU only
      return {};
    }
  }));
}

void DevicesPanel::setDevices(const std::vector<engine::DeviceInfo>& devices, int generation) {
  if (generation == 0) ++m_generation;
  m_gpus = devices;
  qDeleteAll(m_gpuChecks);
  m_gpuChecks.clear();
  const auto gib = [](std::uint64_t bytes) { return QString::number(bytes / double(1ull << 30), 'f', 1); };
  for (const engine::DeviceInfo& d : devices) {
    auto* box = new QCheckBox(tr("cuda:%1 %2 · %3 GiB, %4 GiB in use")
                                  .arg(d.index)
                                  .arg(QString::fromStdString(d.name), gib(d.total_bytes), gib(d.used_bytes)));
    box->setObjectName(QStringLiteral("gpuCheck%1").arg(d.index));
    box->setProperty("gpuIndex", d.index);
    box->setChecked(!m_disabledGpus.contains(d.index));
    connect(box, &QCheckBox::toggled, this, [this, index = d.index](bool on) {
      if (on)
        m_disabledGpus.remove(index);
      else
        m_disabledGpus.insert(index);
      emit gpusChanged();
    });
    m_rows->addWidget(box);
    m_gpuChecks.append(box);
  }
  m_cpuLabel->setVisible(devices.empty());
  emit gpusChanged();
}

std::optional<engine::DeviceInfo> DevicesPanel::gpu(int index) const {
  for (const auto& d : m_gpus)
    if (d.index == index) return d;
  return std::nullopt;
}

std::vector<int> DevicesPanel::enabledGpus() const {
  std::vector<int> out;
  for (const QCheckBox* box : m_gpuChecks)
    if (box->isChecked()) out.push_back(box->property("gpuIndex").toInt());
  return out;
}

void DevicesPanel::setDisabledGpus(const QSet<int>& disabled) {
  m_disabledGpus = disabled;
  for (QCheckBox* box : m_gpuChecks) box->setChecked(!m_disabledGpus.contains(box->property("gpuIndex").toInt()));
}

bool DevicesPanel::useOnly(const QString& device) {
  QCheckBox* gpu = nullptr;
  for (QCheckBox* box : m_gpuChecks)
    if (device == QStringLiteral("cuda:%1").arg(box->property("gpuIndex").toInt())) gpu = box;
  if (device != QLatin1String("cpu") && !gpu) return false;
  for (QCheckBox* box : m_gpuChecks) box->setChecked(box == gpu);
  return true;
}

void DevicesPanel::showChoice(const engine::DeviceChoice& c, const parallel::StrategyInfo& strategy) {
  if (!c.error.empty()) {
    m_summary->setText(QString::fromStdString(c.error));
    m_summary->setStyleSheet(QStringLiteral("color: #c62828;"));
    return;
  }
  m_summary->setStyleSheet(QString());
  if (strategy.devices.fixed == 1 && !strategy.takes(parallel::Param::Skip))
    m_summary->setText(tr("Runs on %1").arg(QString::fromStdString(c.device)));
  else if (strategy.takes(parallel::Param::Skip))
    m_summary->setText(tr("Runs on %1, skipping %2 steps at a time").arg(QString::fromStdString(c.device)).arg(c.skip));
  else if (c.device == "cpu")
    m_summary->setText(c.devices == 1 ? tr("Runs on the CPU as 1 virtual device")
                                      : tr("Runs on the CPU as %1 virtual devices").arg(c.devices));
  else {
    QStringList gpus;
    for (const int g : c.gpus) gpus << QStringLiteral("cuda:%1").arg(g);
    m_summary->setText(tr("Runs on %1 GPUs: %2").arg(c.devices).arg(gpus.join(QStringLiteral(", "))));
  }
}

}  // namespace diffract::ui
