// SD3 / SD3.5 single files in Stability's layout: tests/reference/make_sd3_single_file_fixtures.py
// writes them from the SD3 pipeline fixtures' tiny diffusers folders (and a tiny SD3.5-medium-style
// one), and has already checked with diffusers' own from_single_file that each file loads back into
// exactly the folder's weights. Here: our loader gives the folder's tensors bit for bit, infers the
// configs, runs the transformer as diffusers does and generates what the folder generates.
#include <fstream>
#include <limits>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>

#include "core/job/job.h"
#include "core/io/diffusers_folder.h"
#include "core/io/safetensors.h"
#include "core/io/single_file.h"
#include "core/io/weights.h"
#include "core/pipeline/single_file.h"
#include "core/pipeline/factory.h"
#include "core/pipeline/stable_diffusion_3.h"
#include "core/text/t5_tokenizer.h"
#include "core/util/error.h"
#include "core/util/square_side.h"
#include "same_tensors.h"
#include "strategy_job.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "sd3_single_file"; }
fs::path file(const std::string& name) { return dir() / (name + ".safetensors"); }
// The diffusers folder each file was made from.
fs::path folder_of(const std::string& name) {
  return name == "tiny-sd35m" ? dir() / name : test::fixtures() / "sd3_pipeline" / name;
}


std::vector<io::TensorShape> shapes_of(const fs::path& path) {
  return io::tensor_shapes(*io::SafetensorsArchive::open(path));
}

pipeline::SingleFileOptions with_config(const fs::path& config_dir) {
  pipeline::SingleFileOptions o;
  o.config_dir = config_dir;
  return o;
}

// A config folder with only these components' config.json (no weights, no tokenizer_3).
fs::path configs_only(const QTemporaryDir& tmp, const fs::path& folder, const std::vector<std::string>& names) {
  const fs::path out = fs::path(tmp.path().toStdString()) / "configs";
  for (const auto& n : names) {
    fs::create_directories(out / n);
    fs::copy_file(folder / n / "config.json", out / n / "config.json");
  }
  return out;
}

job::GenerationRequest request(const std::string& model) {
  job::GenerationRequest r;
  r.model = model;
  r.prompt = "a red apple on a white background";
  r.negative_prompt = "blurry";
  r.steps = 3;
  r.cfg = 4.5;
  r.width = 32;
  r.height = 48;
  r.seed = 7;
  r.preview_every = 0;
  return r;
}

// Same request through two pipelines: final latents and images equal.
void expect_same_generation(pipeline::StableDiffusion3& a, pipeline::StableDiffusion3& b) {
  job::CancelToken never;
  EXPECT_SAME_GENERATION(a.generate(request(a.path().string()), {}, never),
                         b.generate(request(b.path().string()), {}, never));
}

}  // namespace

