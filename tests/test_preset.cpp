// Presets: JSON round trip, the shipped files, and errors that name the file and the field.
#include <sys/stat.h>

#include <QTemporaryDir>
#include <cstdlib>
#include <fstream>
#include <set>

#include "core/engine/preset.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path shippedDir() {
  const char* d = std::getenv("DIFFRACT_PRESETS_DIR");
  return d ? fs::path(d) : fs::path("presets");
}

void writeText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

const char* const kValid = R"({"name": "Test", "prompt_template": "photo of {subject}", "negative_prompt": "blurry",
  "width": 512, "height": 768, "steps": 20, "sampler": "euler", "cfg": 5.5, "strategy": "single"})";

}  // namespace

class TestPreset : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;

  fs::path tmp(const char* name) const { return fs::path(m_tmp.filePath(name).toStdString()); }

 private slots:
  void roundTrip() {
    engine::Preset p;
    p.name = "Round trip «ü»";
    p.description = "every field set";
    p.prompt_template = "a {subject}, and again {subject}";
    p.negative_prompt = "text, \"quoted\"\nsecond line";
    p.width = 1344;
    p.height = 768;
    p.steps = 42;
    p.sampler = "dpmpp-2m-karras";
    p.cfg = 6.25;
    p.guidance = 2.75;
    p.strategy = "step-skip";
    p.skip = 3;
    const fs::path file = tmp("user/presets/round-trip.json");
    engine::save_preset(p, file);
    const auto q = engine::load_preset(file);
    QCOMPARE(q.name, p.name);
    QCOMPARE(q.description, p.description);
    QCOMPARE(q.prompt_template, p.prompt_template);
    QCOMPARE(q.negative_prompt, p.negative_prompt);
    QCOMPARE(q.width, 1344);
    QCOMPARE(q.height, 768);
    QCOMPARE(q.steps, 42);
    QCOMPARE(q.sampler, p.sampler);
    QCOMPARE(q.cfg, 6.25);
    QCOMPARE(q.guidance, 2.75);
    QCOMPARE(q.strategy, p.strategy);
    QCOMPARE(q.skip, 3);
    QCOMPARE(q.devices, 1);
    // fbcache's threshold, written for it only.
    p.strategy = "fbcache";
    p.cache_threshold = 0.2;
    engine::save_preset(p, file);
    QCOMPARE(engine::load_preset(file).cache_threshold, 0.2);
    QCOMPARE(engine::preset_file_name(p.name), std::string("round-trip.json"));
    QCOMPARE(engine::preset_file_name("  Hero   Banner 16:9 "), std::string("hero-banner-16-9.json"));
    QCOMPARE(engine::preset_file_name("!!!"), std::string("preset.json"));
  }

  void presetFromARequestRoundTrips() {
    job::GenerationRequest r;
    r.prompt = "ignored: the template is the preset's";
    r.negative_prompt = "blurry";
    r.width = 768;
    r.height = 512;
    r.steps = 12;
    r.sampler = "ddim";
    r.cfg = 4.5;
    r.strategy.name = "cfg-parallel";
    r.strategy.devices = 2;
    r.strategy.skip = 5;  // not cfg-parallel's: the preset keeps its default
    auto p = engine::preset_from_request("Mine", "a {subject} at dusk", r);
    QCOMPARE(p.name, std::string("Mine"));
    QCOMPARE(p.prompt_template, std::string("a {subject} at dusk"));
    QCOMPARE(p.devices, 2);
    QCOMPARE(p.skip, 2);
    const fs::path file = tmp("from-request/mine.json");
    engine::save_preset(p, file);
    job::GenerationRequest back;
    engine::apply_preset(engine::load_preset(file), "fox", back);
    QCOMPARE(back.prompt, std::string("a fox at dusk"));
    QCOMPARE(back.negative_prompt, r.negative_prompt);
    QCOMPARE(back.width, 768);
    QCOMPARE(back.height, 512);
    QCOMPARE(back.steps, 12);
    QCOMPARE(back.sampler, r.sampler);
    QCOMPARE(back.cfg, 4.5);
    QCOMPARE(back.strategy.name, r.strategy.name);
    QCOMPARE(back.strategy.devices, 2);

    // Step-skip runs on one device: its skip factor is what the preset keeps, through a file.
    r.strategy.name = "step-skip";
    r.strategy.devices = 1;
    r.strategy.skip = 3;
    p = engine::preset_from_request("Skips", "{subject}", r);
    QCOMPARE(p.skip, 3);
    QCOMPARE(p.devices, 1);
    engine::save_preset(p, file);
    engine::apply_preset(engine::load_preset(file), "x", back);
    QCOMPARE(back.strategy.name, std::string("step-skip"));
    QCOMPARE(back.strategy.skip, 3);
    QCOMPARE(back.strategy.devices, 1);

    // The plain loop by either of its names is "single".
    r.strategy.name.clear();
    QCOMPARE(engine::preset_from_request("Plain", "{subject}", r).strategy, std::string("single"));
  }

  void everyShippedPresetLoads() {
    QVERIFY2(fs::is_directory(shippedDir()), shippedDir().c_str());
    std::set<std::string> names, stems;
    for (const auto& e : fs::directory_iterator(shippedDir())) {
      if (e.path().extension() != ".json") continue;
      engine::Preset p;
      try {
        p = engine::load_preset(e.path());
      } catch (const Error& err) {
        QFAIL(err.what());
      }
      QVERIFY2(names.insert(p.name).second, ("two presets are called " + p.name).c_str());
      stems.insert(e.path().stem().string());
      QVERIFY(!p.description.empty());
      QVERIFY(p.width > 0 && p.height > 0);
    }
    for (const char* want : {"studio-packshot", "lifestyle-scene", "hero-banner", "flat-lay", "fast-draft"})
      QVERIFY2(stems.count(want), want);
    const auto hero = engine::load_preset(shippedDir() / "hero-banner.json");
    // SDXL's nearest training bucket to 16:9 is 1344x768 (1.75).
    QVERIFY(std::abs(double(hero.width) / hero.height - 16.0 / 9) < 0.05);
  }

  void fillsTheTemplate() {
    QCOMPARE(engine::fill_prompt_template("a {subject} and a {subject}!", "mug"), std::string("a mug and a mug!"));
    QCOMPARE(engine::fill_prompt_template("{subject}", ""), std::string());
    const auto p = engine::parse_preset(kValid, "inline");
    job::GenerationRequest r;
    r.model = "m";
    r.seed = 9;
    engine::apply_preset(p, "a red teapot", r);
    QCOMPARE(r.prompt, std::string("photo of a red teapot"));
    QCOMPARE(r.negative_prompt, std::string("blurry"));
    QCOMPARE(r.width, 512);
    QCOMPARE(r.height, 768);
    QCOMPARE(r.steps, 20);
    QCOMPARE(r.sampler, std::string("euler"));
    QCOMPARE(r.cfg, 5.5);
    QCOMPARE(r.model, std::string("m"));  // untouched
    QCOMPARE(r.seed, std::uint64_t(9));
  }

  // step-skip's skip factor has a field of its own; files that gave it as "devices" read the same.
  void stepSkipReadsItsSkipFactor() {
    const std::string head = R"({"name": "S", "prompt_template": "{subject}", "width": 0, "height": 0, "steps": 20,
      "sampler": "", "cfg": 5, "strategy": "step-skip", )";
    auto p = engine::parse_preset(head + R"("skip": 4})", "new");
    QCOMPARE(p.skip, 4);
    QCOMPARE(p.devices, 1);
    p = engine::parse_preset(head + R"("devices": 3})", "old");
    QCOMPARE(p.skip, 3);
    QCOMPARE(p.devices, 1);
    job::GenerationRequest r;
    engine::apply_preset(p, "x", r);
    QCOMPARE(r.strategy.name, std::string("step-skip"));
    QCOMPARE(r.strategy.skip, 3);
    QCOMPARE(r.strategy.devices, 1);
    DIFFRACT_EXPECT_ERROR(engine::parse_preset(head + R"("skip": 0})", "zero"), "zero", "strategy", "skip of 1 or more");
  }

  void badFilesGiveNamedErrors_data() {
    QTest::addColumn<QString>("text");
    QTest::addColumn<QString>("fragment");
    auto edit = [](const char* from, const char* to) {
      QString s = QString::fromUtf8(kValid);
      s.replace(QString::fromUtf8(from), QString::fromUtf8(to));
      return s;
    };
    QTest::newRow("not json") << "{\"name\": " << "malformed JSON";
    // Hostile files: nesting that a recursive dump() of the value would overflow the stack on, a
    // count that wraps to -1, a key of 100 000 characters (named, not echoed whole).
    QTest::newRow("nested name") << edit("\"Test\"", (std::string(100000, '[') + std::string(100000, ']')).c_str())
                                 << "nested deeper than 64 levels";
    QTest::newRow("steps 2^64-1") << edit("20", "18446744073709551615")
                                  << "field 'steps' must be a whole number of at most 2^30, not 18446744073709551615";
    QTest::newRow("number overflow") << edit("5.5", "1e400") << "malformed JSON";
    QTest::newRow("huge key") << edit("\"steps\"", ("\"" + std::string(100000, 'k') + "\"").c_str())
                              << "(100000 characters) (known:";
    QTest::newRow("not an object") << "[1, 2]" << "must be a JSON object";
    QTest::newRow("missing name") << edit("\"name\": \"Test\", ", "") << "missing field 'name'";
    QTest::newRow("empty name") << edit("\"Test\"", "\" \"") << "field 'name' is empty";
    QTest::newRow("no placeholder") << edit("{subject}", "subject") << "'prompt_template' has no {subject}";
    QTest::newRow("width not a number") << edit("512", "\"512\"") << "field 'width' must be a whole number";
    QTest::newRow("fractional steps") << edit("20", "20.5") << "field 'steps' must be a whole number";
    QTest::newRow("odd width") << edit("512", "500") << "field 'width' is 500";
    QTest::newRow("one side zero") << edit("512", "0") << "field 'width' is 0 but the other side is not";
    QTest::newRow("zero steps") << edit("20", "0") << "field 'steps' is 0";
    QTest::newRow("cfg too high") << edit("5.5", "99") << "field 'cfg' is 99";
    QTest::newRow("cache threshold negative")
        << edit("\"strategy\": \"single\"", "\"strategy\": \"fbcache\", \"cache_threshold\": -1")
        << "cache threshold";
    QTest::newRow("guidance negative") << edit("\"cfg\": 5.5", "\"cfg\": 5.5, \"guidance\": -1") << "field 'guidance' is -1";
    QTest::newRow("guidance text") << edit("\"cfg\": 5.5", "\"cfg\": 5.5, \"guidance\": \"3\"")
                                   << "field 'guidance' must be a number";
    QTest::newRow("unknown sampler") << edit("\"euler\"", "\"lms\"") << "field 'sampler': unknown sampler 'lms'";
    QTest::newRow("unknown strategy") << edit("\"single\"", "\"warp\"") << "field 'strategy': unknown strategy 'warp'";
    QTest::newRow("typo in a key") << edit("\"steps\"", "\"stpes\"") << "unknown field \"stpes\"";
    QTest::newRow("prompt not text") << edit("\"blurry\"", "7") << "field 'negative_prompt' must be a string";
    const auto adapters = [&](const char* json) { return edit("\"steps\": 20", (std::string("\"steps\": 20, ") + json).c_str()); };
    QTest::newRow("loras not a list") << adapters(R"("loras": {"name": "a"})") << "field 'loras' must be a list";
    QTest::newRow("lora without name") << adapters(R"("loras": [{"weight": 1}])") << "entry 1: missing field 'name'";
    QTest::newRow("lora weight text") << adapters(R"("loras": [{"name": "a", "weight": "high"}])")
                                      << "field 'weight' must be a number";
    QTest::newRow("lora weight huge") << adapters(R"("loras": [{"name": "a", "weight": 50}])") << "outside -10..10";
    QTest::newRow("lora tag as name") << adapters(R"("loras": [{"name": "<lora:a>"}])") << "holds one of < > :";
    QTest::newRow("lora unknown key") << adapters(R"("loras": [{"name": "a", "wieght": 1}])") << "unknown field \"wieght\"";
    QTest::newRow("controlnet without model") << adapters(R"("controlnets": [{"scale": 1}])") << "missing field 'model'";
    QTest::newRow("controlnet preprocessor") << adapters(R"("controlnets": [{"model": "m", "preprocessor": "hed"}])")
                                             << "unknown preprocessor 'hed'";
    QTest::newRow("controlnet thresholds") << adapters(R"("controlnets": [{"model": "m", "low": 300, "high": 100}])")
                                           << "0 <= low <= high <= 1000";
    QTest::newRow("controlnet window") << adapters(R"("controlnets": [{"model": "m", "start": 0.9, "end": 0.1}])")
                                       << "0 <= start < end <= 1";
    QTest::newRow("controlnet entry") << adapters(R"("controlnets": [3])") << "entry 1 must be an object";
  }

  void adaptersRoundTrip() {
    engine::Preset p;
    p.name = "Brand look";
    p.loras = {{"brand-style", 0.8, 0.6}, {"product", 1.0, 1.0}};
    engine::Preset::ControlNet c;
    c.model = "/models/controlnet-canny";
    c.preprocessor = "canny";
    c.low = 50;
    c.high = 150;
    c.scale = 0.7;
    c.start = 0.1;
    c.end = 0.9;
    p.controlnets = {c};
    const auto back = engine::parse_preset(engine::preset_to_json(p), "brand.json");
    QCOMPARE(back.loras.size(), std::size_t(2));
    QCOMPARE(back.loras[0].name, std::string("brand-style"));
    QCOMPARE(back.loras[0].weight, 0.8);
    QCOMPARE(back.loras[0].text_encoder_weight, 0.6);
    QCOMPARE(back.controlnets.size(), std::size_t(1));
    QCOMPARE(back.controlnets[0].model, c.model);
    QCOMPARE(back.controlnets[0].preprocessor, std::string("canny"));
    QCOMPARE(back.controlnets[0].low, 50);
    QCOMPARE(back.controlnets[0].high, 150);
    QCOMPARE(back.controlnets[0].scale, 0.7);
    QCOMPARE(back.controlnets[0].end, 0.9);
    // Applied: the LoRAs by name (found in the LoRA folders when the job runs); ControlNets wait for an image.
    job::GenerationRequest r;
    engine::apply_preset(back, "a bottle", r);
    QCOMPARE(r.loras.size(), std::size_t(2));
    QVERIFY(r.loras[0].path.empty());
    QCOMPARE(r.loras[1].name, std::string("product"));
    QVERIFY(r.controlnets.empty());
    // And back from the request: the LoRAs by name (a path's stem when unnamed).
    r.loras[1] = {"/loras/Product Shot.safetensors", 0.5, 0.5, ""};
    const auto again = engine::preset_from_request("again", "{subject}", r);
    QCOMPARE(again.loras[1].name, std::string("Product Shot"));
    QCOMPARE(again.loras[1].weight, 0.5);
  }

  void badFilesGiveNamedErrors() {
    QFETCH(QString, text);
    QFETCH(QString, fragment);
    const fs::path file = tmp("bad-preset.json");
    writeText(file, text.toStdString());
    // DIFFRACT_EXPECT_ERROR keeps its fragments as pointers past the expression that made them:
    // a temporary's constData() would be read after it is freed (found by ASan).
    const QByteArray want = fragment.toUtf8();
    DIFFRACT_EXPECT_ERROR(engine::load_preset(file), "bad-preset.json: ", want.constData());
  }

  void missingFileAndSaveOfInvalidPreset() {
    DIFFRACT_EXPECT_ERROR(engine::load_preset(tmp("nope.json")), "nope.json: missing");
    const auto fifo = tmp("fifo.json");
    QCOMPARE(::mkfifo(fifo.c_str(), 0600), 0);
    DIFFRACT_EXPECT_ERROR(engine::load_preset(fifo), "fifo.json: a FIFO, not a file");  // at once, not waiting
    engine::Preset p;
    p.name = "x";
    p.prompt_template = "no placeholder";
    DIFFRACT_EXPECT_ERROR(engine::save_preset(p, tmp("invalid.json")), "invalid.json: field 'prompt_template'");
    QVERIFY(!fs::exists(tmp("invalid.json")));
  }

  void findsByStemNameOrFile() {
    const std::vector<fs::path> dirs = {tmp("no-such-dir"), shippedDir()};
    QCOMPARE(engine::find_preset("fast-draft", dirs).name, std::string("Fast draft"));
    QCOMPARE(engine::find_preset("HERO BANNER 16:9", dirs).name, std::string("Hero banner 16:9"));
    const fs::path mine = tmp("mine.json");
    writeText(mine, kValid);
    QCOMPARE(engine::find_preset(mine.string(), {}).name, std::string("Test"));
    DIFFRACT_EXPECT_ERROR(engine::find_preset("nonexistent", dirs), "no preset named 'nonexistent'", "studio-packshot");
    try {
      engine::find_preset("nonexistent", {shippedDir(), shippedDir()});
      QFAIL("found a preset that does not exist");
    } catch (const Error& e) {
      const std::string msg = e.what();
      QCOMPARE(msg.find("fast-draft"), msg.rfind("fast-draft"));  // listed once, though found twice
    }
    DIFFRACT_EXPECT_ERROR(engine::find_preset(tmp("gone.json").string(), dirs), "gone.json: no such file");
  }
};

QTEST_APPLESS_MAIN(TestPreset)
#include "test_preset.moc"
