#include "ui/compare_view.h"

#include <QFileInfo>
#include <QKeySequence>
#include <QShortcut>
#include <QImageReader>
#include <QComboBox>
#include <QFutureWatcher>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QMouseEvent>
#include <QPainter>
#include <QScreen>
#include <QSignalBlocker>
#include <QSlider>
#include <QStackedWidget>
#include <QTableWidget>
#include <QVBoxLayout>
#include <QtConcurrent/QtConcurrentRun>
#include <cmath>
#include <limits>
#include <set>
#include <vector>
#include <nlohmann/json.hpp>
#include <opencv2/core.hpp>
#include <opencv2/imgproc.hpp>

#include "ui/image_view.h"

namespace diffract::ui {

namespace {

cv::Mat toMat(const QImage& image) {
  const QImage rgb = image.convertToFormat(QImage::Format_RGB888);
  return cv::Mat(rgb.height(), rgb.width(), CV_8UC3, const_cast<uchar*>(rgb.constBits()),
                 static_cast<std::size_t>(rgb.bytesPerLine()))
      .clone();
}

// As core/metrics and scikit-image's structural_similarity(gaussian_weights=True, sigma=1.5,
// use_sample_covariance=False): 11-tap gaussian statistics, the map averaged over pixels at
// least 5 from the border, then over channels.
double ssimChannel(const cv::Mat& x, const cv::Mat& y) {
  constexpr int kPad = 5;
  const auto blur = [](const cv::Mat& m) {
    cv::Mat out;
    cv::GaussianBlur(m, out, cv::Size(2 * kPad + 1, 2 * kPad + 1), 1.5, 1.5, cv::BORDER_REFLECT);
    return out;
  };
  const cv::Mat ux = blur(x), uy = blur(y);
  const cv::Mat vx = blur(x.mul(x)) - ux.mul(ux);
  const cv::Mat vy = blur(y.mul(y)) - uy.mul(uy);
  const cv::Mat vxy = blur(x.mul(y)) - ux.mul(uy);
  const double c1 = std::pow(0.01 * 255, 2), c2 = std::pow(0.03 * 255, 2);
  const cv::Mat num = (2 * ux.mul(uy) + c1).mul(2 * vxy + c2);
  const cv::Mat den = (ux.mul(ux) + uy.mul(uy) + c1).mul(vx + vy + c2);
  cv::Mat s;
  cv::divide(num, den, s);
  return cv::mean(s(cv::Rect(kPad, kPad, s.cols - 2 * kPad, s.rows - 2 * kPad)))[0];
}

double ssim(const cv::Mat& a8, const cv::Mat& b8) {
  if (a8.rows < 11 || a8.cols < 11) return std::numeric_limits<double>::quiet_NaN();
  cv::Mat a, b;
  a8.convertTo(a, CV_64F);
  b8.convertTo(b, CV_64F);
  // Per channel: OpenCV adds a scalar to the first channel of a multi-channel matrix only.
  std::vector<cv::Mat> as, bs;
  cv::split(a, as);
  cv::split(b, bs);
  double sum = 0;
  for (std::size_t c = 0; c < as.size(); ++c) sum += ssimChannel(as[c], bs[c]);
  return sum / static_cast<double>(as.size());
}

QString valueText(const nlohmann::json& v) {
  return QString::fromStdString(v.is_string() ? v.get<std::string>() : v.dump());
}

}  // namespace

ImageComparison compareImages(const QImage& a, const QImage& b) {
  ImageComparison out;
  out.psnr = out.ssim = std::numeric_limits<double>::quiet_NaN();
  if (a.isNull() || b.isNull()) {
    out.error = QObject::tr("an image is missing");
    return out;
  }
  if (a.size() != b.size()) {
    out.error = QObject::tr("the images differ in size (%1×%2 and %3×%4)")
                    .arg(a.width()).arg(a.height()).arg(b.width()).arg(b.height());
    return out;
  }
  const cv::Mat ma = toMat(a), mb = toMat(b);
  cv::Mat diff;
  cv::absdiff(ma, mb, diff);
  out.psnr = cv::norm(diff, cv::NORM_L2) == 0 ? std::numeric_limits<double>::infinity() : cv::PSNR(ma, mb, 255);
  out.ssim = ssim(ma, mb);

  cv::Mat grey;
  cv::transform(diff, grey, cv::Matx13f(1.f / 3, 1.f / 3, 1.f / 3));  // the channel mean, as core's heatmap
  double maxDiff = 0;
  cv::minMaxLoc(grey, nullptr, &maxDiff);
  cv::Mat scaled;
  grey.convertTo(scaled, CV_8U, maxDiff > 0 ? 255.0 / maxDiff : 0.0);
  cv::Mat coloured, rgb;
  cv::applyColorMap(scaled, coloured, cv::COLORMAP_INFERNO);
  cv::cvtColor(coloured, rgb, cv::COLOR_BGR2RGB);
  out.heatmap = QImage(rgb.data, rgb.cols, rgb.rows, static_cast<qsizetype>(rgb.step), QImage::Format_RGB888).copy();
  return out;
}

QList<ParameterDifference> differingParameters(const QString& metadataA, const QString& metadataB) {
  // nlohmann keeps 64-bit seeds exact, where QJsonValue would round them to doubles.
  const auto parse = [](const QString& text) {
    auto j = nlohmann::json::parse(text.toStdString(), nullptr, /*allow_exceptions=*/false);
    return j.is_object() ? j : nlohmann::json::object();
  };
  const nlohmann::json a = parse(metadataA), b = parse(metadataB);
  std::set<std::string> keys;
  for (const auto& [key, value] : a.items()) keys.insert(key);
  for (const auto& [key, value] : b.items()) keys.insert(key);
  QList<ParameterDifference> out;
  const QString absent = QStringLiteral("—");
  for (const std::string& key : keys) {
    if (key == "timings_ms" || key == "strategy") continue;
    const auto ia = a.find(key), ib = b.find(key);
    const bool inA = ia != a.end(), inB = ib != b.end();
    if (inA && inB && *ia == *ib) continue;
    out.append({QString::fromStdString(key), inA ? valueText(*ia) : absent, inB ? valueText(*ib) : absent});
  }
  return out;
}

// ---- SwipeView ----

SwipeView::SwipeView(QWidget* parent) : QWidget(parent) {
  setObjectName(QStringLiteral("swipeView"));
  setMinimumSize(200, 200);
  setCursor(Qt::SplitHCursor);
}

void SwipeView::setImages(const QImage& a, const QImage& b) {
  m_a = a;
  m_b = b;
  update();
}

void SwipeView::setPosition(double fraction) {
  m_position = std::clamp(fraction, 0.0, 1.0);
  update();
}

QRectF SwipeView::targetRect() const {
  if (m_a.isNull()) return {};
  const QSizeF size = QSizeF(m_a.size()).scaled(QSizeF(this->size()), Qt::KeepAspectRatio);
  return {QPointF((width() - size.width()) / 2, (height() - size.height()) / 2), size};
}

void SwipeView::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), palette().window());
  const QRectF target = targetRect();
  if (target.isEmpty()) return;
  p.setRenderHint(QPainter::SmoothPixmapTransform);
  const double split = target.left() + target.width() * m_position;
  p.drawImage(target, m_b);
  p.save();
  p.setClipRect(QRectF(target.topLeft(), QPointF(split, target.bottom())));
  p.drawImage(target, m_a);
  p.restore();
  p.setPen(QPen(Qt::white, 2));
  p.drawLine(QPointF(split, target.top()), QPointF(split, target.bottom()));
}

