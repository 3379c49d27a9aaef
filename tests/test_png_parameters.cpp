// Generation parameters from PNG text chunks: ours, AUTOMATIC1111's and ComfyUI's.
#include <QTemporaryDir>
#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/engine/output.h"
#include "core/engine/png_parameters.h"
#include "core/io/image.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path pngFixtures() { return test::fixtures() / "png_parameters"; }

bool mentions(const std::vector<std::string>& lines, const std::string& fragment) {
  return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(fragment) != std::string::npos; });
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + " | ";
  return s;
}

}  // namespace

class TestPngParameters : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;

 private slots:
  void ownPngRoundTrip() {
    const nlohmann::json meta = {{"diffract_version", "0.1.0"}, {"model", "/models/sdxl"}, {"family", "sdxl"},
                                 {"prompt", "a red apple\non a table"}, {"negative_prompt", "blurry"},
                                 {"width", 1024}, {"height", 768}, {"steps", 25}, {"cfg", 6.5},
                                 {"seed", 18446744073709551615ull}, {"sampler", "dpmpp-2m-karras"},
                                 {"device", "cuda:0"}, {"batch", 2}, {"taesd", ""}, {"strategy_name", "single"},
                                 {"devices", 1}, {"timings_ms", {{"total", 12.5}}}, {"lora", "x"},
                                 {"guidance", 2.5}, {"cache_threshold", 0.2}};
    io::Image img{16, 8, std::vector<std::uint8_t>(16 * 8 * 3, 90)};
    const fs::path path = m_tmp.filePath("ours.png").toStdString();
    io::write_png(path, img, {{"parameters", "a red apple\nSteps: 3, Sampler: Euler, CFG scale: 1, Seed: 1"},
                              {"diffract", meta.dump()}});
    const auto p = engine::read_png_parameters(path);
    QCOMPARE(p.source, std::string("diffract"));  // preferred over the A1111 text
    QCOMPARE(*p.prompt, std::string("a red apple\non a table"));
    QCOMPARE(*p.negative_prompt, std::string("blurry"));
    QCOMPARE(*p.width, 1024);
    QCOMPARE(*p.height, 768);
    QCOMPARE(*p.steps, 25);
    QCOMPARE(*p.cfg, 6.5);
    QCOMPARE(*p.guidance, 2.5);
    QCOMPARE(*p.cache_threshold, 0.2);
    QCOMPARE(*p.seed, std::uint64_t(18446744073709551615ull));
    QCOMPARE(*p.sampler, std::string("dpmpp-2m-karras"));
    QCOMPARE(*p.model, std::string("/models/sdxl"));
    QCOMPARE(*p.device, std::string("cuda:0"));
    QCOMPARE(*p.batch, 2);
    QCOMPARE(*p.strategy, std::string("single"));
    QVERIFY2(p.unmapped == std::vector<std::string>{"lora: \"x\""}, joined(p.unmapped).c_str());
  }

  void automatic1111() {
    const auto p = engine::read_png_parameters(pngFixtures() / "a1111.png");
    QCOMPARE(p.source, std::string("a1111"));
    QCOMPARE(*p.prompt, std::string("studio packshot of a ceramic coffee mug, centered,\n"
                                    "on a seamless white background <lora:product_v2:0.7>"));
    QCOMPARE(*p.negative_prompt, std::string("text, watermark,\nblurry"));
    QCOMPARE(*p.steps, 28);
    QCOMPARE(*p.sampler, std::string("dpmpp-2m-karras"));  // "DPM++ 2M" + "Schedule type: Karras"
    QCOMPARE(*p.cfg, 6.5);
    QCOMPARE(*p.seed, std::uint64_t(3141592653ull));
    QCOMPARE(*p.width, 1152);
    QCOMPARE(*p.height, 896);
    QCOMPARE(*p.model_name, std::string("sd_xl_base_1.0"));
    QVERIFY(!p.model);  // a name, not a path
    QVERIFY2(mentions(p.unmapped, "Clip skip: 2"), joined(p.unmapped).c_str());
    // The LoRAs' hashes, for finding a LoRA renamed since (the prompt's tags name them).
    const std::vector<std::pair<std::string, std::string>> hashes = {{"product_v2", "1a2b3c4d5e6f"}, {"other", "0f0f0f"}};
    QVERIFY(p.lora_hashes == hashes);
    QVERIFY(mentions(p.unmapped, "Model hash: 31e35c80fc"));
    QVERIFY(!mentions(p.unmapped, "Version"));
    QCOMPARE(p.unmapped.size(), std::size_t(2));
  }

  // Someone's settings line with a million characters and no colon before the settings, and a
  // quoted value as long: read as A1111 reads it (searching from every position was quadratic,
  // and libstdc++'s regex overflowed the stack on the quoted value).
  void a1111LongSettingsLine() {
    const std::string line = std::string(1000000, 'a') + ", Steps: 20, Sampler: Euler, CFG scale: 7, Note: \"" +
                             std::string(1000000, 'q') + "\"";
    const auto p = engine::parse_png_parameters({{"parameters", "an apple\n" + line}}, "long.png");
    QCOMPARE(*p.steps, 20);
    QCOMPARE(*p.cfg, 7.0);
    QCOMPARE(*p.prompt, std::string("an apple"));
  }

  void a1111Samplers_data() {
    QTest::addColumn<QString>("sampler");
    QTest::addColumn<QString>("schedule");
    QTest::addColumn<QString>("ours");
    QTest::newRow("Euler") << "Euler" << "" << "euler";
    QTest::newRow("Euler a automatic") << "Euler a" << "Automatic" << "euler-ancestral";
    QTest::newRow("DDIM") << "DDIM" << "" << "ddim";
    QTest::newRow("DPM++ 2M (old)") << "DPM++ 2M" << "" << "dpmpp-2m";
    QTest::newRow("DPM++ 2M automatic") << "DPM++ 2M" << "Automatic" << "dpmpp-2m-karras";
    QTest::newRow("DPM++ 2M Karras (old)") << "DPM++ 2M Karras" << "" << "dpmpp-2m-karras";
    QTest::newRow("Euler Karras") << "Euler" << "Karras" << "";
    QTest::newRow("LMS") << "LMS" << "" << "";
    QTest::newRow("DPM++ 2M SDE") << "DPM++ 2M SDE" << "Karras" << "";
  }

  void a1111Samplers() {
    QFETCH(QString, sampler);
    QFETCH(QString, schedule);
    QFETCH(QString, ours);
    const auto got = engine::sampler_from_a1111(sampler.toStdString(), schedule.toStdString());
    QCOMPARE(QString::fromStdString(got.value_or("")), ours);
  }

  void a1111UnknownSamplerIsReportedNotGuessed() {
    const auto p = engine::parse_png_parameters(
        {{"parameters", "cat\nSteps: 20, Sampler: Heun, CFG scale: 7, Seed: 5, Size: 512x512, Denoising strength: 0.4"}},
        "x.png");
    QVERIFY(!p.sampler);
    QVERIFY(!p.negative_prompt->size());
    QCOMPARE(*p.prompt, std::string("cat"));
    QVERIFY2(mentions(p.unmapped, "Sampler: Heun (no Diffract sampler matches)"), joined(p.unmapped).c_str());
    QVERIFY(mentions(p.unmapped, "Denoising strength: 0.4"));
  }

  // Forge / A1111's Flux field.
  void a1111DistilledGuidance() {
    const auto p = engine::parse_png_parameters(
        {{"parameters", "cat\nSteps: 20, Sampler: Euler, CFG scale: 1, Distilled CFG Scale: 3.5, Seed: 5"}}, "x.png");
    QCOMPARE(*p.guidance, 3.5);
    QCOMPARE(*p.cfg, 1.0);
    const auto bad = engine::parse_png_parameters({{"parameters", "cat\nSteps: 20, Sampler: Euler, Distilled CFG Scale: lots"}}, "x.png");
    QVERIFY(!bad.guidance);
    QVERIFY(mentions(bad.unmapped, "Distilled CFG Scale: lots (not a number)"));
  }

  // An image of a batch: its position, as A1111 writes it and as our own JSON and text carry it.
  void batchPosition() {
    const auto a = engine::parse_png_parameters(
        {{"parameters", "cat\nSteps: 20, Sampler: Euler, Seed: 5, Batch size: 4, Batch pos: 2"}}, "x.png");
    QCOMPARE(*a.batch, 4);
    QCOMPARE(*a.batch_index, 2);
    const auto bad = engine::parse_png_parameters({{"parameters", "cat\nSteps: 20, Sampler: Euler, Batch pos: -1"}}, "x.png");
    QVERIFY(!bad.batch_index);
    QVERIFY(mentions(bad.unmapped, "Batch pos: -1"));
    const auto ours = engine::batch_image_text("cat\nSteps: 20, Sampler: Euler, Seed: 5", R"({"prompt": "cat", "batch": 3})", 1, 3);
    const auto d = engine::parse_png_parameters({{"diffract", ours.metadata_json}}, "x.png");
    QCOMPARE(*d.batch, 3);
    QCOMPARE(*d.batch_index, 1);
    const auto t = engine::parse_png_parameters({{"parameters", ours.parameters}}, "x.png");
    QCOMPARE(*t.batch, 3);
    QCOMPARE(*t.batch_index, 1);
    QCOMPARE(*t.seed, std::uint64_t(5));
  }

  void comfyui() {
    const auto p = engine::read_png_parameters(pngFixtures() / "comfyui.png");
    QCOMPARE(p.source, std::string("comfyui"));
    QCOMPARE(*p.prompt, std::string("beautiful scenery nature glass bottle landscape, purple galaxy bottle,"));
    QCOMPARE(*p.negative_prompt, std::string("text, watermark"));
    QCOMPARE(*p.seed, std::uint64_t(156680208700286ull));
    QCOMPARE(*p.steps, 20);
    QCOMPARE(*p.cfg, 8.0);
    QCOMPARE(*p.sampler, std::string("euler"));
    QCOMPARE(*p.width, 512);
    QCOMPARE(*p.height, 768);
    QCOMPARE(*p.batch, 1);
    QCOMPARE(*p.model_name, std::string("v1-5-pruned-emaonly.safetensors"));  // through the LoRA loader
    QVERIFY2(p.unmapped == std::vector<std::string>{"LoRA: glass_style.safetensors"}, joined(p.unmapped).c_str());
  }

  void comfyuiAdvancedAndImageToImage() {
    const nlohmann::json g = {
        {"1", {{"class_type", "KSamplerAdvanced"},
               {"inputs", {{"noise_seed", 7}, {"steps", 30}, {"cfg", 5.5}, {"sampler_name", "dpmpp_2m"},
                           {"scheduler", "karras"}, {"start_at_step", 0}, {"end_at_step", 10000},
                           {"add_noise", "enable"}, {"positive", {"2", 0}}, {"negative", {"9", 0}},
                           {"latent_image", {"3", 0}}}}}},
        {"2", {{"class_type", "CLIPTextEncode"}, {"inputs", {{"text", "a lamp"}}}}},
        {"3", {{"class_type", "VAEEncode"}, {"inputs", {}}}}};
    const auto p = engine::parse_png_parameters({{"prompt", g.dump()}}, "adv.png");
    QCOMPARE(*p.seed, std::uint64_t(7));
    QCOMPARE(*p.sampler, std::string("dpmpp-2m-karras"));
    QCOMPARE(*p.prompt, std::string("a lamp"));
    QVERIFY(!p.negative_prompt);
    QVERIFY(!p.width);
    QVERIFY2(mentions(p.unmapped, "negative prompt: no linked node"), joined(p.unmapped).c_str());
    QVERIFY(mentions(p.unmapped, "latent_image: from a VAEEncode node"));
  }

  void errorsNameTheFileAndTheProblem() {
    DIFFRACT_EXPECT_ERROR(engine::read_png_parameters(pngFixtures() / "no_parameters.png"), "no_parameters.png: ",
                          "no generation parameters", "Software");
    DIFFRACT_EXPECT_ERROR(engine::parse_png_parameters({}, "empty.png"), "empty.png: no generation parameters",
                          "no text chunks");
    DIFFRACT_EXPECT_ERROR(engine::parse_png_parameters({{"diffract", "{oops"}}, "bad.png"),
                          "bad.png: the 'diffract' text chunk: malformed JSON");
    DIFFRACT_EXPECT_ERROR(engine::parse_png_parameters({{"prompt", "[1]"}}, "c.png"), "c.png: the ComfyUI 'prompt'");
    DIFFRACT_EXPECT_ERROR(engine::parse_png_parameters({{"prompt", R"({"1": {"class_type": "SaveImage"}})"}}, "c.png"),
                          "no KSampler");
    DIFFRACT_EXPECT_ERROR(engine::parse_png_parameters({{"parameters", "just a prompt"}}, "p.png"),
                          "p.png: the 'parameters' text chunk has no settings line");
    const fs::path notPng = m_tmp.filePath("not.png").toStdString();
    { std::ofstream(notPng) << "hello"; }
    DIFFRACT_EXPECT_ERROR(engine::read_png_parameters(notPng), "not.png: not a PNG file");
  }
};

QTEST_APPLESS_MAIN(TestPngParameters)
#include "test_png_parameters.moc"
