// Output naming and saving: batch names, fresh GUI names, PNGs written whole or not at all.
#include <QTemporaryDir>
#include <QtTest>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/engine/output.h"
#include "core/io/image.h"
#include "core/util/error.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

io::Image gradient(int w, int h) {
  io::Image im{w, h, std::vector<std::uint8_t>(static_cast<std::size_t>(w) * h * 3)};
  for (std::size_t i = 0; i < im.rgb.size(); ++i) im.rgb[i] = static_cast<std::uint8_t>(i * 7);
  return im;
}

std::size_t filesIn(const fs::path& dir) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.is_regular_file();
  return n;
}

}  // namespace

class TestOutput : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;

  fs::path tmp(const char* name) const { return fs::path(m_tmp.filePath(name).toStdString()); }

 private slots:
  void namesBatchFiles() {
    QCOMPARE(engine::batch_file("out/a.png", 0, 1), fs::path("out/a.png"));
    QCOMPARE(engine::batch_file("out/a.png", 0, 3), fs::path("out/a_0.png"));
    QCOMPARE(engine::batch_file("out/a.png", 2, 3), fs::path("out/a_2.png"));
    QCOMPARE(engine::batch_file("a.png", 1, 2), fs::path("a_1.png"));
  }

  void batchImagesCarryTheirPosition() {
    const std::string params = "a pear\nNegative prompt: \nSteps: 4, Seed: 9";
    const std::string meta = R"({"seed": 9, "batch": 3})";
    const auto one = engine::batch_image_text(params, meta, 0, 1);
    QCOMPARE(one.parameters, params);
    QCOMPARE(one.metadata_json, meta);
    const auto third = engine::batch_image_text(params, meta, 2, 3);
    QCOMPARE(third.parameters, params + ", Batch size: 3, Batch pos: 2");
    QCOMPARE(nlohmann::json::parse(third.metadata_json).at("batch_index").get<int>(), 2);
    QCOMPARE(nlohmann::json::parse(third.metadata_json).at("seed").get<int>(), 9);
    // Metadata that is not a JSON object is kept as it is.
    QCOMPARE(engine::batch_image_text(params, "not json", 1, 2).metadata_json, std::string("not json"));
  }

  void stampsTheLocalTime() {
    // Read the clock on both sides: a second may turn between the two readings.
    const QString before = QDateTime::currentDateTime().toString("yyyyMMdd-HHmmss");
    const std::string stamp = engine::output_stamp(std::time(nullptr));
    const QString after = QDateTime::currentDateTime().toString("yyyyMMdd-HHmmss");
    QCOMPARE(stamp.size(), std::size_t(15));
    QCOMPARE(stamp[8], '-');
    const QString got = QString::fromStdString(stamp);
    QVERIFY2(got == before || got == after, qPrintable(got + " is neither " + before + " nor " + after));
  }

  void neverReusesAName() {
    const fs::path dir = tmp("fresh");
    fs::create_directories(dir);
    const auto first = engine::unused_output_file(dir, "20260102-030405", "42", 1);
    QCOMPARE(first, dir / "20260102-030405-42-1.png");
    std::ofstream(first).put('x');
    const auto second = engine::unused_output_file(dir, "20260102-030405", "42", 1);
    QCOMPARE(second, dir / "20260102-030405-42-1-1.png");
    std::ofstream(second).put('x');
    QCOMPARE(engine::unused_output_file(dir, "20260102-030405", "42", 1), dir / "20260102-030405-42-1-2.png");
    QCOMPARE(engine::unused_output_file(dir, "20260102-030405", "42", 0), dir / "20260102-030405-42-0.png");
  }

  void savesWithTheTextChunks() {
    const fs::path dir = tmp("saved");
    fs::create_directories(dir);
    const fs::path file = dir / "image.png";
    engine::save_image(file, gradient(5, 3), "a cat\nSteps: 2", "{\"seed\": 1}");
    io::PngText text;
    const io::Image back = io::read_png(file, &text);
    QCOMPARE(back.width, 5);
    QCOMPARE(back.height, 3);
    QVERIFY(back.rgb == gradient(5, 3).rgb);
    QCOMPARE(text.size(), std::size_t(2));
    QCOMPARE(text[0], (std::pair<std::string, std::string>("parameters", "a cat\nSteps: 2")));
    QCOMPARE(text[1], (std::pair<std::string, std::string>("diffract", "{\"seed\": 1}")));
    QCOMPARE(filesIn(dir), std::size_t(1));  // no temporary file left beside it
  }

  void aFailedWriteLeavesNothingBehind() {
    const fs::path dir = tmp("failed");
    fs::create_directories(dir);
    const fs::path file = dir / "image.png";
    engine::save_image(file, gradient(4, 4), "first", "{}");
    const auto before = fs::file_size(file);
    io::Image broken = gradient(4, 4);
    broken.rgb.resize(5);  // malformed: write_png refuses it
    try {
      engine::save_image(file, broken, "second", "{}");
      QFAIL("a malformed image was saved");
    } catch (const Error& e) {
      // The error names the file asked for, not the temporary one.
      QVERIFY2(std::string(e.what()).rfind(file.string() + ": ", 0) == 0, e.what());
    }
    QCOMPARE(filesIn(dir), std::size_t(1));
    QCOMPARE(fs::file_size(file), before);
    io::PngText text;
    io::read_png(file, &text);
    QCOMPARE(text[0].second, std::string("first"));
    // A folder that does not exist: an error, no file.
    QVERIFY_THROWS_EXCEPTION(Error, engine::save_image(dir / "missing" / "x.png", gradient(2, 2), "", "{}"));
    QVERIFY(!fs::exists(dir / "missing"));
  }

  void outputDirFromTheEnvironment() {
    qunsetenv("DIFFRACT_OUTPUT_DIR");
    QCOMPARE(engine::output_dir("/pictures/Diffract"), fs::path("/pictures/Diffract"));
    qputenv("DIFFRACT_OUTPUT_DIR", "/elsewhere");
    QCOMPARE(engine::output_dir("/pictures/Diffract"), fs::path("/elsewhere"));
    qunsetenv("DIFFRACT_OUTPUT_DIR");
  }
};

QTEST_APPLESS_MAIN(TestOutput)
#include "test_output.moc"
