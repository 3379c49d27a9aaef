#include <fstream>
#include <functional>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/io/diffusers_folder.h"
#include "core/io/safetensors.h"
#include "core/io/single_file.h"
#include "core/io/weights.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/schedulers/sampler.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "sd3"; }

const io::StateDict& cases() {
  static const io::StateDict e = io::load_state_dict(dir() / "sd3_cases.safetensors");
  return e;
}

// Each tensor has its own tolerance, relative to its magnitude (at least 1), as llm.c checks
// layer by layer: fp32 on both sides with the same weights, so differences are summation order
// (matmuls, SDPA, layer norms), growing with depth. Observed: at most 3e-7 anywhere (diffusers
// 0.42.1, torch 2.11 CPU); the bounds leave about ten times that.
struct Tolerance {
  double embed = 1e-6;      // one conv / linear
  double per_block = 1e-6;  // added per block
  double out = 5e-6;
};

void run_case(models::SD3Transformer2DModel& model, const std::string& key) {
  at::NoGradGuard no_grad;
  const auto& e = cases();
  const Tolerance tol;
  const auto& x = e.at(key + ".in.x");
  const auto& ctx = e.at(key + ".in.context");
  const auto& pooled = e.at(key + ".in.pooled");
  const auto& t = e.at(key + ".in.t");
  // Layer by layer: the embeddings, each block's two streams, the output.
  auto s = model->embed(x, ctx, pooled, t);
  DIFFRACT_EXPECT_CLOSE(s.x, e.at(key + ".embed.x"), tol.embed, key + " embed.x");
  DIFFRACT_EXPECT_CLOSE(s.temb, e.at(key + ".embed.temb"), tol.embed, key + " embed.temb");
  DIFFRACT_EXPECT_CLOSE(s.context, e.at(key + ".embed.context"), tol.embed, key + " embed.context");
  const size_t n = model->transformer_blocks->size();
  for (size_t i = 0; i < n; ++i) {
    model->run_block(i, s);
    const auto b = key + ".block" + std::to_string(i);
    const double rtol = tol.embed + tol.per_block * static_cast<double>(i + 1);
    DIFFRACT_EXPECT_CLOSE(s.x, e.at(b + ".x"), rtol, b + ".x");
    if (i + 1 < n) DIFFRACT_EXPECT_CLOSE(s.context, e.at(b + ".context"), rtol, b + ".context");
    else QVERIFY2(!s.context.defined() && !e.count(b + ".context"), "the last block is context_pre_only");
  }
  DIFFRACT_EXPECT_CLOSE(model->unpatchify_output(s), e.at(key + ".out"), tol.out, key + " out");
  // The whole forward, from the diffusers inputs alone.
  DIFFRACT_EXPECT_CLOSE(model->forward(x, ctx, pooled, t), e.at(key + ".out"), tol.out, key + " forward");
}

}  // namespace

class TestSD3Transformer : public QObject {
  Q_OBJECT
 private slots:
  void sd3LayoutMatchesDiffusers() {
    auto model = models::load_sd3_transformer(dir() / "sd3" / "transformer");
    QVERIFY(model->config.qk_norm.empty() && model->config.dual_attention_layers.empty());
    QVERIFY(!model->transformer_blocks[0]->as<models::JointTransformerBlock>()->attn->norm_q);
    for (const char* input : {"3x5", "1x2", "4x3"}) run_case(model, std::string("sd3.") + input);
  }

  // Through the pipeline folder: model_index.json names the transformer/ and scheduler/ components.
  void loadsFromPipelineFolder() {
    const auto folder = io::DiffusersFolder::open(dir() / "sd3");
    QCOMPARE(folder.pipeline_class(), std::string("StableDiffusion3Pipeline"));
    const auto& t = folder.require("transformer");
    QCOMPARE(t.class_name, std::string("SD3Transformer2DModel"));
    auto model = models::load_sd3_transformer(t.dir, t.variant);
    QCOMPARE(model->config.num_layers, int64_t(3));
    QVERIFY(schedulers::native_sampler(folder.require("scheduler").config) == schedulers::SamplerKind::FlowMatchEuler);
  }

  void qkNormAndDualAttentionMatchDiffusers() {
    auto model = models::load_sd3_transformer(dir() / "sd35m" / "transformer");
    QCOMPARE(model->config.qk_norm, std::string("rms_norm"));
    QCOMPARE(model->config.dual_attention_layers, (std::vector<int64_t>{0, 1}));
    QVERIFY(model->transformer_blocks[1]->as<models::JointTransformerBlock>()->attn2);
    QVERIFY(!model->transformer_blocks[2]->as<models::JointTransformerBlock>()->attn2);
    for (const char* input : {"3x5", "1x2", "4x3"}) run_case(model, std::string("sd35m.") + input);
  }

