#include <algorithm>
#include <fstream>
#include <random>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "core/io/single_file.h"
#include "core/io/weights.h"
#include "core/pipeline/single_file.h"
#include "core/util/error.h"
#include "same_tensors.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;
using io::SingleFileFamily;

namespace {

// tests/reference/make_single_file_fixtures.py writes the single files here; diffusers has already
// checked that each loads into exactly the folder's weights.
fs::path single() { return test::fixtures() / "single_file"; }

// The diffusers folder a single file was made from.
fs::path folder_of(const std::string& name) {
  return name == "tiny-sd2" ? single() / "tiny-sd2" : test::fixtures() / name;
}


// Real-size layouts, written by the oracle from diffusers / transformers models on the meta device:
// "checkpoint": the single file's names and shapes; "expected": each component's keys and shapes in
// diffusers' layout.
nlohmann::json layout_json(const std::string& name) {
  std::ifstream in(single() / ("layout_" + name + ".json"));
  return nlohmann::json::parse(in);
}

std::vector<io::TensorShape> shapes_of(const nlohmann::json& j) {
  std::vector<io::TensorShape> out;
  for (const auto& [k, v] : j.items()) out.push_back({k, v.get<std::vector<int64_t>>()});
  return out;
}

// Meta tensors: shapes without storage, so the real-size key mapping runs in no memory.
io::StateDict meta_state_dict(const std::vector<io::TensorShape>& shapes) {
  io::StateDict out;
  for (const auto& t : shapes) out.emplace(t.name, at::empty(t.shape, at::TensorOptions().device(at::kMeta)));
  return out;
}

// Empty when `mapped` has exactly the expected names and shapes (and there are some).
std::string same_layout(const io::StateDict& mapped, const nlohmann::json& expected) {
  if (expected.empty()) return " the oracle's layout lists no tensors";
  std::string why;
  for (const auto& [k, v] : expected.items()) {
    auto it = mapped.find(k);
    if (it == mapped.end()) why += "\n  missing " + k;
    else if (it->second.sizes().vec() != v.get<std::vector<int64_t>>()) why += "\n  shape of " + k;
  }
  for (const auto& [k, t] : mapped)
    if (!expected.contains(k)) why += "\n  unexpected " + k;
  return why.size() > 2000 ? why.substr(0, 2000) + "..." : why;
}

#define EXPECT_LAYOUT(mapped, expected)                                                   \
  do {                                                                                    \
    const std::string _why = same_layout(mapped, expected);                               \
    QVERIFY2(_why.empty(), qPrintable(QString::fromStdString(#mapped ":" + _why)));       \
  } while (0)

void compare_unet_structure(const models::UNet2DConditionConfig& a, const models::UNet2DConditionConfig& b,
                            bool heads) {
  QCOMPARE(a.in_channels, b.in_channels);
  QCOMPARE(a.out_channels, b.out_channels);
  QCOMPARE(a.down_block_types, b.down_block_types);
  QCOMPARE(a.up_block_types, b.up_block_types);
  QCOMPARE(a.block_out_channels, b.block_out_channels);
  QCOMPARE(a.layers_per_block, b.layers_per_block);
  QCOMPARE(a.cross_attention_dim, b.cross_attention_dim);
  QCOMPARE(a.transformer_layers_per_block, b.transformer_layers_per_block);
  QCOMPARE(a.reverse_transformer_layers_per_block, b.reverse_transformer_layers_per_block);
  QCOMPARE(a.use_linear_projection, b.use_linear_projection);
  QCOMPARE(a.addition_embed_type, b.addition_embed_type);
  QCOMPARE(a.projection_class_embeddings_input_dim, b.projection_class_embeddings_input_dim);
  if (!a.addition_embed_type.empty()) QCOMPARE(a.addition_time_embed_dim, b.addition_time_embed_dim);
  QCOMPARE(a.flip_sin_to_cos, b.flip_sin_to_cos);
  QCOMPARE(a.freq_shift, b.freq_shift);
  if (heads) {
    QCOMPARE(a.num_attention_heads, b.num_attention_heads);
    QCOMPARE(a.norm_num_groups, b.norm_num_groups);
    QCOMPARE(a.sample_size, b.sample_size);
  }
}

void compare_vae(const models::AutoencoderKLConfig& a, const models::AutoencoderKLConfig& b) {
  QCOMPARE(a.block_out_channels, b.block_out_channels);
  QCOMPARE(a.down_block_types, b.down_block_types);
  QCOMPARE(a.up_block_types, b.up_block_types);
  QCOMPARE(a.layers_per_block, b.layers_per_block);
  QCOMPARE(a.latent_channels, b.latent_channels);
  QCOMPARE(a.in_channels, b.in_channels);
  QCOMPARE(a.out_channels, b.out_channels);
  QCOMPARE(a.norm_num_groups, b.norm_num_groups);
  QCOMPARE(a.scaling_factor, b.scaling_factor);
  QCOMPARE(a.use_quant_conv, b.use_quant_conv);
  QCOMPARE(a.use_post_quant_conv, b.use_post_quant_conv);
  QCOMPARE(a.mid_block_add_attention, b.mid_block_add_attention);
}

void compare_clip(const models::CLIPTextConfig& a, const models::CLIPTextConfig& b) {
  QCOMPARE(a.vocab_size, b.vocab_size);
  QCOMPARE(a.hidden_size, b.hidden_size);
  QCOMPARE(a.intermediate_size, b.intermediate_size);
  QCOMPARE(a.projection_dim, b.projection_dim);
  QCOMPARE(a.num_hidden_layers, b.num_hidden_layers);
  QCOMPARE(a.num_attention_heads, b.num_attention_heads);
  QCOMPARE(a.max_position_embeddings, b.max_position_embeddings);
  QCOMPARE(a.hidden_act, b.hidden_act);
}

// One seeded denoiser call.
at::Tensor run_unet(models::UNet2DConditionModel& unet, int64_t context_dim, int64_t pooled_dim) {
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  models::UNetConditioning cond;
  auto x = at::randn({2, 4, 16, 12}, gen);
  cond.encoder_hidden_states = at::randn({2, 77, context_dim}, gen);
  if (pooled_dim > 0) {
    cond.text_embeds = at::randn({2, pooled_dim}, gen);
    cond.time_ids = at::tensor({64.0f, 64.0f, 0.0f, 0.0f, 64.0f, 64.0f, 80.0f, 48.0f, 8.0f, 4.0f, 64.0f, 64.0f}).view({2, 6});
  }
  return unet->forward(x, at::tensor({999.0f, 421.5f}), cond);
}

}  // namespace

class TestSingleFile : public QObject {
  Q_OBJECT
 private slots:
  // --- detection -------------------------------------------------------------------------------
  void detectsTinyFiles() {
    const auto sd = io::detect_single_file(*io::SafetensorsArchive::open(single() / "tiny-sd.safetensors"));
    QVERIFY(sd.family == SingleFileFamily::SD1);
    QCOMPARE(sd.text_encoder_prefix, std::string("cond_stage_model.transformer."));
    QVERIFY(!sd.text_encoder_open_clip);
    QCOMPARE(sd.context_dim, int64_t(32));

    const auto sd2 = io::detect_single_file(*io::SafetensorsArchive::open(single() / "tiny-sd2.safetensors"));
    QVERIFY(sd2.family == SingleFileFamily::SD2);
    QCOMPARE(sd2.text_encoder_prefix, std::string("cond_stage_model.model."));
    QVERIFY(sd2.text_encoder_open_clip);
    QCOMPARE(sd2.open_clip_blocks, int64_t(4));  // 3 used + the unused last one

    const auto xl = io::detect_single_file(*io::SafetensorsArchive::open(single() / "tiny-sdxl.safetensors"));
    QVERIFY(xl.family == SingleFileFamily::SDXL);
    QCOMPARE(xl.text_encoder_prefix, std::string("conditioner.embedders.0.transformer."));
    QCOMPARE(xl.text_encoder_2_prefix, std::string("conditioner.embedders.1.model."));
    QCOMPARE(xl.open_clip_blocks, int64_t(3));
    QCOMPARE(xl.context_dim, int64_t(64));
    QCOMPARE(io::single_file_family_name(xl.family), std::string("SDXL"));
  }

  // Real SD 1.5 / 2.1 / XL layouts (names and shapes only): detection, key mapping against the
  // diffusers / transformers module keys, and shape inference against the published configs.
  void realSizeLayouts() {
    struct Case {
      const char* name;
      SingleFileFamily family;
      models::UNet2DConditionConfig unet;
      models::AutoencoderKLConfig vae;
      models::CLIPTextConfig te;
    };
    const Case cases[] = {
        {"sd15", SingleFileFamily::SD1, models::UNet2DConditionConfig::sd15(), models::AutoencoderKLConfig::sd(),
         models::CLIPTextConfig::clip_l()},
        {"sd21", SingleFileFamily::SD2, models::UNet2DConditionConfig::sd21(), models::AutoencoderKLConfig::sd(),
         models::CLIPTextConfig::open_clip_h()},
        {"sdxl", SingleFileFamily::SDXL, models::UNet2DConditionConfig::sdxl_base(),
         models::AutoencoderKLConfig::sdxl(), models::CLIPTextConfig::clip_l()},
    };
    for (const auto& c : cases) {
      const auto j = layout_json(c.name);
      const auto& expected = j.at("expected");
      const auto shapes = shapes_of(j.at("checkpoint"));
      const auto layout = io::detect_single_file(shapes, c.name);
      QVERIFY2(layout.family == c.family, c.name);
      const auto all = meta_state_dict(shapes);

      // Text encoders first (SDXL's UNet config needs the pooled width).
      io::StateDict te;
      if (layout.text_encoder_open_clip) {
        QCOMPARE(layout.open_clip_blocks, int64_t(24));
        te = io::map_open_clip(all, layout.text_encoder_prefix, layout.open_clip_blocks - 1, false);
      } else {
        te = io::map_sd_clip(all, layout.text_encoder_prefix);
      }
      EXPECT_LAYOUT(te, expected.at("text_encoder"));
      compare_clip(pipeline::infer_clip_text_config(te, c.te.hidden_act, c.name), c.te);
      int64_t pooled = 0;
      if (c.family == SingleFileFamily::SDXL) {
        auto te2 = io::map_open_clip(all, layout.text_encoder_2_prefix);
        EXPECT_LAYOUT(te2, expected.at("text_encoder_2"));
        const auto config = pipeline::infer_clip_text_config(te2, "gelu", c.name);
        compare_clip(config, models::CLIPTextConfig::open_clip_bigg());
        pooled = config.projection_dim;
      }
      const auto unet = io::map_ldm_unet(all);
      EXPECT_LAYOUT(unet, expected.at("unet"));
      compare_unet_structure(pipeline::infer_unet_config(unet, c.family, pooled, c.name), c.unet, true);
      const auto vae = io::map_ldm_vae(all);
      EXPECT_LAYOUT(vae, expected.at("vae"));
      compare_vae(pipeline::infer_vae_config(vae, c.family, c.name), c.vae);
    }
  }

  // Detection reads names, not the order a file lists them in; a name listed twice keeps its first
  // shape (a safetensors header with a repeated name is refused before detection; a .pth's state
  // dict and the fuzzer's inputs are not).
  void detectionIgnoresOrderAndKeepsFirstOfARepeatedName() {
    for (const char* name : {"sd15", "sd21", "sdxl"}) {
      const auto shapes = shapes_of(layout_json(name).at("checkpoint"));
      const auto sorted = io::detect_single_file(shapes, name);
      auto shuffled = shapes;
      std::mt19937 random(7);
      std::shuffle(shuffled.begin(), shuffled.end(), random);
      const auto layout = io::detect_single_file(shuffled, name);
      QVERIFY2(layout.family == sorted.family, name);
      QCOMPARE(layout.context_dim, sorted.context_dim);
      QCOMPARE(layout.open_clip_blocks, sorted.open_clip_blocks);
      QCOMPARE(layout.text_encoder_prefix, sorted.text_encoder_prefix);
      QCOMPARE(layout.text_encoder_2_prefix, sorted.text_encoder_2_prefix);

      const io::TensorShape inpainting_conv_in{"model.diffusion_model.input_blocks.0.0.weight", {320, 9, 3, 3}};
      auto repeated_last = shuffled;
      repeated_last.push_back(inpainting_conv_in);
      QVERIFY2(io::detect_single_file(repeated_last, name).family == sorted.family, name);
      auto repeated_first = shuffled;
      repeated_first.insert(repeated_first.begin(), inpainting_conv_in);
      DIFFRACT_EXPECT_ERROR(io::detect_single_file(repeated_first, name), name, "inpainting");
    }
  }

  // --- loading with the folder's configs: exactly the folder's models ----------------------------
  void sd1MatchesFolder() {
    const auto m = pipeline::load_single_file(single() / "tiny-sd.safetensors", {folder_of("tiny-sd")});
    QVERIFY(m.family == SingleFileFamily::SD1);
    QCOMPARE(m.configured, (std::vector<std::string>{"text_encoder", "unet", "vae", "scheduler"}));
    QVERIFY(!m.text_encoder_2);
    const auto f = folder_of("tiny-sd");
    EXPECT_SAME_TENSORS(m.unet, models::load_unet_2d_condition(f / "unet"));
    EXPECT_SAME_TENSORS(m.vae, models::load_autoencoder_kl(f / "vae"));
    EXPECT_SAME_TENSORS(m.text_encoder, models::load_clip_text_model(f / "text_encoder"));
    QCOMPARE(m.tokenizer.pad_token, std::string("<|endoftext|>"));
    QVERIFY(!m.tokenizer_2);
    QCOMPARE(m.prediction_type, std::string("epsilon"));

    // The same UNet output as the folder's, and as diffusers' on its own inputs.
    auto folder_unet = models::load_unet_2d_condition(f / "unet");
    auto unet = m.unet;
    QVERIFY(at::equal(run_unet(unet, 32, 0), run_unet(folder_unet, 32, 0)));
    at::NoGradGuard no_grad;
    const auto e = io::load_state_dict(test::fixtures() / "unet_cases.safetensors");
    models::UNetConditioning cond;
    cond.encoder_hidden_states = e.at("sd.16x16.context");
    DIFFRACT_COMPARE_TENSORS(unet->forward(e.at("sd.16x16.x"), e.at("sd.16x16.t"), cond), e.at("sd.16x16.out"), 1e-4);
  }

  void sd2MatchesFolder() {
    const auto f = folder_of("tiny-sd2");
    const auto m = pipeline::load_single_file(single() / "tiny-sd2.safetensors", {f});
    QVERIFY(m.family == SingleFileFamily::SD2);
    EXPECT_SAME_TENSORS(m.unet, models::load_unet_2d_condition(f / "unet"));
    EXPECT_SAME_TENSORS(m.vae, models::load_autoencoder_kl(f / "vae"));
    EXPECT_SAME_TENSORS(m.text_encoder, models::load_clip_text_model(f / "text_encoder"));
    QCOMPARE(m.text_encoder->text_model->config.hidden_act, std::string("gelu"));
    QCOMPARE(m.tokenizer.pad_token, std::string("!"));
    QCOMPARE(m.prediction_type, std::string("v_prediction"));
    auto folder_unet = models::load_unet_2d_condition(f / "unet");
    auto unet = m.unet;
    QVERIFY(at::equal(run_unet(unet, 32, 0), run_unet(folder_unet, 32, 0)));

    // The text encoder gives what the folder's gives (the unused last resblock really is unused).
    at::NoGradGuard no_grad;
    auto ids = at::randint(0, 49407, {2, 77}, at::make_generator<at::CPUGeneratorImpl>(3));
    auto folder_te = models::load_clip_text_model(f / "text_encoder");
    auto te = m.text_encoder;
    QVERIFY(at::equal(te->forward(ids).last_hidden_state, folder_te->forward(ids).last_hidden_state));
  }

  void sdxlMatchesFolder() {
    const auto f = folder_of("tiny-sdxl");
    const auto m = pipeline::load_single_file(single() / "tiny-sdxl.safetensors", {f});
    QVERIFY(m.family == SingleFileFamily::SDXL);
    EXPECT_SAME_TENSORS(m.unet, models::load_unet_2d_condition(f / "unet"));
    EXPECT_SAME_TENSORS(m.vae, models::load_autoencoder_kl(f / "vae"));
    EXPECT_SAME_TENSORS(m.text_encoder, models::load_clip_text_model(f / "text_encoder"));
    QVERIFY(m.text_encoder_2);
    EXPECT_SAME_TENSORS(m.text_encoder_2, models::load_clip_text_model_with_projection(f / "text_encoder_2"));
    QCOMPARE(m.tokenizer.pad_token, std::string("<|endoftext|>"));
    QVERIFY(m.tokenizer_2);
    QCOMPARE(m.tokenizer_2->pad_token, std::string("!"));
    auto folder_unet = models::load_unet_2d_condition(f / "unet");
    auto unet = m.unet;
    QVERIFY(at::equal(run_unet(unet, 64, 24), run_unet(folder_unet, 64, 24)));
    at::NoGradGuard no_grad;
    const auto e = io::load_state_dict(test::fixtures() / "unet_cases.safetensors");
    models::UNetConditioning cond;
    cond.encoder_hidden_states = e.at("xl.16x16.context");
    cond.text_embeds = e.at("xl.16x16.text_embeds");
    cond.time_ids = e.at("xl.16x16.time_ids");
    DIFFRACT_COMPARE_TENSORS(unet->forward(e.at("xl.16x16.x"), e.at("xl.16x16.t"), cond), e.at("xl.16x16.out"), 1e-4);
  }

  void ckptMatchesSafetensors() {
    const auto a = pipeline::load_single_file(single() / "tiny-sd.ckpt", {folder_of("tiny-sd")});
    const auto b = pipeline::load_single_file(single() / "tiny-sd.safetensors", {folder_of("tiny-sd")});
    QVERIFY(a.family == SingleFileFamily::SD1);
    EXPECT_SAME_TENSORS(a.unet, b.unet);
    EXPECT_SAME_TENSORS(a.vae, b.vae);
    EXPECT_SAME_TENSORS(a.text_encoder, b.text_encoder);
  }

  // --- shapes-only inference on the tiny models ---------------------------------------------------
  void shapesOnlyInference() {
    // tiny-sd's UNet follows SD 1.x's conventions but for its 8 norm groups (we assume 32): the same
    // structure and parameters, a model that binds strictly.
    for (const std::string name : {"tiny-sd", "tiny-sd2", "tiny-sdxl"}) {
      const auto all = io::load_state_dict(single() / (name + ".safetensors"));
      const auto folder_config = models::UNet2DConditionConfig::from_json(folder_of(name) / "unet" / "config.json");
      const auto unet_sd = io::map_ldm_unet(all);
      // 32- and 64-channel blocks have no 64-wide heads: SD 2.x / SDXL conventions cannot apply.
      if (name != "tiny-sd") {
        const auto family = name == "tiny-sd2" ? SingleFileFamily::SD2 : SingleFileFamily::SDXL;
        DIFFRACT_EXPECT_ERROR(pipeline::infer_unet_config(unet_sd, family, 24, name), name.c_str(),
                              "cannot infer the attention heads", "config_dir");
      }
      // The structure does not depend on the head convention; SD 1.x's fits every tiny model.
      const auto config = pipeline::infer_unet_config(unet_sd, SingleFileFamily::SD1, name == "tiny-sdxl" ? 24 : 0, name);
      compare_unet_structure(config, folder_config, false);
      models::UNet2DConditionModel unet(config);
      io::bind(*unet, unet_sd, name);
      EXPECT_SAME_TENSORS(unet, models::load_unet_2d_condition(folder_of(name) / "unet"));
      if (name == "tiny-sd") QCOMPARE(config.num_attention_heads, folder_config.num_attention_heads);

      DIFFRACT_EXPECT_ERROR(pipeline::infer_vae_config(io::map_ldm_vae(all), SingleFileFamily::SD1, name), name.c_str(),
                            "16 channels are not divisible into the 32 norm groups", "config_dir");
    }
    const auto all = io::load_state_dict(single() / "tiny-sd.safetensors");
    DIFFRACT_EXPECT_ERROR(pipeline::infer_clip_text_config(io::map_sd_clip(all, "cond_stage_model.transformer."),
                                                           "quick_gelu", "tiny-sd text"),
                          "tiny-sd text", "cannot infer the attention heads", "32 channels");
    DIFFRACT_EXPECT_ERROR(pipeline::load_single_file(single() / "tiny-sd.safetensors"), "tiny-sd.safetensors",
                          "(text_encoder at cond_stage_model.transformer.*)", "config_dir");
  }

  // --- tokenizers from the shipped BPE --------------------------------------------------------------
  void tokenizersMatchFolders() {
    const auto bpe = pipeline::find_clip_bpe();
    QVERIFY2(fs::is_regular_file(bpe), bpe.c_str());
    QCOMPARE(bpe.filename().string(), std::string("bpe_simple_vocab_16e6.txt.gz"));
    const std::vector<std::string> prompts = {"a photo of a cat", "", "A red apple, studio lighting!! 8k",
                                              std::string(400, 'a')};
    const auto check = [&](const text::CLIPTokenizerOptions& options, const fs::path& folder) {
      const auto ours = pipeline::make_clip_tokenizer(options);
      const auto ref = text::CLIPTokenizer::from_folder(folder);
      for (const auto& p : prompts) QCOMPARE(ours.tokenize(p).ids, ref.tokenize(p).ids);
    };
    const auto sd = pipeline::load_single_file(single() / "tiny-sd.safetensors", {folder_of("tiny-sd")});
    check(sd.tokenizer, folder_of("tiny-sd") / "tokenizer");
    const auto sd2 = pipeline::load_single_file(single() / "tiny-sd2.safetensors", {folder_of("tiny-sd2")});
    check(sd2.tokenizer, folder_of("tiny-sd2") / "tokenizer");
    const auto xl = pipeline::load_single_file(single() / "tiny-sdxl.safetensors", {folder_of("tiny-sdxl")});
    check(xl.tokenizer, folder_of("tiny-sdxl") / "tokenizer");
    check(*xl.tokenizer_2, folder_of("tiny-sdxl") / "tokenizer_2");
    QCOMPARE(pipeline::find_clip_bpe(bpe), bpe);
    DIFFRACT_EXPECT_ERROR(pipeline::find_clip_bpe("/nonexistent/bpe.txt.gz"), "/nonexistent/bpe.txt.gz", "not found");
  }

  // --- bad inputs -----------------------------------------------------------------------------------
  void rejectsBadFiles() {
    const auto load = [](const std::string& name) { return pipeline::load_single_file(single() / name); };
    const auto path = [](const std::string& name) { return (single() / name).string(); };
    const std::string not_sd = path("not_sd.safetensors"), no_vae = path("no_vae.safetensors"),
                      unet_only = path("unet_only.safetensors"), inpaint = path("inpainting.safetensors"),
                      sd3 = path("sd3_like.safetensors"), flux = path("flux_like.safetensors"),
                      garbage = path("garbage.safetensors"), missing = path("missing.safetensors");
    DIFFRACT_EXPECT_ERROR(load("not_sd.safetensors"), not_sd.c_str(), "not a Stable Diffusion single-file checkpoint",
                          "first key 'layer.0.bias'");
    DIFFRACT_EXPECT_ERROR(load("no_vae.safetensors"), no_vae.c_str(), "incomplete SD 1.x single-file checkpoint",
                          "lacks the VAE (first_stage_model.");
    DIFFRACT_EXPECT_ERROR(load("unet_only.safetensors"), unet_only.c_str(), "incomplete", "the VAE",
                          "and a text encoder");
    DIFFRACT_EXPECT_ERROR(load("inpainting.safetensors"), inpaint.c_str(), "inpainting SD 1.x UNet (9 input channels)");
    DIFFRACT_EXPECT_ERROR(load("sd3_like.safetensors"), sd3.c_str(), "SD3", "joint_blocks", "SD3 pipeline");
    DIFFRACT_EXPECT_ERROR(load("flux_like.safetensors"), flux.c_str(), "FLUX", "double_blocks.0.img_attn");
    DIFFRACT_EXPECT_ERROR(load("garbage.safetensors"), garbage.c_str());
    DIFFRACT_EXPECT_ERROR(load("missing.safetensors"), missing.c_str(), "no such checkpoint file");
    const std::string cfg = (single() / "no-such-folder").string();
    DIFFRACT_EXPECT_ERROR(pipeline::load_single_file(single() / "tiny-sd.safetensors", {single() / "no-such-folder"}),
                          cfg.c_str(), "does not exist");
    // A config folder of another model: the bind names the file, the component and the keys.
    const std::string sd = path("tiny-sd.safetensors");
    DIFFRACT_EXPECT_ERROR(pipeline::load_single_file(single() / "tiny-sd.safetensors", {folder_of("tiny-sdxl")}),
                          sd.c_str(), "(unet at model.diffusion_model.*)", "weights do not match the model");
  }

  // Synthesised key sets from the real layouts.
  void rejectsBadKeySets() {
    const auto xl = shapes_of(layout_json("sdxl").at("checkpoint"));
    const auto sd15 = shapes_of(layout_json("sd15").at("checkpoint"));
    const auto sd21 = shapes_of(layout_json("sd21").at("checkpoint"));
    const auto edit = [](std::vector<io::TensorShape> shapes, const std::function<bool(io::TensorShape&)>& keep) {
      std::vector<io::TensorShape> out;
      for (auto& t : shapes)
        if (keep(t)) out.push_back(t);
      return out;
    };
    const auto starts = [](const std::string& s, const char* p) { return s.rfind(p, 0) == 0; };

    // The SDXL refiner: OpenCLIP-bigG alone, as embedders.0.
    auto refiner = edit(xl, [&](io::TensorShape& t) {
      if (starts(t.name, "conditioner.embedders.0.")) return false;
      if (starts(t.name, "conditioner.embedders.1.")) t.name.replace(0, 24, "conditioner.embedders.0.");
      return true;
    });
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(refiner, "refiner.safetensors"), "refiner.safetensors", "SDXL refiner");
    auto no_bigg = edit(xl, [&](io::TensorShape& t) { return !starts(t.name, "conditioner.embedders.1."); });
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(no_bigg, "xl.safetensors"), "xl.safetensors", "incomplete SDXL",
                          "OpenCLIP-bigG");
    // An SD 2.x UNet with SD 1.x's text encoder.
    auto mixed = edit(sd21, [&](io::TensorShape& t) { return !starts(t.name, "cond_stage_model."); });
    for (const auto& t : sd15)
      if (starts(t.name, "cond_stage_model.")) mixed.push_back(t);
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(mixed, "mixed.safetensors"), "mixed.safetensors",
                          "attends to 1024-wide text features", "give 768");
    // No VAE and no text encoder: the UNet alone, recognised by its context width.
    auto unet_only = edit(xl, [&](io::TensorShape& t) { return starts(t.name, "model.diffusion_model."); });
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(unet_only, "u.safetensors"), "u.safetensors",
                          "incomplete SDXL-like single-file checkpoint", "the VAE", "a text encoder");
    // VAE and text encoder but no UNet.
    auto no_unet = edit(sd15, [&](io::TensorShape& t) { return !starts(t.name, "model.diffusion_model."); });
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(no_unet, "n.safetensors"), "n.safetensors", "lacks the UNet");
    // Variants of the families.
    auto upscaler = sd21;
    upscaler.push_back({"model.diffusion_model.label_emb.weight", {1000, 1280}});
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(upscaler, "x4.safetensors"), "x4.safetensors", "x4 upscaler");
    auto unclip = sd21;
    unclip.push_back({"model.diffusion_model.label_emb.0.0.weight", {1280, 2048}});
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(unclip, "unclip.safetensors"), "unclip.safetensors", "unCLIP");
    auto playground = xl;
    playground.push_back({"edm_mean", {1, 4, 1, 1}});
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(playground, "pg.safetensors"), "pg.safetensors", "Playground v2.5");
    // A diffusers-layout UNet saved as one file, and nothing at all.
    const auto unet_keys = shapes_of(layout_json("sd15").at("expected").at("unet"));
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(unet_keys, "d.safetensors"), "d.safetensors", "diffusers-layout");
    DIFFRACT_EXPECT_ERROR(io::detect_single_file({}, "e.safetensors"), "e.safetensors", "holds no tensors");
  }

  // Keys the mapping does not know reach bind() under their original names.
  void unknownKeysAreReported() {
    auto all = io::load_state_dict(single() / "tiny-sd.safetensors");
    all.emplace("model.diffusion_model.input_blocks.1.0.extra.weight", at::zeros({2}));
    all.emplace("first_stage_model.encoder.mid.attn_2.q.weight", at::zeros({2}));
    auto unet_sd = io::map_ldm_unet(all);
    QVERIFY(unet_sd.count("model.diffusion_model.input_blocks.1.0.extra.weight"));
    auto unet = models::UNet2DConditionModel(
        models::UNet2DConditionConfig::from_json(folder_of("tiny-sd") / "unet" / "config.json"));
    DIFFRACT_EXPECT_ERROR(io::bind(*unet, unet_sd, "f.safetensors"), "f.safetensors", "unexpected keys (1)",
                          "model.diffusion_model.input_blocks.1.0.extra.weight");
    QVERIFY(io::map_ldm_vae(all).count("first_stage_model.encoder.mid.attn_2.q.weight"));
  }
};

QTEST_GUILESS_MAIN(TestSingleFile)
#include "test_single_file.moc"
