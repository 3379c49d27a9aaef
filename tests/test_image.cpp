#include <fstream>

#include "core/io/image.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

class TestImage : public QObject {
  Q_OBJECT
 private slots:
  void roundTripsPixelsAndUtf8Text() {
    QTemporaryDir tmp;
    const auto path = fs::path(tmp.path().toStdString()) / "x.png";
    io::Image img;
    img.width = 5;
    img.height = 3;
    for (int i = 0; i < 45; ++i) img.rgb.push_back(static_cast<std::uint8_t>(i * 5));
    const io::PngText text = {{"parameters", "café 東京 🍎\nNegative prompt: \nSteps: 20"}, {"diffract", "{\"a\": 1}"}};
    io::write_png(path, img, text);
    io::PngText back;
    const auto read = io::read_png(path, &back);
    QCOMPARE(read.width, 5);
    QCOMPARE(read.height, 3);
    QVERIFY(read.rgb == img.rgb);
    QVERIFY(back == text);
  }

  void rejectsBadFiles() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    std::ofstream(dir / "not.png") << "hello";
    DIFFRACT_EXPECT_ERROR(io::read_png(dir / "not.png"), "not.png", "not a PNG file");
    std::ofstream(dir / "cut.png", std::ios::binary) << std::string("\x89PNG\r\n\x1a\n\0\0\0\rIHDR", 16);
    DIFFRACT_EXPECT_ERROR(io::read_png(dir / "cut.png"), "cut.png", "corrupt PNG");
    DIFFRACT_EXPECT_ERROR(io::write_png(dir / "none" / "x.png", io::Image{1, 1, {0, 0, 0}}), "cannot open for writing");
    DIFFRACT_EXPECT_ERROR(io::write_png(dir / "y.png", io::Image{2, 2, {0}}), "malformed image");
  }
};

QTEST_GUILESS_MAIN(TestImage)
#include "test_image.moc"