void SwipeView::mousePressEvent(QMouseEvent* event) { mouseMoveEvent(event); }

void SwipeView::mouseMoveEvent(QMouseEvent* event) {
  const QRectF target = targetRect();
  if (target.width() <= 0 || !(event->buttons() & Qt::LeftButton)) return;
  setPosition((event->position().x() - target.left()) / target.width());
  emit dragged(m_position);
}

// ---- CompareView ----

CompareView::CompareView(QList<Item> items, int a, int b, QWidget* parent) : QWidget(parent), m_items(std::move(items)) {
  setObjectName(QStringLiteral("compareView"));
  setWindowTitle(tr("Compare"));
  // Esc closes the window (it is one when opened with openWindow).
  auto* close = new QShortcut(QKeySequence(Qt::Key_Escape), this);
  close->setContext(Qt::WidgetWithChildrenShortcut);
  connect(close, &QShortcut::activated, this, &QWidget::close);
  auto* layout = new QVBoxLayout(this);

  auto* pickRow = new QHBoxLayout;
  m_pickA = new QComboBox;
  m_pickA->setObjectName(QStringLiteral("compareA"));
  m_pickB = new QComboBox;
  m_pickB->setObjectName(QStringLiteral("compareB"));
  for (const Item& item : m_items) {
    m_pickA->addItem(item.label);
    m_pickB->addItem(item.label);
  }
  m_pickA->setCurrentIndex(a);
  m_pickB->setCurrentIndex(b);
  m_mode = new QComboBox;
  m_mode->setObjectName(QStringLiteral("compareMode"));
  m_mode->addItems({tr("Swipe"), tr("Side by side"), tr("Difference")});
  pickRow->addWidget(new QLabel(tr("A")));
  pickRow->addWidget(m_pickA, 1);
  pickRow->addWidget(new QLabel(tr("B")));
  pickRow->addWidget(m_pickB, 1);
  pickRow->addWidget(m_mode);
  layout->addLayout(pickRow);

  m_pages = new QStackedWidget;
  auto* swipePage = new QWidget;
  auto* swipeLayout = new QVBoxLayout(swipePage);
  swipeLayout->setContentsMargins(0, 0, 0, 0);
  m_swipe = new SwipeView;
  m_slider = new QSlider(Qt::Horizontal);
  m_slider->setObjectName(QStringLiteral("swipeSlider"));
  m_slider->setRange(0, 1000);
  m_slider->setValue(500);
  swipeLayout->addWidget(m_swipe, 1);
  swipeLayout->addWidget(m_slider);
  connect(m_slider, &QSlider::valueChanged, this, [this](int v) { m_swipe->setPosition(v / 1000.0); });
  connect(m_swipe, &SwipeView::dragged, this, [this](double fraction) {
    const QSignalBlocker block(m_slider);
    m_slider->setValue(static_cast<int>(std::lround(fraction * 1000)));
  });
  m_pages->addWidget(swipePage);

  auto* sideBySide = new QWidget;
  auto* sideLayout = new QHBoxLayout(sideBySide);
  sideLayout->setContentsMargins(0, 0, 0, 0);
  m_left = new ImageView;
  m_right = new ImageView;
  sideLayout->addWidget(m_left);
  sideLayout->addWidget(m_right);
  m_pages->addWidget(sideBySide);

  m_heatmap = new ImageView;
  m_heatmap->setObjectName(QStringLiteral("heatmapView"));
  m_heatmap->setPlaceholder(tr("Computing…"));
  m_pages->addWidget(m_heatmap);
  layout->addWidget(m_pages, 1);
  connect(m_mode, &QComboBox::currentIndexChanged, m_pages, &QStackedWidget::setCurrentIndex);

  m_metrics = new QLabel;
  m_metrics->setObjectName(QStringLiteral("compareMetricsLabel"));
  m_metrics->setTextInteractionFlags(Qt::TextSelectableByMouse);
  layout->addWidget(m_metrics);

  m_table = new QTableWidget(0, 3);
  m_table->setObjectName(QStringLiteral("differencesTable"));
  m_table->setHorizontalHeaderLabels({tr("Parameter"), tr("A"), tr("B")});
  m_table->horizontalHeader()->setStretchLastSection(true);
  m_table->verticalHeader()->hide();
  m_table->setEditTriggers(QAbstractItemView::NoEditTriggers);
  m_table->setMaximumHeight(180);
  layout->addWidget(m_table);

  connect(m_pickA, &QComboBox::currentIndexChanged, this, &CompareView::compare);
  connect(m_pickB, &QComboBox::currentIndexChanged, this, &CompareView::compare);
  // Within the screen (a 1280x720 laptop's leaves about 680 px of height).
  QSize size(1000, 800);
  if (const QScreen* s = screen()) size = size.boundedTo(s->availableGeometry().size() * 0.95);
  resize(size);
  compare();
}

