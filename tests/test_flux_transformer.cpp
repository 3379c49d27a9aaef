#include <nlohmann/json.hpp>

#include "core/io/single_file.h"
#include "core/io/weights.h"
#include "core/models/transformers/flux_transformer_2d.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "flux"; }

const io::StateDict& cases() {
  static const io::StateDict e = io::load_state_dict(dir() / "flux_transformer_cases.safetensors");
  return e;
}

// One case's model: its config from the weights' shapes alone (as for a single file), its
// weights bound from the oracle's state dict.
models::FluxTransformer2DModel model_of(const std::string& key) {
  const std::string prefix = key + ".weights.";
  io::StateDict weights;
  std::vector<io::TensorShape> shapes;
  for (const auto& [name, t] : cases())
    if (name.compare(0, prefix.size(), prefix) == 0) {
      weights.emplace(name.substr(prefix.size()), t);
      shapes.push_back({name.substr(prefix.size()), t.sizes().vec()});
    }
  models::FluxTransformer2DModel model(models::FluxTransformer2DConfig::from_shapes(shapes, key));
  model->eval();
  io::bind(*model, weights, key);
  return model;
}

// fp32 on both sides, the same weights: differences are summation order, growing with depth.
// Observed: at most a few 1e-7; the bounds leave about ten times that.
constexpr double kEmbed = 1e-6, kPerBlock = 1e-6, kOut = 1e-5;

}  // namespace

class TestFluxTransformer : public QObject {
  Q_OBJECT

 private slots:
  // Layer by layer against diffusers' FluxTransformer2DModel: dev (guidance) and schnell layouts,
  // batches of 1 and 2, square and non-square patch grids.
  void matchesDiffusersLayerByLayer() {
    at::NoGradGuard no_grad;
    const auto& e = cases();
    int checked = 0;
    for (const std::string key : {"dev.3x5", "dev.1x1", "schnell.4x2"}) {
      auto model = model_of(key);
      QCOMPARE(model->config.guidance_embeds, key.rfind("dev", 0) == 0);
      QCOMPARE(model->config.axes_dims_rope, (std::vector<int64_t>{4, 6, 6}));
      const auto& x = e.at(key + ".in.x");
      const auto& ctx = e.at(key + ".in.context");
      const auto& pooled = e.at(key + ".in.pooled");
      const auto& t = e.at(key + ".in.t");
      const auto guidance = e.count(key + ".in.guidance") ? e.at(key + ".in.guidance") : at::Tensor();
      const auto rope = model->rope(e.at(key + ".in.txt_ids"), e.at(key + ".in.img_ids"));
      DIFFRACT_EXPECT_CLOSE(rope.cos, e.at(key + ".rope.cos"), 1e-7, key + " rope cos");
      DIFFRACT_EXPECT_CLOSE(rope.sin, e.at(key + ".rope.sin"), 1e-7, key + " rope sin");
      auto s = model->embed(x, ctx, pooled, t, guidance, rope);
      DIFFRACT_EXPECT_CLOSE(s.x, e.at(key + ".embed.x"), kEmbed, key + " embed.x");
      DIFFRACT_EXPECT_CLOSE(s.temb, e.at(key + ".embed.temb"), kEmbed, key + " embed.temb");
      DIFFRACT_EXPECT_CLOSE(s.context, e.at(key + ".embed.context"), kEmbed, key + " embed.context");
      const size_t doubles = model->transformer_blocks->size();
      for (size_t i = 0; i < model->num_blocks(); ++i) {
        model->run_block(i, s);
        const double tol = kEmbed + kPerBlock * static_cast<double>(i + 1);
        const auto b = key + (i < doubles ? ".double" + std::to_string(i) : ".single" + std::to_string(i - doubles));
        if (i < doubles) {
          DIFFRACT_EXPECT_CLOSE(s.x, e.at(b + ".x"), tol, b + ".x");
          DIFFRACT_EXPECT_CLOSE(s.context, e.at(b + ".context"), tol, b + ".context");
        } else {
          // diffusers' single blocks hand back (text, image); ours keep them joined.
          DIFFRACT_EXPECT_CLOSE(s.x.slice(1, 0, s.text_tokens), e.at(b + ".context"), tol, b + ".context");
          DIFFRACT_EXPECT_CLOSE(s.x.slice(1, s.text_tokens), e.at(b + ".x"), tol, b + ".x");
        }
        ++checked;
      }
      DIFFRACT_EXPECT_CLOSE(model->output(s), e.at(key + ".out"), kOut, key + " out");
      DIFFRACT_EXPECT_CLOSE(model->forward(x, ctx, pooled, t, guidance, rope), e.at(key + ".out"), kOut, key + " forward");
      // The projections fused into wider GEMMs (what the pipelines run) give the same output.
      model->fuse_projections();
      DIFFRACT_EXPECT_CLOSE(model->forward(x, ctx, pooled, t, guidance, rope), e.at(key + ".out"), kOut,
                            key + " forward, projections fused");
    }
    QCOMPARE(checked, 15);
  }

