#pragma once
// The inpainting mask painted over the input image: brush and eraser, clear, invert, fill,
// undo / redo and the overlay; the wheel zooms and the right (or middle) button pans as in the
// render view. MaskEditorPane adds its tool bar.
#include <QImage>
#include <functional>
#include <QList>
#include <QWidget>

#include "ui/image_view.h"

class QSpinBox;
class QToolButton;

namespace diffract::ui {

class MaskEditor : public ImageView {
  Q_OBJECT
 public:
  enum class Tool { Brush, Eraser };
  static constexpr int kUndoDepth = 50;

  explicit MaskEditor(QWidget* parent = nullptr);

  // A new input: the mask is cleared and the history forgotten.
  void setInputImage(const QImage& image);
  const QImage& inputImage() const { return m_input; }
  bool hasInput() const { return !m_input.isNull(); }
  // The mask at the input's size, Grayscale8, white = repaint.
  const QImage& mask() const { return m_mask; }
  // Replaces the mask (scaled to the input's size when it differs), as one undoable edit.
  void setMask(const QImage& mask);
  bool hasMask() const;  // any pixel painted

  void setTool(Tool tool) { m_tool = tool; }
  Tool tool() const { return m_tool; }
  void setBrushSize(int pixels);  // diameter in image pixels
  int brushSize() const { return m_brush; }
  void setOverlayVisible(bool on);
  bool overlayVisible() const { return m_overlay; }

  void clearMask();
  void invertMask();
  void fillMask();
  void undo();
  void redo();
  bool canUndo() const { return !m_undo.isEmpty(); }
  bool canRedo() const { return !m_redo.isEmpty(); }

 signals:
  void maskChanged();

 protected:
  void paintEvent(QPaintEvent* event) override;
  void mousePressEvent(QMouseEvent* event) override;
  void mouseMoveEvent(QMouseEvent* event) override;
  void mouseReleaseEvent(QMouseEvent* event) override;

 private:
  QPointF toImage(const QPointF& widgetPos) const;
  void remember();           // the mask as it is, onto the undo stack
  void edit(const std::function<void(QImage&)>& change);  // one undoable change of the whole mask
  void strokeTo(const QPointF& imagePos);
  void changed();            // the overlay rebuilt, maskChanged emitted

  QImage m_input;
  QImage m_mask;
  QImage m_overlayImage;     // blue where the mask repaints
  QList<QImage> m_undo, m_redo;
  Tool m_tool = Tool::Brush;
  int m_brush = 24;
  bool m_overlay = true;
  bool m_painting = false;
  QPointF m_last;
};

// The editor under its tool bar (brush, eraser, size, clear, invert, fill, undo, redo, overlay).
class MaskEditorPane : public QWidget {
  Q_OBJECT
 public:
  explicit MaskEditorPane(QWidget* parent = nullptr);
  MaskEditor* editor() const { return m_editor; }

 private:
  void updateButtons();

  MaskEditor* m_editor = nullptr;
  QToolButton* m_undo = nullptr;
  QToolButton* m_redo = nullptr;
  QSpinBox* m_size = nullptr;
};

}  // namespace diffract::ui
