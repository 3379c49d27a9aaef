#include "ui/lanes_panel.h"

#include <QComboBox>
#include <QDir>
#include <QDoubleSpinBox>
#include <QFile>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QInputDialog>
#include <QLabel>
#include <QPushButton>
#include <QSpinBox>
#include <QStandardPaths>
#include <QTableWidget>
#include <QVBoxLayout>

#include <set>

#include "core/engine/preset.h"
#include "core/parallel/registry.h"
#include "core/schedulers/sampler.h"
#include "core/util/error.h"
#include "ui/wheel_guard.h"

namespace diffract::ui {

namespace {

template <typename W>
W* cell(const QTableWidget* table, int row, int column) {
  return qobject_cast<W*>(table->cellWidget(row, column));
}

}  // namespace

LanesPanel::LanesPanel(QWidget* parent) : QGroupBox(tr("Lanes"), parent) {
  setObjectName(QStringLiteral("lanesPanel"));
  setCheckable(true);
  setChecked(false);
  setToolTip(tr("Tick to run the prompt through every lane at once: each lane its own strategy, steps and sampler "
                "on its own devices, then compared with the baseline lane"));
  auto* layout = new QVBoxLayout(this);

  auto* setupRow = new QHBoxLayout;
  m_setups = new QComboBox;
  m_setups->setObjectName(QStringLiteral("laneSetupCombo"));
  setupRow->addWidget(new QLabel(tr("Setup")));
  setupRow->addWidget(m_setups, 1);
  auto* save = new QPushButton(tr("Save…"));
  save->setObjectName(QStringLiteral("saveLaneSetupButton"));
  save->setToolTip(tr("Keep these lanes as a setup of your own"));
  setupRow->addWidget(save);
  layout->addLayout(setupRow);

  m_table = new QTableWidget(0, ColumnCount);
  m_table->setObjectName(QStringLiteral("lanesTable"));
  m_table->setHorizontalHeaderLabels(
      {tr("Name"), tr("Strategy"), tr("Devices"), tr("Skip"), tr("Threshold"), tr("Steps"), tr("Sampler"),
       tr("Precision")});
  m_table->horizontalHeader()->setSectionResizeMode(QHeaderView::ResizeToContents);
  m_table->verticalHeader()->setSectionResizeMode(QHeaderView::ResizeToContents);
  m_table->setSelectionBehavior(QAbstractItemView::SelectRows);
  m_table->setMinimumHeight(120);
  layout->addWidget(m_table);

  auto* rowButtons = new QHBoxLayout;
  auto* add = new QPushButton(tr("Add lane"));
  add->setObjectName(QStringLiteral("addLaneButton"));
  m_remove = new QPushButton(tr("Remove lane"));
  m_remove->setObjectName(QStringLiteral("removeLaneButton"));
  m_baseline = new QComboBox;
  m_baseline->setObjectName(QStringLiteral("baselineLaneCombo"));
  m_baseline->setToolTip(tr("The lane the others are compared with"));
  rowButtons->addWidget(add);
  rowButtons->addWidget(m_remove);
  rowButtons->addStretch(1);
  rowButtons->addWidget(new QLabel(tr("Baseline")));
  rowButtons->addWidget(m_baseline);
  layout->addLayout(rowButtons);

  m_plan = new QLabel;
  m_plan->setObjectName(QStringLiteral("lanesPlanLabel"));
  m_plan->setWordWrap(true);
  m_plan->setTextFormat(Qt::PlainText);
  layout->addWidget(m_plan);

  connect(this, &QGroupBox::toggled, this, [this] { emit changed(); });
  connect(add, &QPushButton::clicked, this, [this] { addLane(engine::Lane{}); });
  connect(m_remove, &QPushButton::clicked, this, [this] {
    const int row = m_table->currentRow();
    removeLane(row >= 0 ? row : laneCount() - 1);
  });
  connect(m_baseline, &QComboBox::currentIndexChanged, this, [this] {
    if (!m_filling) emit changed();
  });
  connect(m_setups, &QComboBox::currentIndexChanged, this, [this](int index) {
    if (m_filling || index <= 0 || index > static_cast<int>(m_sets.size())) return;
    setLaneSet(m_sets[static_cast<std::size_t>(index - 1)]);
  });
  connect(save, &QPushButton::clicked, this, [this] {
    bool ok = false;
    const QString name = QInputDialog::getText(this, tr("Save lane setup"), tr("Name"), QLineEdit::Normal,
                                               m_setups->currentIndex() > 0 ? m_setups->currentText() : QString(), &ok);
    if (!ok || name.trimmed().isEmpty()) return;
    const QString error = saveSetup(name.trimmed());
    m_plan->setText(error.isEmpty() ? tr("Saved lane setup %1").arg(name.trimmed()) : error);
  });
  connect(m_table, &QTableWidget::itemChanged, this, [this] {
    if (!m_filling) {
      refreshBaselines();
      emit changed();
    }
  });

  reloadSetups();
  if (m_sets.empty()) {
    engine::Lane baseline;
    baseline.name = "baseline";
    addLane(baseline);
  } else {
    m_setups->setCurrentIndex(1);
  }
}

int LanesPanel::laneCount() const { return m_table->rowCount(); }

void LanesPanel::addLane(const engine::Lane& lane) {
  if (laneCount() >= engine::kMaxLanes) return;
  const int row = m_table->rowCount();
  m_table->insertRow(row);
  setRow(row, lane);
  refreshBaselines();
  m_remove->setEnabled(laneCount() > 1);
  if (!m_filling) emit changed();
}

void LanesPanel::removeLane(int row) {
  if (row < 0 || row >= laneCount() || laneCount() <= 1) return;
  m_table->removeRow(row);
  refreshBaselines();
  m_remove->setEnabled(laneCount() > 1);
  if (!m_filling) emit changed();
}

void LanesPanel::setRow(int row, const engine::Lane& lane) {
  const bool was = m_filling;
  m_filling = true;
  m_table->setItem(row, Name, new QTableWidgetItem(QString::fromStdString(lane.name)));

  auto* strategy = new QComboBox;
  for (const auto& s : parallel::strategies()) {
    strategy->addItem(QString::fromUtf8(s.name.data(), static_cast<int>(s.name.size())),
                      QString::fromUtf8(s.name.data(), static_cast<int>(s.name.size())));
    strategy->setItemData(strategy->count() - 1, QString::fromUtf8(s.hint.data(), static_cast<int>(s.hint.size())),
                          Qt::ToolTipRole);
  }
  strategy->setCurrentIndex(std::max(0, strategy->findData(QString::fromStdString(lane.strategy.display_name()))));
  m_table->setCellWidget(row, Strategy, strategy);

  auto* devices = new QSpinBox;
  devices->setRange(1, 64);
  devices->setValue(lane.strategy.devices);
  devices->setToolTip(tr("Devices the lane's strategy runs on (GPUs, or CPU virtual devices)"));
  m_table->setCellWidget(row, Devices, devices);

  auto* skip = new QSpinBox;
  skip->setRange(1, 16);
  skip->setValue(lane.strategy.skip);
  skip->setToolTip(tr("step-skip: evaluate every N-th step; deepcache: the deep layers every N-th step"));
  m_table->setCellWidget(row, Skip, skip);

  auto* threshold = new QDoubleSpinBox;
  threshold->setRange(0, 10);
  threshold->setDecimals(3);
  threshold->setSingleStep(0.01);
  threshold->setValue(parallel::cache_threshold(lane.strategy));
  // The strategy default the field holds (-1: a value of the lane's own): another step cache
  // chosen in the row brings its own default unless the value was changed.
  threshold->setProperty("strategyDefault", lane.strategy.cache_threshold < 0 ? threshold->value() : -1.0);
  threshold->setToolTip(tr("fbcache: reuse the other blocks while the first block's output moved less than this; "
                           "teacache: skip every block while the rescaled changes summed stay under this"));
  m_table->setCellWidget(row, Threshold, threshold);

  auto* steps = new QSpinBox;
  steps->setRange(0, 1000);
  steps->setSpecialValueText(tr("job's"));
  steps->setValue(lane.steps);
  m_table->setCellWidget(row, Steps, steps);

  auto* sampler = new QComboBox;
  sampler->addItem(tr("job's"), QString());
  for (const std::string& name : schedulers::sampler_names())
    sampler->addItem(QString::fromStdString(name), QString::fromStdString(name));
  sampler->setCurrentIndex(std::max(0, sampler->findData(QString::fromStdString(lane.sampler))));
  m_table->setCellWidget(row, Sampler, sampler);

  auto* precision = new QComboBox;
  precision->addItem(tr("job's"), QString());
  precision->addItem(QStringLiteral("bf16"), QStringLiteral("bf16"));
  precision->addItem(QStringLiteral("fp8"), QStringLiteral("fp8"));
  precision->setCurrentIndex(std::max(0, precision->findData(QString::fromStdString(lane.precision))));
  precision->setToolTip(tr("The denoiser's linear layers: bf16, or fp8 (e4m3) where faster"));
  m_table->setCellWidget(row, Precision, precision);

  // The row's widgets find their row at the time of the change (rows move when one is removed).
  const auto rowOf = [this](QWidget* w) {
    for (int r = 0; r < m_table->rowCount(); ++r)
      for (int c = 0; c < ColumnCount; ++c)
        if (m_table->cellWidget(r, c) == w) return r;
    return -1;
  };
  const auto onChange = [this, rowOf](QWidget* w) {
    if (m_filling) return;
    if (const int r = rowOf(w); r >= 0) updateRow(r);
    refreshBaselines();
    emit changed();
  };
  connect(strategy, &QComboBox::currentIndexChanged, this, [onChange, strategy] { onChange(strategy); });
  connect(sampler, &QComboBox::currentIndexChanged, this, [onChange, sampler] { onChange(sampler); });
  connect(precision, &QComboBox::currentIndexChanged, this, [onChange, precision] { onChange(precision); });
  for (QSpinBox* s : {devices, skip, steps}) connect(s, &QSpinBox::valueChanged, this, [onChange, s] { onChange(s); });
  connect(threshold, &QDoubleSpinBox::valueChanged, this, [onChange, threshold] { onChange(threshold); });
  guardWheel(m_table);
  updateRow(row);
  m_filling = was;
}

void LanesPanel::updateRow(int row) {
  const auto* info = parallel::find_strategy(cell<QComboBox>(m_table, row, Strategy)->currentData().toString().toStdString());
  if (!info) return;
  auto* devices = cell<QSpinBox>(m_table, row, Devices);
  const bool fixed = info->devices.fixed > 0;
  devices->setEnabled(!fixed && info->takes(parallel::Param::Devices));
  if (fixed) {
    const QSignalBlocker block(devices);
    devices->setValue(info->devices.fixed);
  } else if (devices->value() < info->devices.min) {
    const QSignalBlocker block(devices);
    devices->setValue(info->devices.min);
  }
  cell<QSpinBox>(m_table, row, Skip)->setEnabled(info->takes(parallel::Param::Skip));
  auto* threshold = cell<QDoubleSpinBox>(m_table, row, Threshold);
  threshold->setEnabled(info->takes(parallel::Param::CacheThreshold));
  if (info->takes(parallel::Param::CacheThreshold) && threshold->value() == threshold->property("strategyDefault").toDouble()) {
    const QSignalBlocker block(threshold);
    threshold->setValue(info->default_cache_threshold);
    threshold->setProperty("strategyDefault", info->default_cache_threshold);
  }
}

engine::Lane LanesPanel::laneAt(int row) const {
  engine::Lane l;
  if (auto* item = m_table->item(row, Name)) l.name = item->text().trimmed().toStdString();
  l.strategy.name = cell<QComboBox>(m_table, row, Strategy)->currentData().toString().toStdString();
  const auto* info = parallel::find_strategy(l.strategy.name);
  l.strategy.devices = info && info->takes(parallel::Param::Skip) ? 1 : cell<QSpinBox>(m_table, row, Devices)->value();
  l.strategy.skip = cell<QSpinBox>(m_table, row, Skip)->value();
  l.strategy.cache_threshold = cell<QDoubleSpinBox>(m_table, row, Threshold)->value();
  l.steps = cell<QSpinBox>(m_table, row, Steps)->value();
  l.sampler = cell<QComboBox>(m_table, row, Sampler)->currentData().toString().toStdString();
  l.precision = cell<QComboBox>(m_table, row, Precision)->currentData().toString().toStdString();
  return l;
}

engine::LaneSet LanesPanel::laneSet() const {
  engine::LaneSet set;
  const int chosen = m_setups->currentIndex();
  set.name = chosen > 0 ? m_setups->currentText().toStdString() : "Custom lanes";
  if (chosen > 0 && chosen <= static_cast<int>(m_sets.size()))
    set.description = m_sets[static_cast<std::size_t>(chosen - 1)].description;
  for (int r = 0; r < laneCount(); ++r) set.lanes.push_back(laneAt(r));
  set.baseline = std::max(0, m_baseline->currentIndex());
  return set;
}

void LanesPanel::setLaneSet(const engine::LaneSet& set) {
  const bool was = m_filling;
  m_filling = true;
  m_table->setRowCount(0);
  for (const auto& lane : set.lanes) {
    const int row = m_table->rowCount();
    m_table->insertRow(row);
    setRow(row, lane);
  }
  refreshBaselines();
  m_baseline->setCurrentIndex(std::clamp(set.baseline, 0, std::max(0, laneCount() - 1)));
  m_remove->setEnabled(laneCount() > 1);
  const int index = m_setups->findText(QString::fromStdString(set.name));
  if (index > 0) m_setups->setCurrentIndex(index);
  m_filling = was;
  emit changed();
}

QString LanesPanel::problem() const {
  try {
    engine::validate_lane_set(laneSet(), "lanes");
  } catch (const std::exception& e) {
    return QString::fromUtf8(e.what());
  }
  return {};
}

void LanesPanel::refreshBaselines() {
  const int keep = m_baseline->currentIndex();
  const QSignalBlocker block(m_baseline);
  m_baseline->clear();
  for (int r = 0; r < laneCount(); ++r)
    m_baseline->addItem(tr("%1: %2").arg(r + 1).arg(QString::fromStdString(engine::lane_title(laneAt(r)))));
  m_baseline->setCurrentIndex(std::clamp(keep, 0, std::max(0, laneCount() - 1)));
}

QString LanesPanel::userLaneDir() {
  return QDir(QStandardPaths::writableLocation(QStandardPaths::AppConfigLocation)).filePath(QStringLiteral("presets/lanes"));
}

QStringList LanesPanel::reloadSetups(const QString& select) {
  QStringList problems;
  m_sets.clear();
  std::set<std::string> names;
  const QDir shipped(QStringLiteral(":/presets/lanes"));
  for (const QString& name : shipped.entryList({QStringLiteral("*.json")}, QDir::Files, QDir::Name)) {
    QFile f(shipped.filePath(name));
    try {
      if (!f.open(QIODevice::ReadOnly)) throw Error(f.fileName().toStdString() + ": cannot open");
      auto set = engine::parse_lane_set(f.readAll().toStdString(), f.fileName().toStdString());
      if (names.insert(set.name).second) m_sets.push_back(std::move(set));
    } catch (const std::exception& e) {
      problems << QString::fromUtf8(e.what());
    }
  }
  std::vector<std::string> unread;
  for (auto& set : engine::list_lane_sets({userLaneDir().toStdString()}, &unread))
    if (names.insert(set.name).second) m_sets.push_back(std::move(set));
  for (const auto& p : unread) problems << QString::fromStdString(p);
  const bool was = m_filling;
  m_filling = true;
  m_setups->clear();
  m_setups->addItem(tr("Custom"));
  for (const auto& s : m_sets) {
    m_setups->addItem(QString::fromStdString(s.name));
    m_setups->setItemData(m_setups->count() - 1, QString::fromStdString(s.description), Qt::ToolTipRole);
  }
  m_filling = was;
  if (!select.isEmpty()) selectSetup(select);
  return problems;
}

bool LanesPanel::selectSetup(const QString& name) {
  const int index = m_setups->findText(name);
  if (index <= 0) return false;
  if (m_setups->currentIndex() == index) setLaneSet(m_sets[static_cast<std::size_t>(index - 1)]);
  else m_setups->setCurrentIndex(index);
  return true;
}

QString LanesPanel::saveSetup(const QString& name) {
  auto set = laneSet();
  set.name = name.toStdString();
  const QString file =
      QDir(userLaneDir()).filePath(QString::fromStdString(engine::preset_file_name(set.name)));
  try {
    engine::save_lane_set(set, file.toStdString());
  } catch (const std::exception& e) {
    return tr("The lane setup was not saved: %1").arg(QString::fromUtf8(e.what()));
  }
  reloadSetups(name);
  return {};
}

void LanesPanel::showPlan(const job::GenerationRequest& group, const std::vector<int>& enabledGpus) {
  QStringList lines;
  if (const QString p = problem(); !p.isEmpty()) {
    m_plan->setText(p);
    return;
  }
  const auto set = laneSet();
  const auto plans = engine::plan_lanes(group, set, enabledGpus);
  for (std::size_t i = 0; i < plans.size(); ++i) {
    if (!plans[i].error.empty())
      lines << tr("Lane %1 cannot run: %2").arg(i + 1).arg(QString::fromStdString(plans[i].error));
  }
  for (const auto& s : engine::describe_sharing(plans)) {
    QString line = QString::fromStdString(s);
    line[0] = line[0].toUpper();
    lines << line;
  }
  if (lines.isEmpty()) lines << tr("Every lane has devices of its own: they run at the same time.");
  m_plan->setText(lines.join(QLatin1Char('\n')));
}

QString LanesPanel::planText() const { return m_plan->text(); }

}  // namespace diffract::ui
