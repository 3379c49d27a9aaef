#include "ui/lane_grid.h"

#include <QFrame>
#include <QGridLayout>
#include <QHBoxLayout>
#include <QLabel>
#include <QPushButton>
#include <QVBoxLayout>

#include <cmath>

#include "ui/image_view.h"
#include "ui/timings_chart.h"

namespace diffract::ui {

LaneGrid::LaneGrid(QWidget* parent) : QWidget(parent) {
  setObjectName(QStringLiteral("laneGrid"));
  m_grid = new QGridLayout(this);
  m_grid->setContentsMargins(4, 4, 4, 4);
  m_grid->setSpacing(6);
}

void LaneGrid::reset(const QStringList& titles, const QList<int>& steps, const QStringList& waiting, int baseline) {
  for (auto& t : m_tiles) delete t.box;
  m_tiles.clear();
  m_baseline = baseline;
  const int n = static_cast<int>(titles.size());
  // Up to three lanes side by side (one row fits the tab without scrolling), then a square-ish grid.
  const int columns = n <= 3 ? std::max(1, n) : static_cast<int>(std::ceil(std::sqrt(static_cast<double>(n))));
  for (int i = 0; i < n; ++i) {
    Tile t;
    auto* box = new QFrame;
    box->setFrameShape(QFrame::StyledPanel);
    box->setObjectName(QStringLiteral("laneTile%1").arg(i + 1));
    auto* layout = new QVBoxLayout(box);
    layout->setContentsMargins(4, 4, 4, 4);
    auto* head = new QHBoxLayout;
    t.title = new QLabel(tr("%1 · %2%3").arg(i + 1).arg(titles[i], i == baseline ? tr(" (baseline)") : QString()));
    t.title->setTextFormat(Qt::PlainText);
    QFont bold = t.title->font();
    bold.setBold(true);
    t.title->setFont(bold);
    head->addWidget(t.title, 1);
    t.compare = new QPushButton(tr("Compare"));
    t.compare->setObjectName(QStringLiteral("laneCompareButton%1").arg(i + 1));
    t.compare->setToolTip(tr("This lane against the baseline lane: swipe, side by side, heatmap"));
    t.compare->setEnabled(false);
    t.compare->setVisible(i != baseline);
    connect(t.compare, &QPushButton::clicked, this, [this, i] { emit compareRequested(i); });
    head->addWidget(t.compare);
    layout->addLayout(head);
    t.view = new ImageView;
    // The tile's picture takes the room there is: its 512 px size hint would make the grid taller
    // than the Lanes tab (the word-wrapped result asks the layout for a height for its width).
    t.view->setSizePolicy(QSizePolicy::Ignored, QSizePolicy::Ignored);
    t.view->setPlaceholder(i < waiting.size() && !waiting[i].isEmpty() ? waiting[i] : tr("Starting…"));
    layout->addWidget(t.view, 1);
    t.status = new QLabel(i < waiting.size() && !waiting[i].isEmpty() ? waiting[i] : tr("Starting…"));
    t.status->setSizePolicy(QSizePolicy::Ignored, QSizePolicy::Fixed);
    layout->addWidget(t.status);
    t.result = new QLabel;
    t.result->setWordWrap(true);
    t.result->setTextFormat(Qt::PlainText);
    t.result->setTextInteractionFlags(Qt::TextSelectableByMouse);
    t.result->hide();
    layout->addWidget(t.result);
    t.chart = new TimingsChart;
    t.chart->setMinimumHeight(70);
    t.chart->setMaximumHeight(110);
    t.chart->reset(i < steps.size() ? steps[i] : 0);
    layout->addWidget(t.chart);
    t.box = box;
    m_grid->addWidget(box, i / columns, i % columns);
    m_tiles.append(t);
  }
}

void LaneGrid::setStarted(int lane) {
  if (lane < 0 || lane >= m_tiles.size()) return;
  auto& t = m_tiles[lane];
  t.clock.start();
  t.status->setText(tr("Running…"));
  t.view->setPlaceholder(tr("Running…"));
}

void LaneGrid::setStep(int lane, int index, int total, double ms, bool cached) {
  if (lane < 0 || lane >= m_tiles.size()) return;
  auto& t = m_tiles[lane];
  t.chart->setStep(index, total, ms, cached);
  ++t.steps;
  t.stepMsSum += ms;
  const double perStep = t.stepMsSum / t.steps;
  const double itPerSec = perStep > 0 ? 1000.0 / perStep : 0;
  t.status->setText(tr("Step %1/%2 · %3 it/s · ETA %4")
                        .arg(index + 1)
                        .arg(total)
                        .arg(itPerSec, 0, 'f', itPerSec >= 10 ? 1 : 2)
                        .arg(formatSeconds(perStep * (total - index - 1) / 1000.0)));
}

void LaneGrid::setPreview(int lane, const QImage& image) {
  if (lane < 0 || lane >= m_tiles.size()) return;
  m_tiles[lane].view->setImage(image, false);
}

void LaneGrid::setFinished(int lane, const QImage& image, const JobTimings& timings) {
  if (lane < 0 || lane >= m_tiles.size()) return;
  auto& t = m_tiles[lane];
  if (!image.isNull()) t.view->setImage(image, true);
  t.chart->setTimings(timings);
  t.status->setText(tr("Done in %1").arg(formatSeconds((timings.totalMs - timings.loadMs) / 1000.0)));
}

void LaneGrid::setFailed(int lane, const QString& message) {
  if (lane < 0 || lane >= m_tiles.size()) return;
  auto& t = m_tiles[lane];
  t.status->setText(tr("Failed"));
  t.view->setPlaceholder(tr("Failed: %1").arg(message));
  t.result->setText(message);
  t.result->setStyleSheet(QStringLiteral("color: #c62828;"));
  t.result->show();
}

void LaneGrid::setCancelled(int lane) {
  if (lane < 0 || lane >= m_tiles.size()) return;
  m_tiles[lane].status->setText(tr("Cancelled"));
  if (m_tiles[lane].view->image().isNull()) m_tiles[lane].view->setPlaceholder(tr("Cancelled"));
}

void LaneGrid::setRows(const QList<LaneRow>& rows) {
  for (int i = 0; i < rows.size() && i < m_tiles.size(); ++i) {
    const auto& r = rows[i];
    auto& t = m_tiles[i];
    if (!r.compared) continue;
    const QString psnr = std::isfinite(r.psnr) ? tr("%1 dB").arg(r.psnr, 0, 'f', 2) : tr("identical");
    QString text = tr("%1× the baseline's speed · PSNR %2 · SSIM %3 · latents rel-L2 %4")
                       .arg(r.speedup, 0, 'f', 2)
                       .arg(psnr)
                       .arg(r.ssim, 0, 'f', 4)
                       .arg(r.latentsRelL2, 0, 'g', 3);
    if (!r.differences.isEmpty()) text += QLatin1Char('\n') + r.differences.join(QStringLiteral("; "));
    if (!r.devices.isEmpty()) text += tr(" · on %1").arg(r.devices);
    t.result->setText(text);
    t.result->setStyleSheet(QString());
    t.result->show();
    t.compare->setEnabled(true);
  }
}

QString LaneGrid::statusText(int lane) const { return lane >= 0 && lane < m_tiles.size() ? m_tiles[lane].status->text() : QString(); }
QString LaneGrid::resultText(int lane) const { return lane >= 0 && lane < m_tiles.size() ? m_tiles[lane].result->text() : QString(); }
ImageView* LaneGrid::view(int lane) const { return lane >= 0 && lane < m_tiles.size() ? m_tiles[lane].view : nullptr; }
TimingsChart* LaneGrid::chart(int lane) const { return lane >= 0 && lane < m_tiles.size() ? m_tiles[lane].chart : nullptr; }
int LaneGrid::stepsSeen(int lane) const { return lane >= 0 && lane < m_tiles.size() ? m_tiles[lane].steps : 0; }

}  // namespace diffract::ui
