#include "ui/variation_grid.h"

#include <cmath>

#include <QFileInfo>
#include <QFontMetrics>
#include <QPainter>

namespace diffract::ui {

GridRun::GridRun(engine::GridAxis x, std::optional<engine::GridAxis> y, std::vector<engine::GridCell> cells)
    : m_x(std::move(x)), m_y(std::move(y)), m_cells(std::move(cells)) {
  m_images.resize(static_cast<int>(m_cells.size()));
  m_files = QStringList(static_cast<int>(m_cells.size()), QString());
  m_ended.fill(false, static_cast<int>(m_cells.size()));
}

void GridRun::setCell(int index, const QImage& image, const QString& savedFile) {
  if (index < 0 || index >= m_images.size() || m_ended[index]) return;
  m_images[index] = image;
  m_files[index] = savedFile;
  m_ended[index] = true;
  ++m_done;
}

QImage tileBatch(const QList<QImage>& images) {
  if (images.isEmpty()) return {};
  if (images.size() == 1) return images.first();
  const QSize cell = images.first().size();
  const int n = static_cast<int>(images.size());
  const int columns = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(n))));
  const int rows = (n + columns - 1) / columns;
  const int gap = std::max(2, cell.width() / 128);
  QImage out(columns * cell.width() + (columns - 1) * gap, rows * cell.height() + (rows - 1) * gap, QImage::Format_RGB32);
  out.fill(QColor(48, 48, 48));
  QPainter p(&out);
  QFont font;
  font.setPixelSize(std::max(10, cell.height() / 16));
  p.setFont(font);
  const QFontMetrics metrics(font);
  for (int i = 0; i < n; ++i) {
    const QPoint at((i % columns) * (cell.width() + gap), (i / columns) * (cell.height() + gap));
    const QImage& image = images[i];
    p.drawImage(at, image.size() == cell ? image : image.scaled(cell, Qt::IgnoreAspectRatio, Qt::SmoothTransformation));
    const QString label = QStringLiteral("#%1").arg(i + 1);
    const QRect box(at + QPoint(4, 4), QSize(metrics.horizontalAdvance(label) + 8, metrics.height() + 4));
    p.fillRect(box, QColor(0, 0, 0, 160));
    p.setPen(Qt::white);
    p.drawText(box, Qt::AlignCenter, label);
  }
  return out;
}

QImage GridRun::compose() const {
  QSize cell(256, 256);
  for (const auto& image : m_images)
    if (!image.isNull()) {
      cell = image.size();
      break;
    }
  QFont font;
  font.setPixelSize(std::max(12, cell.height() / 14));
  const QFontMetrics metrics(font);
  const int pad = metrics.height() / 2;
  const int top = metrics.height() + 2 * pad;
  int left = 0;
  if (m_y)
    for (int j = 0; j < rows(); ++j)
      left = std::max(left, metrics.horizontalAdvance(QString::fromStdString(engine::grid_label(*m_y, j))) + 2 * pad);
  QImage out(left + columns() * cell.width(), top + rows() * cell.height(), QImage::Format_RGB32);
  out.fill(Qt::white);
  QPainter p(&out);
  p.setFont(font);
  p.setPen(Qt::black);
  for (int i = 0; i < columns(); ++i)
    p.drawText(QRect(left + i * cell.width(), 0, cell.width(), top), Qt::AlignCenter,
               QString::fromStdString(engine::grid_label(m_x, i)));
  if (m_y)
    for (int j = 0; j < rows(); ++j)
      p.drawText(QRect(0, top + j * cell.height(), left, cell.height()), Qt::AlignCenter,
                 QString::fromStdString(engine::grid_label(*m_y, j)));
  for (int k = 0; k < m_images.size(); ++k) {
    const auto& c = m_cells[static_cast<std::size_t>(k)];
    const QRect at(left + c.x * cell.width(), top + c.y * cell.height(), cell.width(), cell.height());
    if (m_images[k].isNull()) {
      p.fillRect(at, QColor(200, 200, 200));
      if (m_ended[k]) p.drawText(at, Qt::AlignCenter, QObject::tr("failed"));
    } else {
      p.drawImage(at, m_images[k].size() == cell ? m_images[k] : m_images[k].scaled(cell, Qt::IgnoreAspectRatio,
                                                                                        Qt::SmoothTransformation));
    }
  }
  return out;
}

std::string GridRun::json() const {
  std::vector<std::string> names;
  for (const auto& f : m_files) names.push_back(f.isEmpty() ? std::string() : QFileInfo(f).fileName().toStdString());
  return engine::grid_json(m_x, m_y, m_cells, names).dump(2);
}

}  // namespace diffract::ui