void CompareView::compare() {
  const int ia = m_pickA->currentIndex(), ib = m_pickB->currentIndex();
  if (ia < 0 || ib < 0 || ia >= m_items.size() || ib >= m_items.size()) return;
  const Item& a = m_items[ia];
  const Item& b = m_items[ib];
  m_swipe->setImages(a.image, b.image);
  m_left->setImage(a.image, true);
  m_right->setImage(b.image, true);

  const auto diffs = differingParameters(a.metadataJson, b.metadataJson);
  m_table->setRowCount(static_cast<int>(diffs.size()));
  for (int r = 0; r < diffs.size(); ++r) {
    m_table->setItem(r, 0, new QTableWidgetItem(diffs[r].key));
    m_table->setItem(r, 1, new QTableWidgetItem(diffs[r].a));
    m_table->setItem(r, 2, new QTableWidgetItem(diffs[r].b));
  }

  m_metrics->setText(tr("Computing PSNR and SSIM…"));
  const int generation = ++m_generation;
  auto* watcher = new QFutureWatcher<ImageComparison>(this);
  connect(watcher, &QFutureWatcher<ImageComparison>::finished, this, [this, watcher, generation] {
    watcher->deleteLater();
    if (generation != m_generation) return;
    m_comparison = watcher->result();
    if (!m_comparison.error.isEmpty()) {
      m_metrics->setText(tr("Cannot compare: %1").arg(m_comparison.error));
      m_heatmap->setImage(QImage(), true);
      m_heatmap->setPlaceholder(m_comparison.error);
    } else {
      m_metrics->setText(tr("PSNR %1 · SSIM %2")
                             .arg(std::isinf(m_comparison.psnr) ? tr("∞ (identical)")
                                                                 : tr("%1 dB").arg(m_comparison.psnr, 0, 'f', 2))
                             .arg(std::isnan(m_comparison.ssim) ? tr("n/a (under 11 px)")
                                                                 : QString::number(m_comparison.ssim, 'f', 4)));
      m_heatmap->setImage(m_comparison.heatmap, true);
    }
    emit computed();
  });
  watcher->setFuture(QtConcurrent::run(compareImages, a.image, b.image));
}

CompareView* CompareView::openWindow(QList<Item> items, int a, int b, QWidget* parent) {
  auto* view = new CompareView(std::move(items), a, b, parent);
  view->setWindowFlag(Qt::Window);
  view->setAttribute(Qt::WA_DeleteOnClose);
  view->show();
  return view;
}

QPair<QList<CompareView::Item>, QString> CompareView::readFiles(const QStringList& paths) {
  QPair<QList<Item>, QString> out;
  for (const QString& path : paths) {
    QImageReader reader(path);
    const QImage image = reader.read();
    if (image.isNull()) {
      out.first.clear();
      out.second = tr("%1: %2").arg(QFileInfo(path).fileName(), reader.errorString());
      return out;
    }
    out.first.append({QFileInfo(path).fileName(), image, image.text(QStringLiteral("diffract"))});
  }
  return out;
}

}  // namespace diffract::ui