class TestSD3SingleFile : public QObject {
  Q_OBJECT
 private slots:
  // --- detection ---------------------------------------------------------------------------------
  void detectsTheLayout() {
    const auto l = io::detect_sd3_single_file(shapes_of(file("tiny-sd3")), "tiny-sd3");
    QCOMPARE(l.transformer_prefix, std::string("model.diffusion_model."));
    QCOMPARE(l.vae_prefix, std::string("first_stage_model."));
    QCOMPARE(l.clip_l_prefix, std::string("text_encoders.clip_l.transformer."));
    QCOMPARE(l.clip_g_prefix, std::string("text_encoders.clip_g.transformer."));
    QVERIFY(l.t5_prefix.empty());
    QCOMPARE(l.depth, int64_t(2));
    QCOMPARE(l.hidden_size, int64_t(32));
    QCOMPARE(l.in_channels, int64_t(16));
    QCOMPARE(l.patch_size, int64_t(2));
    QCOMPARE(l.pos_embed_max_size, int64_t(16));
    QCOMPARE(l.joint_attention_dim, int64_t(96));
    QCOMPARE(l.pooled_projection_dim, int64_t(56));
    QVERIFY(!l.qk_norm);
    QVERIFY(l.dual_attention_layers.empty());
    QCOMPARE(l.variant, std::string("SD3-like"));

    const auto t5 = io::detect_sd3_single_file(shapes_of(file("tiny-sd3-t5")), "t5");
    QCOMPARE(t5.t5_prefix, std::string("text_encoders.t5xxl.transformer."));
    const auto m = io::detect_sd3_single_file(shapes_of(file("tiny-sd35m")), "sd35m");
    QVERIFY(m.qk_norm);
    QCOMPARE(m.depth, int64_t(3));
    QCOMPARE(m.dual_attention_layers, std::vector<int64_t>{0});

    QVERIFY(pipeline::is_sd3_single_file(file("tiny-sd3")));
    QVERIFY(pipeline::is_sd3_single_file(file("tiny-sd35m")));
    // A diffusers transformer file (transformer_blocks.*), a folder and a missing file are not.
    QVERIFY(!pipeline::is_sd3_single_file(folder_of("tiny-sd3") / "transformer" / "diffusion_pytorch_model.safetensors"));
    QVERIFY(!pipeline::is_sd3_single_file(folder_of("tiny-sd3")));
    QVERIFY(!pipeline::is_sd3_single_file(dir() / "missing.safetensors"));
    // The SD / SDXL detection sends SD3 files on.
    const std::string path = file("tiny-sd3").string();
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(*io::SafetensorsArchive::open(file("tiny-sd3"))), path.c_str(),
                          "SD3 / SD3.5 (MMDiT)", "SD3 pipeline");
    DIFFRACT_EXPECT_ERROR(pipeline::load_single_file(file("tiny-sd3")), path.c_str(), "SD3 pipeline");
  }

  // Real sizes, from names and shapes alone: SD3 medium / SD3.5 medium / SD3.5 large.
  void namesTheVariants() {
    const auto mmdit = [](int64_t depth, int64_t width, int64_t grid, bool qk, std::vector<int64_t> dual) {
      std::vector<io::TensorShape> t;
      const std::string p = "model.diffusion_model.";
      t.push_back({p + "x_embedder.proj.weight", {width, 16, 2, 2}});
      t.push_back({p + "pos_embed", {1, grid * grid, width}});
      t.push_back({p + "context_embedder.weight", {width, 4096}});
      t.push_back({p + "y_embedder.mlp.0.weight", {width, 2048}});
      t.push_back({p + "y_embedder.mlp.2.weight", {width, width}});
      t.push_back({p + "t_embedder.mlp.0.weight", {width, 256}});
      t.push_back({p + "t_embedder.mlp.2.weight", {width, width}});
      t.push_back({p + "final_layer.linear.weight", {64, width}});
      t.push_back({p + "final_layer.adaLN_modulation.1.weight", {2 * width, width}});
      for (int64_t b = 0; b < depth; ++b) {
        const std::string k = p + "joint_blocks." + std::to_string(b) + ".";
        t.push_back({k + "x_block.attn.qkv.weight", {3 * width, width}});
        t.push_back({k + "context_block.attn.qkv.weight", {3 * width, width}});
        t.push_back({k + "x_block.adaLN_modulation.1.weight", {6 * width, width}});
        t.push_back({k + "context_block.adaLN_modulation.1.weight", {6 * width, width}});
        t.push_back({k + "x_block.mlp.fc1.weight", {4 * width, width}});
        if (qk) t.push_back({k + "x_block.attn.ln_q.weight", {64}});
        if (std::find(dual.begin(), dual.end(), b) != dual.end())
          t.push_back({k + "x_block.attn2.qkv.weight", {3 * width, width}});
      }
      return t;
    };
    QCOMPARE(io::detect_sd3_single_file(mmdit(24, 1536, 192, false, {}), "a").variant, std::string("SD3 medium"));
    std::vector<int64_t> dual;
    for (int64_t i = 0; i <= 12; ++i) dual.push_back(i);
    const auto m = io::detect_sd3_single_file(mmdit(24, 1536, 384, true, dual), "b");
    QCOMPARE(m.variant, std::string("SD3.5 medium"));
    QCOMPARE(m.dual_attention_layers, dual);
    QCOMPARE(m.pos_embed_max_size, int64_t(384));
    QCOMPARE(io::detect_sd3_single_file(mmdit(38, 2432, 192, true, {}), "c").variant, std::string("SD3.5 large"));
    // Text encoders and VAE absent: not an error at detection (the loader decides).
    const auto bare = io::detect_sd3_single_file(mmdit(24, 1536, 192, false, {}), "a");
    QVERIFY(bare.vae_prefix.empty() && bare.clip_l_prefix.empty() && bare.t5_prefix.empty());
    // A position table whose count is no square, negative or past every square root a double
    // holds exactly (the fuzzer's input of 2026-12-06 had -156; INT64_MIN once came of NaN).
    for (const int64_t cells : {int64_t(-156), int64_t(0), int64_t(191 * 192), std::numeric_limits<int64_t>::max(),
                                std::numeric_limits<int64_t>::min(), int64_t(3037000499) * 3037000499 - 1}) {
      auto t = mmdit(2, 64, 4, false, {});
      for (auto& shape : t)
        if (shape.name == "model.diffusion_model.pos_embed") shape.shape[1] = cells;
      DIFFRACT_EXPECT_ERROR(io::detect_sd3_single_file(t, "grid.safetensors"), "grid.safetensors",
                            "model.diffusion_model.pos_embed", "a square position grid");
    }
    // A patch of 0 (a zero-size tensor is a valid safetensors entry) or a non-square one.
    for (const auto& patch : {std::pair<int64_t, int64_t>{0, 0}, {2, 3}, {-2, -2}}) {
      auto t = mmdit(2, 64, 4, false, {});
      t[0].shape[2] = patch.first;
      t[0].shape[3] = patch.second;
      DIFFRACT_EXPECT_ERROR(io::detect_sd3_single_file(t, "patch.safetensors"), "patch.safetensors",
                            "x_embedder.proj.weight", "a patch p of at least 1");
    }
  }

  // square_side: exact over int64, including the largest square it holds.
  void squareSides() {
    QCOMPARE(square_side(1), std::optional<int64_t>(1));
    QCOMPARE(square_side(192 * 192), std::optional<int64_t>(192));
    QCOMPARE(square_side(int64_t(3037000499) * 3037000499), std::optional<int64_t>(3037000499));
    QCOMPARE(square_side((int64_t(1) << 62)), std::optional<int64_t>(int64_t(1) << 31));
    for (const int64_t n : {int64_t(0), int64_t(-1), int64_t(2), int64_t(192 * 192 + 1), (int64_t(1) << 62) + 1,
                            std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()})
      QVERIFY2(!square_side(n), std::to_string(n).c_str());
  }

  // --- weights -------------------------------------------------------------------------------------
  void bindsTheFoldersTensors() {
    for (const std::string name : {"tiny-sd3", "tiny-sd3-t5", "tiny-sd35m"}) {
      const auto folder = folder_of(name);
      const auto m = pipeline::load_sd3_single_file(file(name), with_config(folder));
      EXPECT_SAME_TENSORS(m.transformer, models::load_sd3_transformer(folder / "transformer"));
      EXPECT_SAME_TENSORS(m.vae, models::load_autoencoder_kl(folder / "vae"));
      EXPECT_SAME_TENSORS(m.text_encoder, models::load_clip_text_model_with_projection(folder / "text_encoder"));
      EXPECT_SAME_TENSORS(m.text_encoder_2, models::load_clip_text_model_with_projection(folder / "text_encoder_2"));
      if (name == "tiny-sd3-t5") {
        QCOMPARE(m.t5, std::string("loaded"));
        EXPECT_SAME_TENSORS(m.text_encoder_3, models::load_t5_encoder(folder / "text_encoder_3"));
        QCOMPARE(m.t5_tokenizer_dir, folder / "tokenizer_3");
      } else {
        QCOMPARE(m.t5, std::string("not in file"));
        QVERIFY(!m.text_encoder_3);
      }
      QVERIFY(m.from_config_dir.empty());
      QCOMPARE(m.scheduler_json, folder / "scheduler" / "scheduler_config.json");
    }
    // T5 not asked for: not built.
    const auto no_t5 = pipeline::load_sd3_single_file(file("tiny-sd3-t5"), with_config(folder_of("tiny-sd3-t5")), false);
    QCOMPARE(no_t5.t5, std::string("not loaded"));
    QVERIFY(no_t5.t5_available && !no_t5.text_encoder_3);
  }

  // The MMDiT's config from shapes alone (qk-norm weights show the 16-wide heads), the T5's too.
  // SD3.5 medium's qk norms and image-only attn2 under sequence parallelism: one device's job.
  void sd35mRunsSequenceParallel() {
    auto pipe = pipeline::StableDiffusion3::load(folder_of("tiny-sd35m"), "cpu");
    const auto r = request(pipe->path().string());
    const auto base = test::latents_tensor(pipe->generate(r, {}, job::CancelToken{}));
    const auto sp = test::strategy_job(*pipe, r, "sequence-parallel", 2, 1, 0, {}).first;
    qInfo("tiny-sd35m sequence-parallel n=2: max |diff| %.3g", test::max_abs_diff(sp, base));
    DIFFRACT_COMPARE_TENSORS(sp, base, 1e-4);
  }

  void infersConfigs() {
    QTemporaryDir tmp;
    const auto folder = folder_of("tiny-sd35m");
    const auto m = pipeline::load_sd3_single_file(file("tiny-sd35m"), with_config(dir() / "sd35m-configs"));
    QVERIFY(std::find(m.configured.begin(), m.configured.end(), "transformer") == m.configured.end());
    const auto& got = m.transformer->config;
    const auto want = models::SD3Transformer2DConfig::from_json(folder / "transformer" / "config.json");
    QCOMPARE(got.num_layers, want.num_layers);
    QCOMPARE(got.num_attention_heads, want.num_attention_heads);
    QCOMPARE(got.attention_head_dim, want.attention_head_dim);
    QCOMPARE(got.patch_size, want.patch_size);
    QCOMPARE(got.in_channels, want.in_channels);
    QCOMPARE(got.out_channels, want.out_channels);
    QCOMPARE(got.joint_attention_dim, want.joint_attention_dim);
    QCOMPARE(got.caption_projection_dim, want.caption_projection_dim);
    QCOMPARE(got.pooled_projection_dim, want.pooled_projection_dim);
    QCOMPARE(got.pos_embed_max_size, want.pos_embed_max_size);
    QCOMPARE(got.qk_norm, want.qk_norm);
    QCOMPARE(got.dual_attention_layers, want.dual_attention_layers);
    EXPECT_SAME_TENSORS(m.transformer, models::load_sd3_transformer(folder / "transformer"));
    QVERIFY(m.scheduler_json.empty());
    QVERIFY(m.scheduler_text.find("\"shift\": 3.0") != std::string::npos);

    // T5 from shapes: the folder's config.json, field by field.
    const auto all = io::load_state_dict(file("tiny-sd3-t5"));
    const auto t5 = pipeline::infer_t5_config(io::map_sd3_t5(all, "text_encoders.t5xxl.transformer."), "t5");
    const auto t5_want = models::T5EncoderOptions::from_json(folder_of("tiny-sd3-t5") / "text_encoder_3" / "config.json");
    QCOMPARE(t5.vocab_size, t5_want.vocab_size);
    QCOMPARE(t5.d_model, t5_want.d_model);
    QCOMPARE(t5.d_kv, t5_want.d_kv);
    QCOMPARE(t5.d_ff, t5_want.d_ff);
    QCOMPARE(t5.num_layers, t5_want.num_layers);
    QCOMPARE(t5.num_heads, t5_want.num_heads);
    QCOMPARE(t5.relative_attention_num_buckets, t5_want.relative_attention_num_buckets);
    QCOMPARE(t5.feed_forward_proj, t5_want.feed_forward_proj);
  }

  // The transformer loaded from each file against diffusers' output of the folder's transformer.
  void transformerMatchesDiffusers() {
    const auto refs = io::load_state_dict(dir() / "sd3_single_file_cases.safetensors");
    at::NoGradGuard no_grad;
    for (const std::string name : {"tiny-sd3", "tiny-sd35m"}) {
      const auto configs = name == "tiny-sd35m" ? dir() / "sd35m-configs" : folder_of(name);
      auto m = pipeline::load_sd3_single_file(file(name), with_config(configs));
      const auto out = m.transformer->forward(refs.at(name + ".x"), refs.at(name + ".context"),
                                              refs.at(name + ".pooled"), refs.at(name + ".t"));
      const auto want = refs.at(name + ".out");
      QCOMPARE(out.sizes().vec(), want.sizes().vec());
      const double diff = (out - want).abs().max().item<double>();
      QVERIFY2(diff < 1e-5, qPrintable(QString::fromStdString(name) + QString(": max diff %1").arg(diff)));
    }
  }

  // --- the pipeline ---------------------------------------------------------------------------------
  void generatesLikeTheFolder() {
    pipeline::StableDiffusion3::LoadOptions options;
    options.config_dir = folder_of("tiny-sd3");
    const auto single = pipeline::StableDiffusion3::load(file("tiny-sd3"), "cpu", options);
    const auto folder = pipeline::StableDiffusion3::load(folder_of("tiny-sd3"), "cpu");
    QCOMPARE(single->native_size(), folder->native_size());
    QVERIFY(!single->has_t5() && !single->t5_dropped());
    expect_same_generation(*single, *folder);

    // The engine's factory picks the SD3 pipeline for an SD3 file.
    auto any = pipeline::load_pipeline(file("tiny-sd3"), "cpu", folder_of("tiny-sd3"));
    QVERIFY(dynamic_cast<pipeline::StableDiffusion3*>(any.get()) != nullptr);
  }

  // Transformer config inferred, scheduler defaults (flow-Euler, shift 3) instead of the folder's.
  void generatesSD35MediumLikeTheFolder() {
    pipeline::StableDiffusion3::LoadOptions options;
    options.config_dir = dir() / "sd35m-configs";
    const auto single = pipeline::StableDiffusion3::load(file("tiny-sd35m"), "cpu", options);
    const auto folder = pipeline::StableDiffusion3::load(folder_of("tiny-sd35m"), "cpu");
    expect_same_generation(*single, *folder);
  }

  void t5FromTheFile() {
    QTemporaryDir tmp;
    // No tokenizer_3 in the config folder: T5 is in the file but dropped (with a warning).
    const auto configs = configs_only(tmp, folder_of("tiny-sd3-t5"), {"text_encoder", "text_encoder_2", "vae", "transformer"});
    pipeline::StableDiffusion3::LoadOptions options;
    options.config_dir = configs;
    const auto dropped = pipeline::StableDiffusion3::load(file("tiny-sd3-t5"), "cpu", options);
    QVERIFY(!dropped->has_t5());
    QVERIFY(dropped->t5_dropped());
    if (!text::T5Tokenizer::available()) QSKIP("this build has no SentencePiece: T5 cannot run");
    options.config_dir = folder_of("tiny-sd3-t5");
    const auto single = pipeline::StableDiffusion3::load(file("tiny-sd3-t5"), "cpu", options);
    QVERIFY(single->has_t5());
    const auto folder = pipeline::StableDiffusion3::load(folder_of("tiny-sd3-t5"), "cpu");
    QVERIFY(folder->has_t5());
    expect_same_generation(*single, *folder);
  }

  // Components the file lacks come from the config folder's weights (SD3.5 files ship without text encoders).
  void missingPartsFromTheConfigFolder() {
    const auto m = pipeline::load_sd3_single_file(dir() / "sd3_no_text_encoders.safetensors",
                                                  with_config(folder_of("tiny-sd3")));
    QCOMPARE(m.from_config_dir, (std::vector<std::string>{"text_encoder", "text_encoder_2"}));
    EXPECT_SAME_TENSORS(m.text_encoder_2,
                        models::load_clip_text_model_with_projection(folder_of("tiny-sd3") / "text_encoder_2"));
  }

  // --- errors ---------------------------------------------------------------------------------------
  void rejectsBrokenFiles() {
    const auto configs = with_config(folder_of("tiny-sd3"));
    const auto path = [](const std::string& name) { return (dir() / (name + ".safetensors")).string(); };
    const auto load = [&](const std::string& name, const pipeline::SingleFileOptions& o = {}) {
      return pipeline::load_sd3_single_file(dir() / (name + ".safetensors"), o);
    };
    const auto no_vae = path("sd3_no_vae"), no_g = path("sd3_no_clip_g"), no_te = path("sd3_no_text_encoders"),
               truncated = path("sd3_truncated"), wrong = path("sd3_wrong_shape"), vae4 = path("sd3_vae4"),
               narrow = path("sd3_narrow_pooled");
    DIFFRACT_EXPECT_ERROR(load("sd3_no_vae"), no_vae.c_str(), "incomplete SD3-like single file",
                          "lacks the VAE (first_stage_model.*)", "--config");
    DIFFRACT_EXPECT_ERROR(load("sd3_no_clip_g"), no_g.c_str(), "lacks the CLIP-G text encoder (text_encoders.clip_g");
    DIFFRACT_EXPECT_ERROR(load("sd3_no_text_encoders"), no_te.c_str(), "the CLIP-L text encoder", "and the CLIP-G",
                          "sd3_medium_incl_clips");
    DIFFRACT_EXPECT_ERROR(load("sd3_truncated"), truncated.c_str(), "the MMDiT (model.diffusion_model.*)",
                          "lacks 'model.diffusion_model.joint_blocks.1.context_block.attn.qkv.weight'");
    DIFFRACT_EXPECT_ERROR(load("sd3_wrong_shape"), wrong.c_str(), "joint_blocks.0.x_block.attn.qkv.weight",
                          "has shape [96, 31]", "expected [96, 32]");
    DIFFRACT_EXPECT_ERROR(load("sd3_vae4"), vae4.c_str(), "the VAE (first_stage_model.*) decodes 4 latent channels",
                          "the MMDiT makes 16");
    // A tensor that contradicts the config folder: the bind names the file, the component and the key.
    DIFFRACT_EXPECT_ERROR(load("sd3_narrow_pooled", configs), narrow.c_str(), "transformer at model.diffusion_model.",
                          "time_text_embed.text_embedder.linear_1.weight");
    // Not an SD3 file at all; a missing one; the pipeline's own error for a missing path.
    const auto sd3_transformer = folder_of("tiny-sd3") / "transformer" / "diffusion_pytorch_model.safetensors";
    const std::string sd3_transformer_path = sd3_transformer.string();
    DIFFRACT_EXPECT_ERROR(pipeline::load_sd3_single_file(sd3_transformer), sd3_transformer_path.c_str(),
                          "not an SD3 / SD3.5 checkpoint");
    const std::string missing = path("missing");
    DIFFRACT_EXPECT_ERROR(load("missing"), missing.c_str(), "no such checkpoint file");
    DIFFRACT_EXPECT_ERROR(pipeline::StableDiffusion3::load(dir() / "missing.safetensors", "cpu"), "missing.safetensors",
                          "no such SD3 model folder or single file");
    DIFFRACT_EXPECT_ERROR(load("tiny-sd3", with_config(dir() / "no-such-folder")), "no-such-folder", "does not exist");
  }
};

QTEST_GUILESS_MAIN(TestSD3SingleFile)
#include "test_sd3_single_file.moc"
