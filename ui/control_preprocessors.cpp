#include "ui/control_preprocessors.h"

#include <algorithm>

#include <opencv2/core.hpp>
#include <opencv2/imgproc.hpp>

namespace diffract::ui {

QImage cannyEdges(const QImage& image, int low, int high) {
  if (image.isNull()) return {};
  const QImage grey = image.convertToFormat(QImage::Format_Grayscale8);
  // QImage rows are 4-byte aligned: the step says so.
  const cv::Mat in(grey.height(), grey.width(), CV_8UC1, const_cast<uchar*>(grey.constBits()),
                   static_cast<std::size_t>(grey.bytesPerLine()));
  cv::Mat edges;
  cv::Canny(in, edges, std::clamp(low, 0, 1000), std::clamp(high, 0, 1000));
  QImage out(grey.width(), grey.height(), QImage::Format_RGB888);
  for (int y = 0; y < out.height(); ++y) {
    const uchar* e = edges.ptr<uchar>(y);
    uchar* o = out.scanLine(y);
    for (int x = 0; x < out.width(); ++x) o[3 * x] = o[3 * x + 1] = o[3 * x + 2] = e[x];
  }
  return out;
}

QImage controlImage(const QImage& image, const ControlPreprocess& p, const QSize& size) {
  if (image.isNull()) return {};
  if (p.name != QLatin1String("canny")) return image.convertToFormat(QImage::Format_RGB888);
  const bool resize = size.isValid() && size != image.size();
  return cannyEdges(resize ? image.scaled(size, Qt::IgnoreAspectRatio, Qt::SmoothTransformation) : image, p.low, p.high);
}

}  // namespace diffract::ui
