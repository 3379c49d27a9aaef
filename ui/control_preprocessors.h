#pragma once
// What the GUI makes a ControlNet's control image with (OpenCV; the core takes any RGB image).
// "none" passes the user's image as it is (depth, normal, pose and edge maps made elsewhere);
// "canny" is OpenCV's Canny edge detector on the image's luminance, white edges on black, as
// the canny ControlNets were trained on.
#include <QImage>
#include <QSize>
#include <QString>

namespace diffract::ui {

struct ControlPreprocess {
  QString name = QStringLiteral("none");  // "none" or "canny" (engine::control_preprocessors())
  int low = 100, high = 200;              // canny's hysteresis thresholds, 0..1000
};

// White edges (255) on black, RGB888, the image's size. Thresholds as cv::Canny's (3x3 Sobel, L1).
QImage cannyEdges(const QImage& image, int low, int high);

// The control image for a job of `size` (invalid: the image's own size). "none": the image as it
// is (the core resizes it to the job, Lanczos, as diffusers does); "canny": the image scaled to
// the size first (smoothly, ignoring its aspect), so the edges are one pixel wide in the job.
QImage controlImage(const QImage& image, const ControlPreprocess& p, const QSize& size = {});

}  // namespace diffract::ui
