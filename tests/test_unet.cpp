#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/io/weights.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

// fp32 on CPU with the same weights; convolutions and attention accumulate in a different
// order than PyTorch's Python path, so allow a little more than one ulp of growth per layer.
constexpr double kAtol = 1e-4;

void run_case(models::UNet2DConditionModel& unet, const io::StateDict& e, const std::string& key) {
  at::NoGradGuard no_grad;
  models::UNetConditioning cond;
  cond.encoder_hidden_states = e.at(key + ".context");
  if (e.count(key + ".text_embeds")) {
    cond.text_embeds = e.at(key + ".text_embeds");
    cond.time_ids = e.at(key + ".time_ids");
  }
  auto out = unet->forward(e.at(key + ".x"), e.at(key + ".t"), cond);
  DIFFRACT_COMPARE_TENSORS(out, e.at(key + ".out"), kAtol);
}

}  // namespace

class TestUNet : public QObject {
  Q_OBJECT
 private slots:
  void sd15StyleMatchesDiffusers() {
    auto e = io::load_state_dict(test::fixtures() / "unet_cases.safetensors");
    auto unet = models::load_unet_2d_condition(test::fixtures() / "tiny-sd" / "unet");
    QVERIFY(!unet->config.use_linear_projection);
    run_case(unet, e, "sd.16x16");
    run_case(unet, e, "sd.13x10");
  }

  void sdxlStyleMatchesDiffusers() {
    auto e = io::load_state_dict(test::fixtures() / "unet_cases.safetensors");
    auto unet = models::load_unet_2d_condition(test::fixtures() / "tiny-sdxl" / "unet");
    QCOMPARE(unet->config.addition_embed_type, std::string("text_time"));
    QCOMPARE(unet->config.transformer_layers_per_block, (std::vector<int64_t>{1, 2}));
    run_case(unet, e, "xl.16x16");
    run_case(unet, e, "xl.13x10");
  }

  void rejectsBadConfigs() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    const auto src = test::fixtures() / "tiny-sd" / "unet";
    test::copy_with_config(src, dir / "a", [](auto& j) { j.erase("block_out_channels"); });
    DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / "a"), "config.json", "missing key 'block_out_channels'");
    test::copy_with_config(src, dir / "b", [](auto& j) { j["down_block_types"][0] = "SimpleCrossAttnDownBlock2D"; });
    DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / "b"), "down block type 'SimpleCrossAttnDownBlock2D'");
    test::copy_with_config(src, dir / "c", [](auto& j) { j["class_embed_type"] = "timestep"; });
    DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / "c"), "'class_embed_type'", "not supported");
    test::copy_with_config(src, dir / "d", [](auto& j) { j["layers_per_block"] = {1, 2, 3}; });
    DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / "d"), "'layers_per_block' must be an integer or a list of 2");
    test::copy_with_config(src, dir / "e", [](auto& j) { j["cross_attention_dim"] = 48; });
    DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / "e"), "shape mismatches", "attn2.to_k.weight");
    test::copy_with_config(src, dir / "f", [](auto& j) { j["addition_embed_type"] = "text_image"; });
    DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / "f"), "'addition_embed_type'", "only 'text_time'");
  }

  // The size estimate behind "needs N GB" against diffusers' own count of SD 1.5's and SDXL's
  // UNet parameters (UNet2DConditionModel built on the meta device: 859 520 964 and 2 567 463 684).
  void parameterCountIsWithinAFewPerCent() {
    const auto near = [](int64_t estimate, double diffusers) { return std::abs(estimate / diffusers - 1.0) < 0.05; };
    QVERIFY2(near(models::UNet2DConditionConfig::sd15().parameter_count(), 859520964.0),
             qPrintable(QString::number(models::UNet2DConditionConfig::sd15().parameter_count())));
    QVERIFY2(near(models::UNet2DConditionConfig::sdxl_base().parameter_count(), 2567463684.0),
             qPrintable(QString::number(models::UNet2DConditionConfig::sdxl_base().parameter_count())));
  }

  // Configs a hostile or broken file gives: errors naming the file and the key before any module
  // is built, never a division by zero, an allocator abort or a stack overflow.
  void rejectsHostileConfigs() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    const auto src = test::fixtures() / "tiny-sd" / "unet";
    const auto expect = [&](const char* name, const std::function<void(nlohmann::json&)>& edit, const char* what,
                            const char* why) {
      test::copy_with_config(src, dir / name, edit);
      DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / name), "config.json", what, why);
    };
    expect("groups", [](auto& j) { j["norm_num_groups"] = 0; }, "'norm_num_groups' = 0", "out of range");
    expect("heads", [](auto& j) { j["attention_head_dim"] = 0; }, "'attention_head_dim'", "out of range");
    expect("wide", [](auto& j) { j["block_out_channels"] = {1000000, 2000000}; }, "'block_out_channels' = 1000000",
           "out of range");
    expect("layers", [](auto& j) { j["layers_per_block"] = -1; }, "'layers_per_block' = -1", "out of range");
    expect("size", [](auto& j) { j["sample_size"] = -4; }, "'sample_size'", "-4");
    expect("type", [](auto& j) { j["in_channels"] = "four"; }, "'in_channels' must be a whole number", "\"four\"");
    // 1e30 in a list of integers: nlohmann's own conversion would be undefined (found by fuzz_json).
    expect("float", [](auto& j) { j["block_out_channels"] = {1e30, 64.0}; }, "'block_out_channels' must be a whole number",
           "(each entry), not 1e+30");
    expect("wrap", [](auto& j) { j["in_channels"] = 18446744073709551615ULL; }, "'in_channels' must be a whole number from",
           "not 18446744073709551615");  // 2^64 - 1, not -1
    // Within every bound and still far beyond any machine: refused by its size, before building.
    expect("huge", [](auto& j) {
      j["block_out_channels"] = std::vector<int>(8, 8192);
      j["down_block_types"] = std::vector<std::string>(8, "CrossAttnDownBlock2D");
      j["up_block_types"] = std::vector<std::string>(8, "CrossAttnUpBlock2D");
      j["layers_per_block"] = 16;
      j["transformer_layers_per_block"] = 64;
      j["cross_attention_dim"] = 8192;
      j["norm_num_groups"] = 32;
    }, "billion parameters", "GB, more than this machine's");
    // Text where JSON nests 100 000 levels deep, and a number beyond double's range.
    for (const auto& [name, value] : {std::pair<const char*, std::string>{"deep", std::string(100000, '[') + std::string(100000, ']')},
                                      {"inf", "1e400"}}) {
      test::copy_with_config(src, dir / name, [](auto&) {});
      std::ifstream in(dir / name / "config.json");
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      text.replace(text.find('{'), 1, "{\"in_channels\": " + value + ",");
      std::ofstream(dir / name / "config.json", std::ios::trunc) << text;
    }
    DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / "deep"), "config.json", "nested deeper than 64 levels");
    DIFFRACT_EXPECT_ERROR(models::load_unet_2d_condition(dir / "inf"), "config.json", "malformed JSON", "1e400");
  }
};

QTEST_GUILESS_MAIN(TestUNet)
#include "test_unet.moc"
