// The compare view: OpenCV metrics against scikit-image, the heatmap, the differing parameters.
#include <QApplication>
#include <QComboBox>
#include <QLabel>
#include <QMouseEvent>
#include <QPointer>
#include <QScreen>
#include <QSignalSpy>
#include <QSlider>
#include <QTableWidget>
#include <cmath>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "ui/compare_view.h"

using namespace diffract;
using diffract::ui::CompareView;

namespace {

QImage fromRgb(int width, int height, const std::vector<std::uint8_t>& rgb) {
  QImage img(width, height, QImage::Format_RGB888);
  for (int y = 0; y < height; ++y)
    std::memcpy(img.scanLine(y), rgb.data() + static_cast<std::size_t>(y) * width * 3, static_cast<std::size_t>(width) * 3);
  return img;
}

QImage filled(int w, int h, QColor c) {
  QImage img(w, h, QImage::Format_RGB32);
  img.fill(c);
  return img;
}

}  // namespace

class TestCompareView : public QObject {
  Q_OBJECT
 private slots:
  void metricsMatchScikitImage() {
    std::ifstream in(test::fixtures() / "metrics" / "metrics_cases.json");
    QVERIFY2(in.good(), "metrics_cases.json missing (metrics_fixtures)");
    const auto cases = nlohmann::json::parse(in);
    QVERIFY(cases.size() >= 3);
    for (const auto& c : cases) {
      const int w = c["width"], h = c["height"];
      const auto r = ui::compareImages(fromRgb(w, h, c["a"].get<std::vector<std::uint8_t>>()),
                                       fromRgb(w, h, c["b"].get<std::vector<std::uint8_t>>()));
      const std::string name = c["name"];
      QVERIFY2(r.error.isEmpty(), qPrintable(r.error));
      QVERIFY2(std::abs(r.psnr - c["psnr"].get<double>()) < 1e-9, qPrintable(QString("%1 psnr %2").arg(name.c_str()).arg(r.psnr)));
      QVERIFY2(std::abs(r.ssim - c["ssim"].get<double>()) < 1e-9, qPrintable(QString("%1 ssim %2").arg(name.c_str()).arg(r.ssim)));
    }
  }

  void handComputableMetrics() {
    const QImage a = filled(20, 16, QColor(100, 100, 100));
    const auto same = ui::compareImages(a, a);
    QVERIFY(std::isinf(same.psnr));
    QCOMPARE(same.ssim, 1.0);
    const auto off = ui::compareImages(a, filled(20, 16, QColor(110, 110, 110)));  // MSE 100: 10 log10(255^2 / 100)
    QVERIFY(std::abs(off.psnr - 10 * std::log10(255.0 * 255.0 / 100.0)) < 1e-9);
    const auto sizes = ui::compareImages(a, filled(21, 16, Qt::black));
    QVERIFY(std::isnan(sizes.psnr));
    QVERIFY(sizes.heatmap.isNull());
    QVERIFY2(sizes.error.contains("differ in size (20×16 and 21×16)"), qPrintable(sizes.error));
    QVERIFY(std::isnan(ui::compareImages(filled(8, 8, Qt::red), filled(8, 8, Qt::blue)).ssim));  // too small
  }

  void heatmapMarksTheDifference() {
    QImage a = filled(40, 30, Qt::white);
    QImage b = a;
    b.setPixelColor(31, 7, QColor(0, 0, 0));  // the largest difference: the hottest colour
    b.setPixelColor(3, 20, QColor(200, 200, 200));
    const auto r = ui::compareImages(a, b);
    QCOMPARE(r.heatmap.size(), QSize(40, 30));
    const QColor hot = r.heatmap.pixelColor(31, 7), cold = r.heatmap.pixelColor(0, 0), mid = r.heatmap.pixelColor(3, 20);
    QVERIFY(hot != cold && mid != cold && mid != hot);
    QVERIFY(cold.red() < 10 && cold.green() < 10 && cold.blue() < 10);  // INFERNO at 0 is near black
    QVERIFY(hot.red() > 200 && hot.green() > 200);  // INFERNO at 255 is pale yellow
    QCOMPARE(r.heatmap.pixelColor(39, 29), cold);
  }

  void escClosesTheWindow() {
    QWidget owner;
    auto* view = CompareView::openWindow({{"a", filled(16, 16, Qt::white), "{}"}, {"b", filled(16, 16, Qt::black), "{}"}},
                                         0, 1, &owner);
    QPointer<CompareView> alive(view);
    QVERIFY(QTest::qWaitForWindowExposed(view));
    view->activateWindow();
    QVERIFY(QTest::qWaitForWindowActive(view));
    QTest::keyClick(view, Qt::Key_Escape);
    QTRY_VERIFY(alive.isNull());  // closed, and deleted on close
  }

