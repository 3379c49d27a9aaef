#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/metrics/metrics.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;

class TestMetrics : public QObject {
  Q_OBJECT
 private slots:
  void matchesScikitImage() {
    std::ifstream in(test::fixtures() / "metrics" / "metrics_cases.json");
    QVERIFY2(in.good(), "metrics_cases.json missing (metrics_fixtures)");
    const auto cases = nlohmann::json::parse(in);
    QCOMPARE(cases.size(), std::size_t(3));  // make_metrics_fixtures.py's cases
    for (const auto& c : cases) {
      io::Image a, b;
      a.height = b.height = c["height"];
      a.width = b.width = c["width"];
      a.rgb = c["a"].get<std::vector<std::uint8_t>>();
      b.rgb = c["b"].get<std::vector<std::uint8_t>>();
      const double p = metrics::psnr(a, b), s = metrics::ssim(a, b);
      const std::string name = c["name"];
      QVERIFY2(std::abs(p - c["psnr"].get<double>()) < 1e-9, qPrintable(QString("%1 psnr %2").arg(name.c_str()).arg(p)));
      QVERIFY2(std::abs(s - c["ssim"].get<double>()) < 1e-9, qPrintable(QString("%1 ssim %2").arg(name.c_str()).arg(s)));
    }
  }

  void handComputable() {
    auto a = at::zeros({3, 16, 16}, at::kDouble);
    auto b = a.clone();
    QVERIFY(std::isinf(metrics::psnr(a, b, 1.0)));
    QCOMPARE(metrics::ssim(a, b, 1.0), 1.0);
    b.fill_(0.1);  // MSE 0.01 over a range of 1: 20 dB
    QVERIFY(std::abs(metrics::psnr(a, b, 1.0) - 20.0) < 1e-9);
    auto x = at::tensor({3.0, 4.0}), y = at::tensor({0.0, 0.0}), z = at::tensor({6.0, 8.0});
    QVERIFY(std::abs(metrics::relative_l2(x, z) - 0.5) < 1e-12);   // |(-3,-4)| / |(6,8)|
    QVERIFY(std::abs(metrics::rel_mae(x, z) - 0.5) < 1e-12);       // 3.5 / 7
    QCOMPARE(metrics::relative_l2(y, y), 0.0);
    DIFFRACT_EXPECT_ERROR(metrics::psnr(x, at::zeros({3}), 1.0), "shapes differ");
    DIFFRACT_EXPECT_ERROR(metrics::ssim(at::zeros({3, 8, 8}), at::zeros({3, 8, 8}), 1.0), "11x11");
  }
};

QTEST_APPLESS_MAIN(TestMetrics)
#include "test_metrics.moc"