  void packingRoundTripsAndMatchesDiffusersIds() {
    const auto latents = at::randn({2, 16, 6, 10});
    const auto packed = models::pack_latents(latents);
    QCOMPARE(packed.sizes().vec(), (std::vector<int64_t>{2, 15, 64}));
    QVERIFY(at::equal(models::unpack_latents(packed, 6, 10), latents));
    // Token (row 1, column 2)'s features are the 2x2 patch at latent (2..3, 4..5), channels outermost.
    QVERIFY(at::equal(packed[1][1 * 5 + 2].view({16, 2, 2}), latents[1].slice(1, 2, 4).slice(2, 4, 6)));
    const auto ids = models::latent_image_ids(6, 10, at::TensorOptions());
    QVERIFY(at::equal(ids, cases().at("dev.3x5.in.img_ids")));
    DIFFRACT_EXPECT_ERROR(models::unpack_latents(packed, 8, 10), "15 tokens for latents of 8x10");
  }

  void configsAreChecked() {
    const auto f = [](const std::function<void(models::FluxTransformer2DConfig&)>& edit) {
      auto c = models::FluxTransformer2DConfig::dev();
      edit(c);
      c.validate("cfg");
    };
    models::FluxTransformer2DConfig::dev().validate("dev");
    models::FluxTransformer2DConfig::schnell().validate("schnell");
    DIFFRACT_EXPECT_ERROR(f([](auto& c) { c.axes_dims_rope = {16, 56, 50}; }), "cfg", "axes_dims_rope sums to 122");
    DIFFRACT_EXPECT_ERROR(f([](auto& c) { c.axes_dims_rope = {16, 57, 55}; }), "each must be positive and even");
    DIFFRACT_EXPECT_ERROR(f([](auto& c) { c.in_channels = 63; }), "in_channels 63 is not 4 x");
    DIFFRACT_EXPECT_ERROR(f([](auto& c) { c.patch_size = 2; }), "patch_size 2 is not supported");
    DIFFRACT_EXPECT_ERROR(f([](auto& c) { c.num_attention_heads = 0; }), "num_attention_heads must be positive");
    DIFFRACT_EXPECT_ERROR(f([](auto& c) { c.num_layers = c.num_single_layers = 0; }), "has no blocks");
    DIFFRACT_EXPECT_ERROR(f([](auto& c) { c.num_layers = -1; }), "num_layers must be 0..1000");
    // A config.json with a bad value names the file and the key.
    const auto d = fs::temp_directory_path() / "diffract_flux_config";
    fs::create_directories(d);
    std::ofstream(d / "config.json") << R"({"num_attention_heads": "many"})";
    DIFFRACT_EXPECT_ERROR(models::FluxTransformer2DConfig::from_json(d / "config.json"), "config.json",
                          "num_attention_heads");
    std::ofstream(d / "config.json") << R"({"axes_dims_rope": [16, 56]})";
    DIFFRACT_EXPECT_ERROR(models::FluxTransformer2DConfig::from_json(d / "config.json"), "config.json",
                          "axes_dims_rope sums to 72");
    // Shapes without the transformer's tensors say what is missing.
    DIFFRACT_EXPECT_ERROR(models::FluxTransformer2DConfig::from_shapes({{"x_embedder.weight", {64, 64}}}, "file.safetensors"),
                          "file.safetensors", "context_embedder.weight", "no Flux transformer");
    // The dev model refuses a job without its guidance.
    at::NoGradGuard no_grad;
    auto model = model_of("dev.1x1");
    const auto& e = cases();
    const auto rope = model->rope(e.at("dev.1x1.in.txt_ids"), e.at("dev.1x1.in.img_ids"));
    DIFFRACT_EXPECT_ERROR(model->forward(e.at("dev.1x1.in.x"), e.at("dev.1x1.in.context"), e.at("dev.1x1.in.pooled"),
                                         e.at("dev.1x1.in.t"), {}, rope),
                          "embeds the distilled guidance");
  }
};

QTEST_GUILESS_MAIN(TestFluxTransformer)
#include "test_flux_transformer.moc"