  void qkNormOnlyMatchesDiffusers() {
    auto model = models::load_sd3_transformer(dir() / "sd35l" / "transformer");
    QCOMPARE(model->config.num_attention_heads, int64_t(3));
    for (const char* input : {"3x5", "1x2", "4x3"}) run_case(model, std::string("sd35l.") + input);
  }

  // The attention projections fused (one GEMM for the image tokens' q, k, v and one for the text
  // tokens', as the pipelines run them): the same outputs as diffusers, block by block, for the
  // three layouts (SD3.5 medium's image-only second attention has no text projections).
  void fusedProjectionsMatchDiffusers() {
    for (const char* name : {"sd3", "sd35m", "sd35l"}) {
      auto model = models::load_sd3_transformer(dir() / name / "transformer");
      model->fuse_projections();
      const auto& attn = *model->transformer_blocks[0]->as<models::JointTransformerBlock>()->attn;
      // Fused: each layer's weight is a view into one tensor laid end to end.
      QVERIFY(attn.to_k->weight.storage().is_alias_of(attn.to_q->weight.storage()));
      QVERIFY(attn.add_v_proj->weight.storage().is_alias_of(attn.add_q_proj->weight.storage()));
      QVERIFY(!attn.add_q_proj->weight.storage().is_alias_of(attn.to_q->weight.storage()));
      for (const char* input : {"3x5", "1x2", "4x3"}) run_case(model, std::string(name) + "." + input);
    }
  }

  // The sincos grid we compute equals the buffer diffusers stores.
  void positionGridMatchesDiffusers() {
    for (const char* name : {"sd3", "sd35m", "sd35l"}) {
      const auto folder = dir() / name / "transformer";
      models::SD3Transformer2DModel fresh(models::SD3Transformer2DConfig::from_json(folder / "config.json"));
      const auto stored = io::load_state_dict(folder / "diffusion_pytorch_model.safetensors").at("pos_embed.pos_embed");
      DIFFRACT_EXPECT_CLOSE(fresh->pos_embed->pos_embed, stored, 1e-6, std::string(name) + " pos_embed");
    }
  }

  // The config from tensor shapes alone equals config.json (sample_size aside).
  void configFromShapes() {
    for (const char* name : {"sd3", "sd35m", "sd35l"}) {
      const auto folder = dir() / name / "transformer";
      const auto want = models::SD3Transformer2DConfig::from_json(folder / "config.json");
      const auto archive = io::SafetensorsArchive::open(folder / "diffusion_pytorch_model.safetensors");
      // The tiny heads are narrower than every release's 64, which only qk-norm weights reveal.
      const auto shapes = io::tensor_shapes(*archive);
      if (want.qk_norm.empty())
        DIFFRACT_EXPECT_ERROR(models::SD3Transformer2DConfig::from_shapes(shapes, archive->path().string()),
                              "diffusion_pytorch_model.safetensors", "width 16 is not a multiple of the head width 64",
                              "assumed");
      const auto got = models::SD3Transformer2DConfig::from_shapes(shapes, archive->path().string(),
                                                                   want.qk_norm.empty() ? want.attention_head_dim : 64);
      QCOMPARE(got.patch_size, want.patch_size);
      QCOMPARE(got.in_channels, want.in_channels);
      QCOMPARE(got.out_channels, want.out_channels);
      QCOMPARE(got.num_layers, want.num_layers);
      QCOMPARE(got.joint_attention_dim, want.joint_attention_dim);
      QCOMPARE(got.caption_projection_dim, want.caption_projection_dim);
      QCOMPARE(got.pooled_projection_dim, want.pooled_projection_dim);
      QCOMPARE(got.pos_embed_max_size, want.pos_embed_max_size);
      QCOMPARE(got.dual_attention_layers, want.dual_attention_layers);
      QCOMPARE(got.qk_norm, want.qk_norm);
      QCOMPARE(got.attention_head_dim, want.attention_head_dim);
      QCOMPARE(got.num_attention_heads, want.num_attention_heads);
    }
    // The presets: diffusers' published transformer/config.json of each release.
    const auto sd3 = models::SD3Transformer2DConfig::sd3_medium();
    const auto m35 = models::SD3Transformer2DConfig::sd35_medium();
    const auto l35 = models::SD3Transformer2DConfig::sd35_large();
    for (const auto* c : {&sd3, &m35, &l35}) c->validate("preset");
    QCOMPARE(sd3.inner_dim(), int64_t(1536));
    QVERIFY(sd3.qk_norm.empty() && sd3.dual_attention_layers.empty() && sd3.pos_embed_max_size == 192);
    QCOMPARE(m35.inner_dim(), int64_t(1536));
    QCOMPARE(m35.dual_attention_layers.size(), size_t(13));
    QVERIFY(m35.qk_norm == "rms_norm" && m35.pos_embed_max_size == 384 && m35.num_layers == 24);
    QCOMPARE(l35.inner_dim(), int64_t(2432));
    QVERIFY(l35.qk_norm == "rms_norm" && l35.num_layers == 38 && l35.dual_attention_layers.empty());
    DIFFRACT_EXPECT_ERROR(models::SD3Transformer2DConfig::from_shapes({{"model.diffusion_model.x", {1}}}, "file.bin"),
                          "file.bin", "no tensor 'pos_embed.proj.weight'");
    for (const int64_t cells : {int64_t(-156), int64_t(0), int64_t(63), std::numeric_limits<int64_t>::min()})
      DIFFRACT_EXPECT_ERROR(models::SD3Transformer2DConfig::from_shapes({{"pos_embed.proj.weight", {64, 16, 2, 2}},
                                                                         {"pos_embed.pos_embed", {1, cells, 64}}},
                                                                        "grid.bin"),
                            "grid.bin", "'pos_embed.pos_embed' has " + std::to_string(cells) + " positions",
                            "not a square grid");
    // A patch of 0 (a zero-size tensor is a valid safetensors entry) once divided by zero; a
    // non-square patch, and an output that no patch * patch divides.
    const auto shapes = [](std::vector<int64_t> proj, int64_t out) {
      return std::vector<io::TensorShape>{{"pos_embed.proj.weight", proj},
                                          {"pos_embed.pos_embed", {1, 16, 64}},
                                          {"context_embedder.weight", {64, 32}},
                                          {"time_text_embed.text_embedder.linear_1.weight", {64, 32}},
                                          {"proj_out.weight", {out, 64}}};
    };
    for (const auto& proj : {std::vector<int64_t>{64, 16, 0, 0}, {64, 16, -2, -2}, {64, 16, 2, 3}})
      DIFFRACT_EXPECT_ERROR(models::SD3Transformer2DConfig::from_shapes(shapes(proj, 64), "patch.bin"), "patch.bin",
                            "'pos_embed.proj.weight' has shape", "a square patch of at least 1");
    for (const int64_t out : {int64_t(0), int64_t(-64), int64_t(66)})
      DIFFRACT_EXPECT_ERROR(models::SD3Transformer2DConfig::from_shapes(shapes({64, 16, 2, 2}, out), "out.bin"),
                            "out.bin", "'proj_out.weight' has shape", "2 * 2 * out_channels");
  }

