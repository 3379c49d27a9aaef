#include "ui/timings_chart.h"

#include <QPainter>
#include <algorithm>

namespace diffract::ui {

QString formatSeconds(double s) {
  if (s < 60) return QStringLiteral("%1 s").arg(s, 0, 'f', 1);
  return QStringLiteral("%1 min %2 s").arg(static_cast<int>(s) / 60).arg(static_cast<int>(s) % 60);
}

namespace {

QString formatMs(double ms) {
  if (ms < 0) return QStringLiteral("–");
  if (ms >= 10000) return QStringLiteral("%1 s").arg(ms / 1000.0, 0, 'f', 1);
  if (ms >= 100) return QStringLiteral("%1 ms").arg(ms, 0, 'f', 0);
  return QStringLiteral("%1 ms").arg(ms, 0, 'f', 1);
}

}  // namespace

TimingsChart::TimingsChart(QWidget* parent) : QWidget(parent) {
  setObjectName(QStringLiteral("timingsChart"));
  setAttribute(Qt::WA_OpaquePaintEvent);
}

void TimingsChart::reset(int totalSteps) {
  m_steps = QVector<double>(std::max(0, totalSteps), -1.0);
  m_cached = QVector<bool>(m_steps.size(), false);
  m_textEncodeMs = m_vaeDecodeMs = m_totalMs = m_loadMs = -1;
  m_previewMs = 0;
  m_previews = 0;
  update();
}

void TimingsChart::setStep(int index, int total, double ms, bool cached) {
  // The job's own count wins over the request's steps (image-to-image runs fewer, the hires fix more).
  if (total != m_steps.size()) m_steps.resize(std::max(0, total), -1.0);
  m_cached.resize(m_steps.size(), false);
  if (index >= 0 && index < m_steps.size()) {
    m_steps[index] = ms;
    m_cached[index] = cached;
  }
  update();
}

void TimingsChart::setStage(const QString& stage, double ms) {
  if (stage == QLatin1String("text_encode")) m_textEncodeMs = ms;
  else if (stage == QLatin1String("vae_decode")) m_vaeDecodeMs = ms;
  else if (stage == QLatin1String("total")) m_totalMs = ms;
  else if (stage == QLatin1String("load")) m_loadMs = ms;
  else return;
  update();
}

void TimingsChart::addPreviewDecode(double ms) {
  m_previewMs += ms;
  ++m_previews;
  update();
}

void TimingsChart::setTimings(const JobTimings& t) {
  m_steps = t.stepMs;
  m_cached = QVector<bool>(m_steps.size(), false);
  for (int i : t.cachedSteps)
    if (i >= 0 && i < m_cached.size()) m_cached[i] = true;
  m_textEncodeMs = t.textEncodeMs;
  m_previewMs = 0;
  for (double ms : t.previewMs) m_previewMs += ms;
  m_previews = t.previewMs.size();
  m_vaeDecodeMs = t.vaeDecodeMs;
  m_totalMs = t.totalMs;
  m_loadMs = t.loadMs;
  update();
}

int TimingsChart::barCount() const {
  return static_cast<int>(std::count_if(m_steps.begin(), m_steps.end(), [](double v) { return v >= 0; }));
}

QStringList TimingsChart::rows() const {
  double stepSum = 0;
  for (double v : m_steps)
    if (v >= 0) stepSum += v;
  QStringList r;
  if (m_loadMs > 0) r << QStringLiteral("model load: %1").arg(formatMs(m_loadMs));
  r << QStringLiteral("text encode: %1").arg(formatMs(m_textEncodeMs));
  r << QStringLiteral("steps: %1 (%2/%3)").arg(formatMs(barCount() ? stepSum : -1)).arg(barCount()).arg(m_steps.size()) +
           (cachedCount() ? QStringLiteral(", %1 from the cache").arg(cachedCount()) : QString());
  r << QStringLiteral("preview decode: %1 (%2)").arg(formatMs(m_previews ? m_previewMs : -1)).arg(m_previews);
  r << QStringLiteral("VAE decode: %1").arg(formatMs(m_vaeDecodeMs));
  r << QStringLiteral("total: %1").arg(formatMs(m_totalMs));
  return r;
}

void TimingsChart::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), palette().base());
  const QStringList text = rows();
  const int lineH = fontMetrics().height();
  const int textH = lineH * static_cast<int>(text.size()) + 6;
  const QRect chart = rect().adjusted(6, 6, -6, -textH - 6);

  // Bars: height relative to the slowest step; not-yet-run steps leave an outline slot.
  if (!m_steps.isEmpty() && chart.height() > 4 && chart.width() > 4) {
    const double maxMs = std::max(1e-6, *std::max_element(m_steps.begin(), m_steps.end()));
    const double slot = static_cast<double>(chart.width()) / m_steps.size();
    const double gap = slot > 4 ? 1.0 : 0.0;
    const QColor bar = palette().highlight().color();
    for (int i = 0; i < m_steps.size(); ++i) {
      const QRectF cell(chart.left() + i * slot, chart.top(), std::max(1.0, slot - gap), chart.height());
      if (m_steps[i] < 0) continue;
      const double h = std::max(1.0, chart.height() * m_steps[i] / maxMs);
      const bool cached = i < m_cached.size() && m_cached[i];
      p.fillRect(QRectF(cell.left(), cell.bottom() - h, cell.width(), h), cached ? palette().mid().color() : bar);
    }
    p.setPen(palette().mid().color());
    p.drawLine(chart.bottomLeft(), chart.bottomRight());
    p.setPen(palette().text().color());
    p.drawText(chart.adjusted(2, 0, 0, 0), Qt::AlignTop | Qt::AlignLeft,
               QStringLiteral("max %1 / step").arg(formatMs(maxMs)));
  }
  p.setPen(palette().text().color());
  int y = rect().bottom() - textH + 6;
  for (const QString& line : text) {
    p.drawText(QRect(8, y, width() - 16, lineH), Qt::AlignLeft | Qt::AlignVCenter, line);
    y += lineH;
  }
}

}  // namespace diffract::ui
