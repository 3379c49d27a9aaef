#include "ui/job_queue.h"

#include <QComboBox>
#include <QGridLayout>
#include <QHBoxLayout>
#include <QLabel>
#include <QLineEdit>
#include <QListWidget>
#include <QPushButton>
#include <QSpinBox>
#include <QVBoxLayout>

#include "core/engine/variation_grid.h"
#include "ui/timings_chart.h"

namespace diffract::ui {

QString describeJob(const QueuedJob& job) {
  const auto& r = job.request;
  QString prompt = QString::fromStdString(r.prompt).simplified();
  if (prompt.size() > 40) prompt = prompt.left(39) + QChar(0x2026);
  QStringList parts{prompt.isEmpty() ? QObject::tr("(no prompt)") : prompt};
  parts << QObject::tr("%1 steps").arg(r.steps);
  if (r.width > 0 && r.height > 0) parts << QStringLiteral("%1×%2").arg(r.width).arg(r.height);
  parts << QObject::tr("seed %1").arg(r.seed);
  if (r.batch > 1) parts << QObject::tr("batch %1").arg(r.batch);
  if (job.lanes) parts << QObject::tr("%1 lanes").arg(job.lanes->lanes.size());
  else if (!r.strategy.single()) parts << QString::fromStdString(r.strategy.display_name());
  return parts.join(QStringLiteral(" · "));
}

JobQueuePanel::JobQueuePanel(QWidget* parent) : QGroupBox(tr("Queue"), parent) {
  setObjectName(QStringLiteral("queuePanel"));
  auto* layout = new QVBoxLayout(this);
  m_list = new QListWidget;
  m_list->setObjectName(QStringLiteral("queueList"));
  m_list->setMaximumHeight(120);
  layout->addWidget(m_list);
  auto* buttons = new QHBoxLayout;
  m_up = new QPushButton(tr("Up"));
  m_up->setObjectName(QStringLiteral("queueUpButton"));
  m_down = new QPushButton(tr("Down"));
  m_down->setObjectName(QStringLiteral("queueDownButton"));
  m_remove = new QPushButton(tr("Remove"));
  m_remove->setObjectName(QStringLiteral("queueRemoveButton"));
  m_clear = new QPushButton(tr("Clear"));
  m_clear->setObjectName(QStringLiteral("queueClearButton"));
  m_clear->setToolTip(tr("Remove every waiting job (the running one goes on; Esc cancels it)"));
  for (auto* b : {m_up, m_down, m_remove, m_clear}) buttons->addWidget(b);
  layout->addLayout(buttons);
  auto* variationsRow = new QHBoxLayout;
  m_variations = new QSpinBox;
  m_variations->setObjectName(QStringLiteral("variationsSpin"));
  m_variations->setRange(2, 64);
  m_variations->setValue(4);
  auto* queueSeeds = new QPushButton(tr("Queue seeds"));
  queueSeeds->setObjectName(QStringLiteral("queueSeedsButton"));
  queueSeeds->setToolTip(tr("The job in the form this many times, the seed counting up from the form's"));
  variationsRow->addWidget(new QLabel(tr("Variations")));
  variationsRow->addWidget(m_variations);
  variationsRow->addWidget(queueSeeds, 1);
  layout->addLayout(variationsRow);
  // A grid over two parameters: each axis a parameter and its values, comma-separated.
  auto* grid = new QGridLayout;
  const auto axisCombo = [](const char* name, bool none) {
    auto* c = new QComboBox;
    c->setObjectName(QString::fromLatin1(name));
    if (none) c->addItem(tr("(none)"), QString());
    for (const auto p : engine::grid_parameters()) {
      const auto n = QString::fromUtf8(engine::grid_parameter_name(p).data(), static_cast<int>(engine::grid_parameter_name(p).size()));
      c->addItem(n, n);
    }
    return c;
  };
  m_gridX = axisCombo("gridXCombo", false);
  m_gridY = axisCombo("gridYCombo", true);
  m_gridXValues = new QLineEdit(QStringLiteral("20, 30"));
  m_gridXValues->setObjectName(QStringLiteral("gridXValuesEdit"));
  m_gridYValues = new QLineEdit;
  m_gridYValues->setObjectName(QStringLiteral("gridYValuesEdit"));
  for (auto* e : {m_gridXValues, m_gridYValues})
    e->setToolTip(tr("Values separated by commas: steps 20, 30; sampler euler, dpmpp-2m; strategy single, step-skip:2"));
  auto* queueGrid = new QPushButton(tr("Queue grid"));
  queueGrid->setObjectName(QStringLiteral("queueGridButton"));
  queueGrid->setToolTip(tr("The job in the form for every pair of values, shown and saved as one labelled grid"));
  grid->addWidget(new QLabel(tr("Grid x")), 0, 0);
  grid->addWidget(m_gridX, 0, 1);
  grid->addWidget(m_gridXValues, 0, 2);
  grid->addWidget(new QLabel(tr("y")), 1, 0);
  grid->addWidget(m_gridY, 1, 1);
  grid->addWidget(m_gridYValues, 1, 2);
  grid->addWidget(queueGrid, 2, 0, 1, 3);
  grid->setColumnStretch(2, 1);
  layout->addLayout(grid);
  m_total = new QLabel;
  m_total->setObjectName(QStringLiteral("queueTotalLabel"));
  m_total->setWordWrap(true);
  layout->addWidget(m_total);

  connect(m_up, &QPushButton::clicked, this, [this] { moveUp(m_list->currentRow()); });
  connect(m_down, &QPushButton::clicked, this, [this] { moveDown(m_list->currentRow()); });
  connect(m_remove, &QPushButton::clicked, this, [this] { remove(m_list->currentRow()); });
  connect(m_clear, &QPushButton::clicked, this, &JobQueuePanel::clear);
  connect(queueSeeds, &QPushButton::clicked, this, [this] { emit variationsRequested(m_variations->value()); });
  connect(queueGrid, &QPushButton::clicked, this, [this] {
    emit gridRequested(m_gridX->currentData().toString(), m_gridXValues->text(), m_gridY->currentData().toString(),
                       m_gridYValues->text());
  });
  connect(m_list, &QListWidget::currentRowChanged, this, [this] {
    const int row = m_list->currentRow();
    m_up->setEnabled(row > 0);
    m_down->setEnabled(row >= 0 && row + 1 < count());
    m_remove->setEnabled(row >= 0);
  });
  refresh();
}

void JobQueuePanel::add(QueuedJob job) {
  if (job.label.isEmpty()) job.label = describeJob(job);
  m_jobs.append(std::move(job));
  refresh();
}

std::optional<QueuedJob> JobQueuePanel::takeNext() {
  if (m_jobs.isEmpty()) return std::nullopt;
  auto job = m_jobs.takeFirst();
  refresh();
  return job;
}

void JobQueuePanel::moveUp(int row) {
  if (row <= 0 || row >= count()) return;
  m_jobs.swapItemsAt(row, row - 1);
  refresh();
  m_list->setCurrentRow(row - 1);
}

void JobQueuePanel::moveDown(int row) {
  if (row < 0 || row + 1 >= count()) return;
  m_jobs.swapItemsAt(row, row + 1);
  refresh();
  m_list->setCurrentRow(row + 1);
}

void JobQueuePanel::remove(int row) {
  if (row < 0 || row >= count()) return;
  const auto gone = m_jobs.takeAt(row);
  refresh();
  m_list->setCurrentRow(std::min(row, count() - 1));
  emit removed({gone});
}

void JobQueuePanel::clear() {
  const auto gone = m_jobs;
  m_jobs.clear();
  refresh();
  if (!gone.isEmpty()) emit removed(gone);
}

void JobQueuePanel::setStepCost(double msPerMegapixelStep) {
  m_msPerMegapixelStep = msPerMegapixelStep;
  refresh();
}

double JobQueuePanel::estimateSeconds(const QueuedJob& job) const {
  if (m_msPerMegapixelStep <= 0) return -1;
  const auto& r = job.request;
  const double w = r.width > 0 ? r.width : 512, h = r.height > 0 ? r.height : 512;
  const double megapixels = w * h * std::max(1, r.batch) / 1e6;
  double steps = r.steps;
  if (job.lanes) {
    steps = 0;
    for (const auto& l : job.lanes->lanes) steps += l.steps > 0 ? l.steps : r.steps;
  }
  return m_msPerMegapixelStep * megapixels * steps / 1000.0;
}

QString JobQueuePanel::totalText() const { return m_total->text(); }

void JobQueuePanel::refresh() {
  const int row = m_list->currentRow();
  m_list->clear();
  double total = 0;
  bool known = true;
  for (const auto& job : m_jobs) {
    const double s = estimateSeconds(job);
    known &= s >= 0;
    total += std::max(0.0, s);
    m_list->addItem(s >= 0 ? tr("%1 · ~%2").arg(job.label, formatSeconds(s)) : job.label);
  }
  const QString waiting = count() == 1 ? tr("1 job waiting") : tr("%1 jobs waiting").arg(count());
  if (m_jobs.isEmpty()) m_total->setText(tr("Nothing waiting: Generate while a job runs adds to the queue."));
  else if (known) m_total->setText(tr("%1 · ~%2 in all").arg(waiting, formatSeconds(total)));
  else m_total->setText(tr("%1 · time unknown until a job has run").arg(waiting));
  m_list->setCurrentRow(std::min(row, count() - 1));
  m_up->setEnabled(m_list->currentRow() > 0);
  m_down->setEnabled(m_list->currentRow() >= 0 && m_list->currentRow() + 1 < count());
  m_remove->setEnabled(m_list->currentRow() >= 0);
  m_clear->setEnabled(!m_jobs.isEmpty());
  emit changed();
}

}  // namespace diffract::ui
