#include "ui/input_panel.h"

#include <QApplication>
#include <QCheckBox>
#include <QClipboard>
#include <QComboBox>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QLabel>
#include <QMimeData>
#include <QPushButton>
#include <QSlider>
#include <QSpinBox>
#include <QVBoxLayout>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/engine/image_inputs.h"
#include "core/io/image.h"
#include "ui/engine_bridge.h"
#include "ui/mask_editor.h"

namespace diffract::ui {

InputPanel::InputPanel(MaskEditor* editor, QWidget* parent) : QWidget(parent), m_editor(editor) {
  auto* outer = new QVBoxLayout(this);
  outer->setContentsMargins(0, 0, 0, 0);
  auto* group = new QGroupBox(tr("Input image"));
  group->setObjectName(QStringLiteral("inputGroup"));
  outer->addWidget(group);
  auto* layout = new QVBoxLayout(group);

  auto* top = new QHBoxLayout;
  m_thumbnail = new QLabel;
  m_thumbnail->setObjectName(QStringLiteral("inputThumbnail"));
  m_thumbnail->setFixedSize(72, 72);
  m_thumbnail->setAlignment(Qt::AlignCenter);
  m_thumbnail->setFrameShape(QFrame::StyledPanel);
  top->addWidget(m_thumbnail);
  auto* right = new QVBoxLayout;
  m_info = new QLabel;
  m_info->setObjectName(QStringLiteral("inputInfo"));
  m_info->setWordWrap(true);
  m_info->setTextFormat(Qt::PlainText);
  right->addWidget(m_info);
  auto* buttons = new QHBoxLayout;
  auto* open = new QPushButton(tr("Open…"));
  open->setObjectName(QStringLiteral("inputOpen"));
  auto* paste = new QPushButton(tr("Paste"));
  paste->setObjectName(QStringLiteral("inputPaste"));
  paste->setToolTip(tr("The image on the clipboard"));
  auto* clearButton = new QPushButton(tr("Clear"));
  clearButton->setObjectName(QStringLiteral("inputClear"));
  for (auto* b : {open, paste, clearButton}) buttons->addWidget(b);
  right->addLayout(buttons);
  top->addLayout(right, 1);
  layout->addLayout(top);

  auto* form = new QFormLayout;
  auto* strengthRow = new QHBoxLayout;
  m_strength = new QSlider(Qt::Horizontal);
  m_strength->setObjectName(QStringLiteral("inputStrength"));
  m_strength->setRange(0, 100);
  m_strength->setValue(75);
  m_strength->setToolTip(tr("How much is repainted: 0 keeps the image, 1 repaints it from noise"));
  m_strengthLabel = new QLabel;
  m_strengthLabel->setMinimumWidth(32);
  strengthRow->addWidget(m_strength, 1);
  strengthRow->addWidget(m_strengthLabel);
  form->addRow(tr("Strength"), strengthRow);

  m_maskBlur = new QSpinBox;
  m_maskBlur->setObjectName(QStringLiteral("inputMaskBlur"));
  m_maskBlur->setRange(0, 256);
  m_maskBlur->setSuffix(tr(" px"));
  m_maskBlur->setToolTip(tr("Feathers the mask's edge"));
  form->addRow(tr("Mask blur"), m_maskBlur);
  auto* fullResRow = new QHBoxLayout;
  m_fullRes = new QCheckBox(tr("Only the masked area, padded by"));
  m_fullRes->setObjectName(QStringLiteral("inputFullRes"));
  m_fullRes->setToolTip(tr("Inpaint at full resolution: the mask's region is generated at the job's size and "
                           "pasted back into the whole image"));
  m_fullResPadding = new QSpinBox;
  m_fullResPadding->setObjectName(QStringLiteral("inputFullResPadding"));
  m_fullResPadding->setRange(0, 4096);
  m_fullResPadding->setValue(32);
  m_fullResPadding->setSuffix(tr(" px"));
  fullResRow->addWidget(m_fullRes);
  fullResRow->addWidget(m_fullResPadding);
  form->addRow(QString(), fullResRow);
  m_pasteBack = new QCheckBox(tr("Keep the unmasked pixels exactly"));
  m_pasteBack->setObjectName(QStringLiteral("inputPasteBack"));
  m_pasteBack->setChecked(true);
  m_pasteBack->setToolTip(tr("Pastes the original over the result outside the mask (feathered by the blur)"));
  form->addRow(QString(), m_pasteBack);

  auto* outpaintRow = new QHBoxLayout;
  const char* names[4] = {"outpaintLeft", "outpaintTop", "outpaintRight", "outpaintBottom"};
  const QString tips[4] = {tr("Left"), tr("Top"), tr("Right"), tr("Bottom")};
  for (int i = 0; i < 4; ++i) {
    m_outpaint[i] = new QSpinBox;
    m_outpaint[i]->setObjectName(QString::fromLatin1(names[i]));
    m_outpaint[i]->setRange(0, 4096);
    m_outpaint[i]->setSingleStep(64);
    m_outpaint[i]->setToolTip(tr("%1: pixels to add on this side").arg(tips[i]));
    outpaintRow->addWidget(m_outpaint[i]);
    connect(m_outpaint[i], &QSpinBox::valueChanged, this, [this] {
      updateInfo();
      if (hasImage()) emit sizeSuggested(canvasSize());
    });
  }
  m_outpaintFill = new QComboBox;
  m_outpaintFill->setObjectName(QStringLiteral("outpaintFill"));
  m_outpaintFill->addItem(tr("edge"), QStringLiteral("edge"));
  m_outpaintFill->addItem(tr("blurred edge"), QStringLiteral("blur"));
  form->addRow(tr("Outpaint L T R B"), outpaintRow);
  form->addRow(tr("Outpaint fill"), m_outpaintFill);  // a row of its own: the pane stays narrow
  layout->addLayout(form);

  connect(m_strength, &QSlider::valueChanged, this, [this] { updateInfo(); });
  connect(m_strength, &QSlider::sliderMoved, this, [this] { m_strengthTouched = true; });
  connect(open, &QPushButton::clicked, this, [this] {
    const QString file = QFileDialog::getOpenFileName(this, tr("Input image"), QString(),
                                                      tr("Images (*.png *.jpg *.jpeg *.webp *.bmp *.tif *.tiff)"));
    if (file.isEmpty()) return;
    QString error;
    if (!loadFile(file, &error)) emit notice(error);
  });
  connect(paste, &QPushButton::clicked, this, [this] {
    const QMimeData* mime = QApplication::clipboard()->mimeData();
    if (mime && mime->hasImage()) {
      setImage(qvariant_cast<QImage>(mime->imageData()), tr("the clipboard"));
    } else if (mime && mime->hasUrls() && !mime->urls().isEmpty() && mime->urls().front().isLocalFile()) {
      QString error;
      if (!loadFile(mime->urls().front().toLocalFile(), &error)) emit notice(error);
    } else {
      emit notice(tr("The clipboard holds no image."));
    }
  });
  connect(clearButton, &QPushButton::clicked, this, &InputPanel::clear);
  connect(m_editor, &MaskEditor::maskChanged, this, [this] {
    // Inpainting repaints the mask from noise by default (diffusers' strength 1.0).
    if (!m_strengthTouched && m_editor->hasMask() && m_strength->value() == 75) m_strength->setValue(100);
    updateInfo();
  });
  updateInfo();
}

bool InputPanel::hasImage() const { return m_editor->hasInput(); }

double InputPanel::strength() const { return m_strength->value() / 100.0; }

void InputPanel::setStrength(double s) {
  m_strength->setValue(static_cast<int>(std::lround(std::clamp(s, 0.0, 1.0) * 100)));
  m_strengthTouched = true;
}

bool InputPanel::loadFile(const QString& path, QString* error) {
  const QImage image = readImageFile(path, error);
  if (image.isNull()) {
    *error = tr("Cannot use it as input: %1").arg(*error);
    return false;
  }
  setImage(image, QFileInfo(path).fileName());
  return true;
}

void InputPanel::setImage(const QImage& image, const QString& source) {
  if (image.isNull()) return;
  m_source = source;
  m_editor->setInputImage(image);
  if (image.hasAlphaChannel()) {
    const QImage argb = image.convertToFormat(QImage::Format_ARGB32);
    std::vector<std::uint8_t> alpha;
    alpha.reserve(static_cast<std::size_t>(argb.width()) * argb.height());
    for (int y = 0; y < argb.height(); ++y) {
      const auto* row = reinterpret_cast<const QRgb*>(argb.constScanLine(y));
      for (int x = 0; x < argb.width(); ++x) alpha.push_back(static_cast<std::uint8_t>(qAlpha(row[x])));
    }
    if (std::any_of(alpha.begin(), alpha.end(), [](std::uint8_t a) { return a < 255; })) {
      m_editor->setMask(toQImage(engine::mask_from_alpha(alpha, argb.width(), argb.height())));
      emit notice(tr("%1 has transparent pixels: they are the mask (repainted).").arg(source));
    }
  }
  updateInfo();
  emit imageChanged(true);
  emit sizeSuggested(canvasSize());
}

void InputPanel::clear() {
  m_source.clear();
  m_editor->setInputImage(QImage());
  updateInfo();
  emit imageChanged(false);
}

QSize InputPanel::canvasSize() const {
  if (!hasImage()) return {};
  const QSize s = m_editor->inputImage().size();
  return {s.width() + m_outpaint[0]->value() + m_outpaint[2]->value(),
          s.height() + m_outpaint[1]->value() + m_outpaint[3]->value()};
}

void InputPanel::fillRequest(job::GenerationRequest& r) const {
  r.input = job::ImageInputs{};
  if (!hasImage()) return;
  r.input.image = toCoreImage(m_editor->inputImage());
  if (m_editor->hasMask()) r.input.mask = toCoreImage(m_editor->mask().convertToFormat(QImage::Format_RGB32));
  r.input.strength = strength();
  r.input.mask_blur = m_maskBlur->value();
  r.input.full_res_padding = m_fullRes->isChecked() ? m_fullResPadding->value() : -1;
  r.input.paste_back = m_pasteBack->isChecked();
  r.input.outpaint_left = m_outpaint[0]->value();
  r.input.outpaint_top = m_outpaint[1]->value();
  r.input.outpaint_right = m_outpaint[2]->value();
  r.input.outpaint_bottom = m_outpaint[3]->value();
  r.input.outpaint_fill = m_outpaintFill->currentData().toString().toStdString();
}

void InputPanel::restore(const engine::PngParameters& p, const QDir& folder, QStringList& restored,
                         QStringList& notRestored) {
  if (!p.input_file) {
    clear();
    return;
  }
  QString error;
  if (!loadFile(folder.filePath(QString::fromStdString(*p.input_file)), &error)) {
    notRestored << tr("input image (%1)").arg(error);
    return;
  }
  restored << tr("input image");
  if (p.mask_file) {
    const QImage mask(folder.filePath(QString::fromStdString(*p.mask_file)));
    if (mask.isNull()) {
      notRestored << tr("mask (%1 is missing)").arg(QString::fromStdString(*p.mask_file));
    } else {
      m_editor->setMask(mask);
      restored << tr("mask");
    }
  }
  if (p.strength) {
    setStrength(*p.strength);
    restored << tr("strength");
  }
}

void InputPanel::updateInfo() {
  m_strengthLabel->setText(QString::number(strength(), 'f', 2));
  const bool has = hasImage();
  for (QWidget* w : std::initializer_list<QWidget*>{m_strength, m_maskBlur, m_fullRes, m_fullResPadding, m_pasteBack,
                                                    m_outpaintFill})
    w->setEnabled(has);
  for (auto* s : m_outpaint) s->setEnabled(has);
  if (!has) {
    m_thumbnail->setPixmap(QPixmap());
    m_thumbnail->setText(tr("none"));
    m_info->setText(tr("Text to image. Drop, open or paste an image (or use a result) to vary it, or paint a mask "
                       "to repaint part of it."));
    return;
  }
  const QImage& img = m_editor->inputImage();
  m_thumbnail->setPixmap(QPixmap::fromImage(img.scaled(m_thumbnail->size(), Qt::KeepAspectRatio, Qt::SmoothTransformation)));
  const QSize canvas = canvasSize();
  QString what = m_editor->hasMask() ? tr("inpainting the painted mask") : tr("image to image (paint a mask to inpaint)");
  if (canvas != img.size()) what = tr("outpainting to %1×%2").arg(canvas.width()).arg(canvas.height());
  m_info->setText(tr("%1 · %2×%3 · %4").arg(m_source).arg(img.width()).arg(img.height()).arg(what));
}

}  // namespace diffract::ui