  void rejectsBadFolders() {
    QTemporaryDir tmp;
    const fs::path d = tmp.path().toStdString();
    const auto src = dir() / "sd35m" / "transformer";
    // One block fewer in config.json than in the weights: the extra keys are named, with the file.
    test::copy_with_config(src, d / "a", [](auto& j) { j["num_layers"] = 2; });
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "a"), "diffusion_pytorch_model.safetensors",
                          "unexpected keys", "transformer_blocks.2.attn.to_q.weight");
    // No qk norm in config.json, but the weights have it.
    test::copy_with_config(src, d / "b", [](auto& j) { j["qk_norm"] = nullptr; });
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "b"), "diffusion_pytorch_model.safetensors",
                          "transformer_blocks.0.attn.norm_q.weight");
    // A wider text input than the weights.
    test::copy_with_config(src, d / "c", [](auto& j) { j["joint_attention_dim"] = 24; });
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "c"), "shape mismatches",
                          "context_embedder.weight: checkpoint [16, 12] vs model [16, 24]");
    test::copy_with_config(src, d / "e", [](auto& j) { j["qk_norm"] = "layer_norm"; });
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "e"), "config.json", "'qk_norm'", "not supported");
    test::copy_with_config(src, d / "f", [](auto& j) { j["caption_projection_dim"] = 32; });
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "f"), "config.json", "caption_projection_dim 32");
    test::copy_with_config(src, d / "g", [](auto& j) { j["dual_attention_layers"] = {0, 7}; });
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "g"), "config.json", "dual_attention_layers holds 7");
    test::copy_with_config(src, d / "h", [](auto& j) { j["num_layers"] = "three"; });
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "h"), "config.json", "key 'num_layers' must be");
    fs::create_directories(d / "i");
    std::ofstream(d / "i" / "config.json") << R"({"num_layers": 1})";
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "i"), "no weight file");
    DIFFRACT_EXPECT_ERROR(models::load_sd3_transformer(d / "absent"), "absent", "config.json");

    // A latent larger than the position grid, or not a multiple of the patch size.
    auto model = models::load_sd3_transformer(src);
    at::NoGradGuard no_grad;
    const auto ctx = at::zeros({1, 2, 12}), pooled = at::zeros({1, 10}), t = at::full({1}, 500.0);
    DIFFRACT_EXPECT_ERROR(model->forward(at::zeros({1, 4, 26, 4}), ctx, pooled, t), "13x2 patches",
                          "position grid of 12x12");
    DIFFRACT_EXPECT_ERROR(model->forward(at::zeros({1, 4, 5, 4}), ctx, pooled, t), "5x4",
                          "not a multiple of the patch size 2");
  }
};

QTEST_GUILESS_MAIN(TestSD3Transformer)
#include "test_sd3_transformer.moc"
