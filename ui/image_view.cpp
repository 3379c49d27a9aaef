#include "ui/image_view.h"

#include <QMouseEvent>
#include <QPainter>
#include <QWheelEvent>
#include <algorithm>
#include <cmath>

namespace diffract::ui {

ImageView::ImageView(QWidget* parent) : QWidget(parent) {
  setObjectName(QStringLiteral("imageView"));
  setAttribute(Qt::WA_OpaquePaintEvent);
  setMinimumSize(128, 128);
  setCursor(Qt::OpenHandCursor);
}

void ImageView::setImage(const QImage& image, bool isFinal) {
  m_image = image;
  m_final = isFinal;
  if (isFinal || m_logicalSize.isEmpty()) m_logicalSize = image.size();
  update();
}

void ImageView::setDisplaySize(const QSize& size) {
  m_logicalSize = size;
  update();
}

void ImageView::setPlaceholder(const QString& text) {
  m_placeholder = text;
  update();
}

double ImageView::fitZoom() const {
  if (m_logicalSize.isEmpty()) return 1.0;
  return std::min(static_cast<double>(width()) / m_logicalSize.width(),
                  static_cast<double>(height()) / m_logicalSize.height());
}

double ImageView::zoom() const { return m_fit ? fitZoom() : m_zoom; }

void ImageView::fitToWindow() {
  m_fit = true;
  update();
}

QRectF ImageView::targetRect() const {
  const double z = zoom();
  const QSizeF size(m_logicalSize.width() * z, m_logicalSize.height() * z);
  if (m_fit) return QRectF(QPointF((width() - size.width()) / 2, (height() - size.height()) / 2), size);
  return QRectF(m_offset, size);
}

void ImageView::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), palette().window().color().darker(115));
  if (m_image.isNull()) {
    p.setPen(palette().text().color());
    p.drawText(rect().adjusted(12, 12, -12, -12), Qt::AlignCenter | Qt::TextWordWrap, m_placeholder);
    return;
  }
  // Upscaled previews stay pixelated (they are at latent resolution); the final render is
  // smoothed when shrunk.
  p.setRenderHint(QPainter::SmoothPixmapTransform, m_final && zoom() < 1.0);
  p.drawImage(targetRect(), m_image);
}

void ImageView::wheelEvent(QWheelEvent* event) {
  if (m_image.isNull()) return;
  const QRectF before = targetRect();
  const double oldZoom = zoom();
  const double factor = std::pow(1.0015, event->angleDelta().y());
  const double newZoom = std::clamp(oldZoom * factor, 0.05, 64.0);
  // Keep the image point under the cursor where it is.
  const QPointF cursor = event->position();
  const QPointF imagePoint = (cursor - before.topLeft()) / oldZoom;
  m_fit = false;
  m_zoom = newZoom;
  m_offset = cursor - imagePoint * newZoom;
  update();
  event->accept();
}

void ImageView::mousePressEvent(QMouseEvent* event) {
  if (!(event->button() & m_panButtons) || m_image.isNull()) return;
  if (m_fit) {  // start panning from where the fitted image is
    m_offset = targetRect().topLeft();
    m_zoom = fitZoom();
    m_fit = false;
  }
  m_dragging = true;
  m_dragStart = event->position();
  m_offsetStart = m_offset;
  setCursor(Qt::ClosedHandCursor);
}

void ImageView::mouseMoveEvent(QMouseEvent* event) {
  if (!m_dragging) return;
  m_offset = m_offsetStart + (event->position() - m_dragStart);
  update();
}

void ImageView::mouseReleaseEvent(QMouseEvent*) {
  m_dragging = false;
  setCursor(Qt::OpenHandCursor);
}

void ImageView::mouseDoubleClickEvent(QMouseEvent*) { fitToWindow(); }

}  // namespace diffract::ui
