#include "ui/mask_editor.h"

#include <QButtonGroup>
#include <QHBoxLayout>
#include <QKeySequence>
#include <QLabel>
#include <QMouseEvent>
#include <QPainter>
#include <QSpinBox>
#include <QToolButton>
#include <QVBoxLayout>
#include <algorithm>

namespace diffract::ui {

MaskEditor::MaskEditor(QWidget* parent) : ImageView(parent) {
  setObjectName(QStringLiteral("maskEditor"));
  setPanButtons(Qt::RightButton | Qt::MiddleButton);
  setCursor(Qt::CrossCursor);
  setPlaceholder(tr("No input image. Open one, paste one, drop one here, or use a result as input."));
}

void MaskEditor::setInputImage(const QImage& image) {
  m_input = image.convertToFormat(QImage::Format_RGB32);
  m_mask = QImage(m_input.size(), QImage::Format_Grayscale8);
  m_mask.fill(0);
  m_undo.clear();
  m_redo.clear();
  setImage(m_input, true);
  fitToWindow();
  changed();
}

void MaskEditor::setMask(const QImage& mask) {
  if (m_input.isNull()) return;
  remember();
  QImage m = mask.convertToFormat(QImage::Format_Grayscale8);
  if (m.size() != m_input.size()) m = m.scaled(m_input.size(), Qt::IgnoreAspectRatio, Qt::SmoothTransformation);
  m_mask = m;
  changed();
}

bool MaskEditor::hasMask() const {
  for (int y = 0; y < m_mask.height(); ++y) {
    const uchar* row = m_mask.constScanLine(y);
    if (std::any_of(row, row + m_mask.width(), [](uchar v) { return v != 0; })) return true;
  }
  return false;
}

void MaskEditor::setBrushSize(int pixels) { m_brush = std::clamp(pixels, 1, 1024); }

void MaskEditor::setOverlayVisible(bool on) {
  m_overlay = on;
  update();
}

void MaskEditor::edit(const std::function<void(QImage&)>& change) {
  if (m_input.isNull()) return;
  remember();
  change(m_mask);
  changed();
}

void MaskEditor::clearMask() {
  edit([](QImage& m) { m.fill(0); });
}

void MaskEditor::invertMask() {
  edit([](QImage& m) { m.invertPixels(); });
}

void MaskEditor::fillMask() {
  edit([](QImage& m) { m.fill(255); });
}

void MaskEditor::undo() {
  if (m_undo.isEmpty()) return;
  m_redo.append(m_mask);
  m_mask = m_undo.takeLast();
  changed();
}

void MaskEditor::redo() {
  if (m_redo.isEmpty()) return;
  m_undo.append(m_mask);
  m_mask = m_redo.takeLast();
  changed();
}

void MaskEditor::remember() {
  m_undo.append(m_mask);
  if (m_undo.size() > kUndoDepth) m_undo.removeFirst();
  m_redo.clear();
}

void MaskEditor::changed() {
  m_overlayImage = QImage(m_mask.size(), QImage::Format_ARGB32_Premultiplied);
  for (int y = 0; y < m_mask.height(); ++y) {
    const uchar* src = m_mask.constScanLine(y);
    auto* dst = reinterpret_cast<QRgb*>(m_overlayImage.scanLine(y));
    for (int x = 0; x < m_mask.width(); ++x) {
      // Premultiplied blue at up to 55 % opacity: it shows on reds, skin and white alike.
      const int a = src[x] * 140 / 255;
      dst[x] = qRgba(40 * a / 255, 120 * a / 255, a, a);
    }
  }
  update();
  emit maskChanged();
}

QPointF MaskEditor::toImage(const QPointF& widgetPos) const {
  const QRectF r = targetRect();
  if (r.isEmpty()) return {};
  return QPointF((widgetPos.x() - r.left()) * m_input.width() / r.width(),
                 (widgetPos.y() - r.top()) * m_input.height() / r.height());
}

void MaskEditor::strokeTo(const QPointF& imagePos) {
  QPainter p(&m_mask);
  p.setRenderHint(QPainter::Antialiasing, false);
  const QColor ink = m_tool == Tool::Brush ? Qt::white : Qt::black;
  p.setPen(QPen(ink, m_brush, Qt::SolidLine, Qt::RoundCap, Qt::RoundJoin));
  if (imagePos == m_last) {
    p.setPen(Qt::NoPen);
    p.setBrush(ink);
    p.drawEllipse(imagePos, m_brush / 2.0, m_brush / 2.0);
  } else {
    p.drawLine(m_last, imagePos);
  }
  p.end();
  m_last = imagePos;
}

void MaskEditor::paintEvent(QPaintEvent* event) {
  ImageView::paintEvent(event);
  if (m_input.isNull() || !m_overlay) return;
  QPainter p(this);
  p.drawImage(targetRect(), m_overlayImage);
}

void MaskEditor::mousePressEvent(QMouseEvent* event) {
  if (event->button() != Qt::LeftButton || m_input.isNull()) return ImageView::mousePressEvent(event);
  remember();
  m_painting = true;
  m_last = toImage(event->position());
  strokeTo(m_last);
  changed();
}

void MaskEditor::mouseMoveEvent(QMouseEvent* event) {
  if (!m_painting) return ImageView::mouseMoveEvent(event);
  strokeTo(toImage(event->position()));
  changed();
}

void MaskEditor::mouseReleaseEvent(QMouseEvent* event) {
  if (!m_painting) return ImageView::mouseReleaseEvent(event);
  m_painting = false;
}

MaskEditorPane::MaskEditorPane(QWidget* parent) : QWidget(parent) {
  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(0, 0, 0, 0);
  auto* bar = new QHBoxLayout;
  m_editor = new MaskEditor;
  const auto button = [&](const QString& name, const QString& text, const QString& tip) {
    auto* b = new QToolButton;
    b->setObjectName(name);
    b->setText(text);
    b->setToolTip(tip);
    bar->addWidget(b);
    return b;
  };
  auto* brush = button(QStringLiteral("maskBrush"), tr("Brush"), tr("Paint what to repaint (B)"));
  auto* eraser = button(QStringLiteral("maskEraser"), tr("Eraser"), tr("Erase the mask (E)"));
  brush->setCheckable(true);
  eraser->setCheckable(true);
  brush->setChecked(true);
  brush->setShortcut(QKeySequence(Qt::Key_B));
  eraser->setShortcut(QKeySequence(Qt::Key_E));
  auto* tools = new QButtonGroup(this);
  tools->setExclusive(true);
  tools->addButton(brush);
  tools->addButton(eraser);
  bar->addWidget(new QLabel(tr("Size")));
  m_size = new QSpinBox;
  m_size->setObjectName(QStringLiteral("maskBrushSize"));
  m_size->setRange(1, 1024);
  m_size->setSuffix(tr(" px"));
  m_size->setValue(m_editor->brushSize());
  bar->addWidget(m_size);
  auto* clear = button(QStringLiteral("maskClear"), tr("Clear"), tr("Nothing repainted"));
  auto* invert = button(QStringLiteral("maskInvert"), tr("Invert"), tr("Repaint what is kept and keep what is repainted"));
  auto* fill = button(QStringLiteral("maskFill"), tr("Fill"), tr("Repaint everything"));
  m_undo = button(QStringLiteral("maskUndo"), tr("Undo"), tr("Ctrl+Z"));
  m_redo = button(QStringLiteral("maskRedo"), tr("Redo"), tr("Ctrl+Shift+Z"));
  m_undo->setShortcut(QKeySequence::Undo);
  m_redo->setShortcut(QKeySequence::Redo);
  auto* overlay = button(QStringLiteral("maskOverlay"), tr("Overlay"), tr("Show the mask over the image"));
  overlay->setCheckable(true);
  overlay->setChecked(true);
  bar->addStretch(1);
  bar->addWidget(new QLabel(tr("Right-drag pans, wheel zooms")));
  layout->addLayout(bar);
  layout->addWidget(m_editor, 1);

  connect(brush, &QToolButton::toggled, this, [this](bool on) {
    if (on) m_editor->setTool(MaskEditor::Tool::Brush);
  });
  connect(eraser, &QToolButton::toggled, this, [this](bool on) {
    if (on) m_editor->setTool(MaskEditor::Tool::Eraser);
  });
  connect(m_size, &QSpinBox::valueChanged, m_editor, &MaskEditor::setBrushSize);
  connect(clear, &QToolButton::clicked, m_editor, &MaskEditor::clearMask);
  connect(invert, &QToolButton::clicked, m_editor, &MaskEditor::invertMask);
  connect(fill, &QToolButton::clicked, m_editor, &MaskEditor::fillMask);
  connect(m_undo, &QToolButton::clicked, m_editor, &MaskEditor::undo);
  connect(m_redo, &QToolButton::clicked, m_editor, &MaskEditor::redo);
  connect(overlay, &QToolButton::toggled, m_editor, &MaskEditor::setOverlayVisible);
  connect(m_editor, &MaskEditor::maskChanged, this, &MaskEditorPane::updateButtons);
  updateButtons();
}

void MaskEditorPane::updateButtons() {
  m_undo->setEnabled(m_editor->canUndo());
  m_redo->setEnabled(m_editor->canRedo());
}

}  // namespace diffract::ui