  // Dragging on the image moves the slider with the divider; the window fits the screen.
  void dragMovesTheSliderAndTheWindowFits() {
    QWidget owner;
    auto* view = CompareView::openWindow({{"a", filled(64, 64, Qt::white), "{}"}, {"b", filled(64, 64, Qt::black), "{}"}},
                                         0, 1, &owner);
    QVERIFY(QTest::qWaitForWindowExposed(view));
    const QSize screen = view->screen()->availableGeometry().size();
    QVERIFY2(view->height() <= screen.height() && view->width() <= screen.width(),
             qPrintable(QString("%1x%2 on %3x%4").arg(view->width()).arg(view->height()).arg(screen.width()).arg(screen.height())));
    auto* swipe = view->findChild<ui::SwipeView*>();
    auto* slider = view->findChild<QSlider*>("swipeSlider");
    QVERIFY(swipe && slider);
    const QRect r = swipe->rect();
    QTest::mousePress(swipe, Qt::LeftButton, {}, QPoint(r.center().x(), r.center().y()));
    const QPoint right(r.center().x() + std::min(r.width(), r.height()) / 4, r.center().y());
    QMouseEvent move(QEvent::MouseMove, QPointF(right), swipe->mapToGlobal(QPointF(right)), Qt::NoButton, Qt::LeftButton,
                     Qt::NoModifier);
    QApplication::sendEvent(swipe, &move);
    QTest::mouseRelease(swipe, Qt::LeftButton, {}, right);
    QVERIFY(swipe->position() > 0.55);
    QCOMPARE(slider->value(), static_cast<int>(std::lround(swipe->position() * 1000)));
    view->close();
  }

  void tableListsDifferingParameters() {
    const QString a = R"({"prompt": "a mug", "steps": 30, "cfg": 7.0, "seed": 1, "sampler": "euler",
                          "timings_ms": {"total": 5}, "width": 512})";
    const QString b = R"({"prompt": "a mug", "steps": 20, "cfg": 7.0, "seed": 2, "sampler": "euler",
                          "timings_ms": {"total": 9}, "strategy_name": "step-skip", "width": 512})";
    const auto diffs = ui::differingParameters(a, b);
    QCOMPARE(diffs.size(), 3);
    QCOMPARE(diffs[0].key, QStringLiteral("seed"));
    QCOMPARE(diffs[0].a, QStringLiteral("1"));
    QCOMPARE(diffs[0].b, QStringLiteral("2"));
    QCOMPARE(diffs[1].key, QStringLiteral("steps"));
    QCOMPARE(diffs[2].key, QStringLiteral("strategy_name"));
    QCOMPARE(diffs[2].a, QStringLiteral("—"));
    QCOMPARE(diffs[2].b, QStringLiteral("step-skip"));
    QVERIFY(ui::differingParameters(a, a).isEmpty());
    // Seeds past 2^53 differ by one: still a difference, printed exactly.
    const auto seeds = ui::differingParameters(R"({"seed": 1152921504606846976, "cfg": 7})",
                                               R"({"seed": 1152921504606846977, "cfg": 7.0})");
    QCOMPARE(seeds.size(), 1);
    QCOMPARE(seeds[0].b, QStringLiteral("1152921504606846977"));
    QCOMPARE(ui::differingParameters("not json", R"({"steps": 3})").value(0).a, QStringLiteral("—"));

    CompareView view({{"first", filled(32, 32, Qt::white), a}, {"second", filled(32, 32, Qt::gray), b}}, 0, 1);
    QSignalSpy done(&view, &CompareView::computed);
    QVERIFY(done.wait(10000));
    auto* table = view.findChild<QTableWidget*>("differencesTable");
    QVERIFY(table);
    QCOMPARE(table->rowCount(), 3);
    QCOMPARE(table->item(1, 0)->text(), QStringLiteral("steps"));
    QCOMPARE(table->item(1, 1)->text(), QStringLiteral("30"));
    QCOMPARE(table->item(1, 2)->text(), QStringLiteral("20"));
    QVERIFY(view.findChild<QLabel*>("compareMetricsLabel")->text().contains("PSNR"));
    QCOMPARE(view.comparison().heatmap.size(), QSize(32, 32));
    // Picking the same image on both sides: identical, no differences.
    view.findChild<QComboBox*>("compareB")->setCurrentIndex(0);
    QVERIFY(done.wait(10000));
    QCOMPARE(table->rowCount(), 0);
    QVERIFY(view.findChild<QLabel*>("compareMetricsLabel")->text().contains("identical"));
  }
};

QTEST_MAIN(TestCompareView)
#include "test_compare_view.moc"
