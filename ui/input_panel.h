#pragma once
// The image-conditioned part of the form: the input image (open, paste, drop, or a result used
// as input), the strength, the mask's options and outpainting. The image and the mask live in
// the MaskEditor this panel drives; fillRequest() puts all of it into a job.
#include <QDir>
#include <QImage>
#include <QSize>
#include <QString>
#include <QStringList>
#include <QWidget>

#include "core/engine/png_parameters.h"
#include "core/job/request.h"

class QCheckBox;
class QComboBox;
class QLabel;
class QSlider;
class QSpinBox;

namespace diffract::ui {

class MaskEditor;

class InputPanel : public QWidget {
  Q_OBJECT
 public:
  explicit InputPanel(MaskEditor* editor, QWidget* parent = nullptr);

  bool hasImage() const;
  // A new input image; `source` names it in the panel ("photo.jpg", "result #3"). An image with
  // transparency gets its transparent pixels as the mask (said in `notice`).
  void setImage(const QImage& image, const QString& source);
  // Reads an image file (any format Qt reads, EXIF orientation applied); false with `error` set.
  bool loadFile(const QString& path, QString* error);
  void clear();
  // The job's input from the panel and the editor; leaves `r` text-to-image without an image.
  void fillRequest(job::GenerationRequest& r) const;
  double strength() const;
  void setStrength(double s);
  QString source() const { return m_source; }
  // The input image, mask and strength a restored PNG names (files in `folder`), or none.
  void restore(const engine::PngParameters& p, const QDir& folder, QStringList& restored, QStringList& notRestored);

 signals:
  // The input changed (set, cleared): the window shows the mask editor.
  void imageChanged(bool hasImage);
  // The input canvas (the image grown by the outpaint margins): the window fits the job size to it.
  void sizeSuggested(const QSize& size);
  void notice(const QString& text);

 private:
  void updateInfo();
  QSize canvasSize() const;  // the input grown by the outpaint margins

  MaskEditor* m_editor = nullptr;
  QString m_source;
  QLabel* m_thumbnail = nullptr;
  QLabel* m_info = nullptr;
  QSlider* m_strength = nullptr;
  QLabel* m_strengthLabel = nullptr;
  bool m_strengthTouched = false;  // the user moved it: painting a mask no longer sets it to 1
  QSpinBox* m_maskBlur = nullptr;
  QCheckBox* m_fullRes = nullptr;
  QSpinBox* m_fullResPadding = nullptr;
  QCheckBox* m_pasteBack = nullptr;
  QSpinBox* m_outpaint[4] = {};    // left, top, right, bottom
  QComboBox* m_outpaintFill = nullptr;
};

}  // namespace diffract::ui
