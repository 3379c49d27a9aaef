#pragma once
// Shows one image (a step preview or the final render): fitted to the widget until the user
// zooms with the wheel (around the cursor) or pans by dragging; double-click fits again.
#include <QImage>
#include <QPointF>
#include <QWidget>

namespace diffract::ui {

class ImageView : public QWidget {
  Q_OBJECT
 public:
  explicit ImageView(QWidget* parent = nullptr);

  // Previews at latent resolution are scaled up to the size of the final image, so the view
  // does not jump between preview and final render.
  void setImage(const QImage& image, bool isFinal);
  const QImage& image() const { return m_image; }
  bool isFinal() const { return m_final; }
  void setPlaceholder(const QString& text);
  void setDisplaySize(const QSize& size);  // the coming render's size (previews are scaled to it)

  double zoom() const;           // on-screen pixels per image pixel
  QPointF offset() const { return m_offset; }
  bool fitted() const { return m_fit; }
  void fitToWindow();

  QSize sizeHint() const override { return {512, 512}; }
  // The buttons that pan by dragging (default: the left one).
  void setPanButtons(Qt::MouseButtons buttons) { m_panButtons = buttons; }

 protected:
  QRectF targetRect() const;     // where the image is drawn, in widget coordinates
  void paintEvent(QPaintEvent* event) override;
  void wheelEvent(QWheelEvent* event) override;
  void mousePressEvent(QMouseEvent* event) override;
  void mouseMoveEvent(QMouseEvent* event) override;
  void mouseReleaseEvent(QMouseEvent* event) override;
  void mouseDoubleClickEvent(QMouseEvent* event) override;

 private:
  double fitZoom() const;

  QImage m_image;
  QSize m_logicalSize;           // size the image is shown at (the final render's size)
  bool m_final = false;
  QString m_placeholder;
  bool m_fit = true;
  double m_zoom = 1.0;           // when not fitted
  QPointF m_offset;              // image top-left in widget coordinates, when not fitted
  Qt::MouseButtons m_panButtons = Qt::LeftButton;
  bool m_dragging = false;
  QPointF m_dragStart;
  QPointF m_offsetStart;
};

}  // namespace diffract::ui
