// FLUX.1 single files: tests/reference/make_flux_single_file_fixtures.py writes the Flux fixtures'
// tiny folders as BFL transformer-only files, a ComfyUI all-in-one file and float8 files (plain and
// scaled), and has already checked with diffusers' own conversions that each maps back to the
// folder's tensors. Here: our loader binds the folder's tensors bit for bit (the float8 ones as the
// script dequantised them), infers the configs, and generates what the folder generates.
#include <QTemporaryDir>

#include <ATen/ATen.h>

#include "core/io/safetensors.h"
#include "core/io/safetensors_writer.h"
#include "core/io/single_file.h"
#include "core/io/weights.h"
#include "core/job/job.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/pipeline/factory.h"
#include "core/pipeline/flux.h"
#include "core/pipeline/single_file.h"
#include "core/util/error.h"
#include "same_tensors.h"
#include "strategy_job.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "flux_single_file"; }
fs::path file(const std::string& name) { return dir() / (name + ".safetensors"); }
fs::path folder(const std::string& name) { return test::fixtures() / "flux" / ("tiny-flux-" + name); }

std::vector<io::TensorShape> shapes_of(const fs::path& path) {
  return io::tensor_shapes(*io::SafetensorsArchive::open(path));
}

pipeline::SingleFileOptions with_config(const fs::path& config_dir) {
  pipeline::SingleFileOptions o;
  o.config_dir = config_dir;
  return o;
}

pipeline::FluxSingleFileModels load(const std::string& name, const fs::path& config_dir) {
  return pipeline::load_flux_single_file(file(name), with_config(config_dir), at::kFloat);
}

std::unique_ptr<pipeline::Flux> flux(const fs::path& model, const fs::path& config_dir = {}) {
  pipeline::Flux::LoadOptions o;
  o.config_dir = config_dir;
  return pipeline::Flux::load(model, "cpu", o);
}

job::GenerationRequest request(const fs::path& model) {
  job::GenerationRequest r;
  r.model = model.string();
  r.prompt = "a red apple on a white background";
  r.steps = 3;
  r.guidance = 3.5;
  r.width = 32;
  r.height = 48;
  r.seed = 7;
  r.preview_every = 0;
  return r;
}

// Same request through two pipelines: final latents and images equal.
void expect_same_generation(pipeline::Flux& a, pipeline::Flux& b) {
  job::CancelToken never;
  EXPECT_SAME_GENERATION(a.generate(request(a.path()), {}, never), b.generate(request(b.path()), {}, never));
}

}  // namespace

class TestFluxSingleFile : public QObject {
  Q_OBJECT
 private slots:
  // --- detection ---------------------------------------------------------------------------------
  void detectsTheLayouts() {
    const auto bfl = io::detect_flux_single_file(shapes_of(file("tiny-flux-dev-bfl")), "bfl");
    QCOMPARE(bfl.transformer_prefix, std::string());
    QVERIFY(bfl.vae_prefix.empty() && bfl.clip_l_prefix.empty() && bfl.t5_prefix.empty());
    QCOMPARE(bfl.double_blocks, int64_t(2));
    QCOMPARE(bfl.single_blocks, int64_t(3));
    QCOMPARE(bfl.hidden_size, int64_t(32));
    QCOMPARE(bfl.head_dim, int64_t(16));
    QCOMPARE(bfl.in_channels, int64_t(64));
    QCOMPARE(bfl.joint_attention_dim, int64_t(48));
    QCOMPARE(bfl.pooled_projection_dim, int64_t(32));
    QVERIFY(bfl.guidance && !bfl.fp8 && !bfl.fp8_scaled);
    QCOMPARE(bfl.variant, std::string("FLUX-like"));
    QVERIFY(!io::detect_flux_single_file(shapes_of(file("tiny-flux-schnell-bfl")), "s").guidance);

    const auto aio = io::detect_flux_single_file(shapes_of(file("tiny-flux-dev-aio")), "aio");
    QCOMPARE(aio.transformer_prefix, std::string("model.diffusion_model."));
    QCOMPARE(aio.vae_prefix, std::string("vae."));
    QCOMPARE(aio.clip_l_prefix, std::string("text_encoders.clip_l.transformer."));
    QCOMPARE(aio.t5_prefix, std::string("text_encoders.t5xxl.transformer."));

    const auto fp8 = io::detect_flux_single_file(shapes_of(file("tiny-flux-dev-fp8")), "fp8");
    QVERIFY(fp8.fp8 && !fp8.fp8_scaled);
    const auto scaled = io::detect_flux_single_file(shapes_of(file("tiny-flux-dev-fp8-scaled")), "scaled");
    QVERIFY(scaled.fp8 && scaled.fp8_scaled);

    for (const std::string name : {"tiny-flux-dev-bfl", "tiny-flux-dev-aio", "tiny-flux-dev-fp8-scaled"})
      QVERIFY(pipeline::is_flux_single_file(file(name)));
    QVERIFY(!pipeline::is_flux_single_file(folder("dev") / "transformer" / "diffusion_pytorch_model.safetensors"));
    QVERIFY(!pipeline::is_flux_single_file(folder("dev")));
    QVERIFY(!pipeline::is_flux_single_file(test::fixtures() / "sd3_single_file" / "tiny-sd3.safetensors"));
    QVERIFY(!pipeline::is_flux_single_file(dir() / "missing.safetensors"));
    // The SD / SDXL detection sends FLUX files on.
    DIFFRACT_EXPECT_ERROR(io::detect_single_file(*io::SafetensorsArchive::open(file("tiny-flux-dev-aio"))),
                          "a FLUX checkpoint", "Flux pipeline");
  }

  // Real sizes from names and shapes alone: FLUX.1-dev and schnell.
  void namesTheVariants() {
    const auto flux1 = [](bool guidance) {
      std::vector<io::TensorShape> t;
      const int64_t d = 3072;
      t.push_back({"img_in.weight", {d, 64}});
      t.push_back({"txt_in.weight", {d, 4096}});
      t.push_back({"time_in.in_layer.weight", {d, 256}});
      t.push_back({"time_in.out_layer.weight", {d, d}});
      t.push_back({"vector_in.in_layer.weight", {d, 768}});
      t.push_back({"vector_in.out_layer.weight", {d, d}});
      if (guidance) {
        t.push_back({"guidance_in.in_layer.weight", {d, 256}});
        t.push_back({"guidance_in.out_layer.weight", {d, d}});
      }
      t.push_back({"final_layer.linear.weight", {64, d}});
      t.push_back({"final_layer.adaLN_modulation.1.weight", {2 * d, d}});
      for (int b = 0; b < 19; ++b) {
        const std::string k = "double_blocks." + std::to_string(b) + ".";
        for (const std::string s : {"img", "txt"}) {
          t.push_back({k + s + "_mod.lin.weight", {6 * d, d}, true});
          t.push_back({k + s + "_attn.qkv.weight", {3 * d, d}, true});
          t.push_back({k + s + "_attn.proj.weight", {d, d}, true});
          t.push_back({k + s + "_attn.norm.query_norm.scale", {128}});
          t.push_back({k + s + "_attn.norm.key_norm.scale", {128}});
          t.push_back({k + s + "_mlp.0.weight", {4 * d, d}, true});
          t.push_back({k + s + "_mlp.2.weight", {d, 4 * d}, true});
        }
      }
      for (int b = 0; b < 38; ++b) {
        const std::string k = "single_blocks." + std::to_string(b) + ".";
        t.push_back({k + "modulation.lin.weight", {3 * d, d}});
        t.push_back({k + "linear1.weight", {7 * d, d}});
        t.push_back({k + "linear2.weight", {d, 5 * d}});
        t.push_back({k + "norm.query_norm.scale", {128}});
        t.push_back({k + "norm.key_norm.scale", {128}});
      }
      return t;
    };
    const auto dev = io::detect_flux_single_file(flux1(true), "dev");
    QCOMPARE(dev.variant, std::string("FLUX.1-dev"));
    QVERIFY(dev.fp8);  // the float8 flags above
    QCOMPARE(io::detect_flux_single_file(flux1(false), "schnell").variant, std::string("FLUX.1-schnell"));
    // Hostile shapes: named errors, never an arithmetic overflow or an out-of-range read.
    auto huge = flux1(true);
    huge[0].shape = {int64_t(1) << 62, 64};
    DIFFRACT_EXPECT_ERROR(io::detect_flux_single_file(huge, "h"), "not a transformer's input projection");
    auto flat_vae = flux1(true);
    flat_vae.push_back({"vae.decoder.conv_in.weight", {512}});
    DIFFRACT_EXPECT_ERROR(io::detect_flux_single_file(flat_vae, "v"), "vae.decoder.conv_in.weight", "not a convolution");
  }

  // --- weights -------------------------------------------------------------------------------------
  void bindsTheFoldersTensors() {
    for (const std::string name : {"dev", "schnell"}) {
      const auto m = load("tiny-flux-" + name + "-bfl", folder(name));
      EXPECT_SAME_TENSORS(m.transformer, models::load_flux_transformer(folder(name) / "transformer"));
      EXPECT_SAME_TENSORS(m.vae, models::load_autoencoder_kl(folder(name) / "vae"));
      EXPECT_SAME_TENSORS(m.text_encoder, models::load_clip_text_model(folder(name) / "text_encoder"));
      EXPECT_SAME_TENSORS(m.text_encoder_2, models::load_t5_encoder(folder(name) / "text_encoder_2"));
      QCOMPARE(m.from_config_dir, (std::vector<std::string>{"vae", "text_encoder", "text_encoder_2"}));
      QCOMPARE(m.t5_tokenizer_dir, folder(name) / "tokenizer_2");
      QCOMPARE(m.clip_tokenizer_dir, folder(name) / "tokenizer");
      QCOMPARE(m.scheduler_json, folder(name) / "scheduler" / "scheduler_config.json");
    }
    // The all-in-one file with configs only: the transformer's and T5's from shapes.
    const auto aio = load("tiny-flux-dev-aio", dir() / "flux-configs");
    EXPECT_SAME_TENSORS(aio.transformer, models::load_flux_transformer(folder("dev") / "transformer"));
    EXPECT_SAME_TENSORS(aio.vae, models::load_autoencoder_kl(folder("dev") / "vae"));
    EXPECT_SAME_TENSORS(aio.text_encoder, models::load_clip_text_model(folder("dev") / "text_encoder"));
    EXPECT_SAME_TENSORS(aio.text_encoder_2, models::load_t5_encoder(folder("dev") / "text_encoder_2"));
    QVERIFY(aio.from_config_dir.empty());
    QCOMPARE(aio.configured, (std::vector<std::string>{"vae", "text_encoder"}));
    QVERIFY(aio.scheduler_json.empty());  // dev's schedule, built in
    QVERIFY(aio.scheduler_text.find("\"use_dynamic_shifting\": true") != std::string::npos);
    const auto folder_config = models::FluxTransformer2DConfig::from_json(folder("dev") / "transformer" / "config.json");
    QCOMPARE(aio.transformer->config.axes_dims_rope, folder_config.axes_dims_rope);
  }

  // float8: the script's float32(fp8) * scale, bound exactly; scale keys gone.
  void dequantisesFloat8_data() {
    QTest::addColumn<QString>("name");
    QTest::newRow("plain") << "fp8";
    QTest::newRow("scaled") << "fp8-scaled";
  }
  void dequantisesFloat8() {
    QFETCH(QString, name);
    const std::string n = name.toStdString();
    const auto m = load("tiny-flux-dev-" + n, folder("dev"));
    static const io::StateDict expected = io::load_state_dict(dir() / "flux_fp8_expected.safetensors");
    const auto ours = test::tensors_of(*m.transformer);
    std::size_t compared = 0;
    for (const auto& [key, t] : expected) {
      if (key.rfind(n + "/", 0) != 0) continue;
      const auto it = ours.find(key.substr(n.size() + 1));
      QVERIFY2(it != ours.end(), key.c_str());
      QVERIFY2(at::equal(it->second, t), key.c_str());
      ++compared;
    }
    QCOMPARE(compared, ours.size());
    QVERIFY(m.layout.fp8);
    QCOMPARE(m.fp8_scaled > 0, n == "fp8-scaled");
    // and it runs
    auto pipe = flux(file("tiny-flux-dev-" + n), folder("dev"));
    const auto r = pipe->generate(request(pipe->path()), {}, job::CancelToken{});
    QVERIFY(at::isfinite(test::latents_tensor(r)).all().item<bool>());
  }

  // A weight scale outside the transformer (an all-in-one file's scaled T5) is folded in too.
  void scalesTheOtherComponents() {
    QTemporaryDir tmp;
    const fs::path out = fs::path(tmp.path().toStdString()) / "aio-scaled-t5.safetensors";
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& [k, v] : io::load_state_dict(file("tiny-flux-dev-aio"))) tensors.emplace_back(k, v);
    const std::string q = "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.";
    tensors.emplace_back(q + "scale_weight", at::tensor({2.0f}));
    io::write_safetensors(out, tensors);
    const auto m = pipeline::load_flux_single_file(out, with_config(dir() / "flux-configs"), at::kFloat);
    QVERIFY(m.layout.fp8_scaled);
    const auto folder_t5 = models::load_t5_encoder(folder("dev") / "text_encoder_2");
    const auto ours = test::tensors_of(*m.text_encoder_2), theirs = test::tensors_of(*folder_t5);
    const std::string key = "encoder.block.0.layer.0.SelfAttention.q.weight";
    QVERIFY(ours.count(key));
    QVERIFY(at::equal(ours.at(key), theirs.at(key) * 2));
  }

  // Scales in bf16 when the pipeline runs in bf16: computed in float32, rounded once.
  void dequantisesIntoTheGivenDtype() {
    io::StateDict sd;
    sd.emplace("a.weight", at::tensor({1.0f, -2.0f, 448.0f}).view({3, 1}).to(at::kFloat8_e4m3fn));
    sd.emplace("a.scale_weight", at::tensor({0.1f}));
    sd.emplace("b.weight", at::tensor({1.5f, 3.0f}).view({2, 1}).to(at::kFloat8_e4m3fn));
    sd.emplace("b.weight_scale", at::tensor({2.0f, 0.5f}));
    sd.emplace("b.input_scale", at::tensor({1.0f}));
    sd.emplace("scaled_fp8", at::zeros({2}));
    std::size_t scaled = 0;
    const auto out = io::dequantize_fp8(sd, at::kBFloat16, "t", &scaled);
    QCOMPARE(scaled, std::size_t(2));
    QCOMPARE(out.size(), std::size_t(2));
    QVERIFY(out.at("a.weight").scalar_type() == at::kBFloat16);
    QVERIFY(at::equal(out.at("a.weight"), (at::tensor({1.0f, -2.0f, 448.0f}) * 0.1f).view({3, 1}).to(at::kBFloat16)));
    QVERIFY(at::equal(out.at("b.weight").to(at::kFloat), at::tensor({3.0f, 1.5f}).view({2, 1})));
  }

  // --- generation ------------------------------------------------------------------------------------
  void generatesAsTheFolder() {
    const auto dev = flux(folder("dev"));
    expect_same_generation(*flux(file("tiny-flux-dev-bfl"), folder("dev")), *dev);
    expect_same_generation(*flux(file("tiny-flux-dev-aio"), dir() / "flux-configs"), *dev);
    // The factory picks Flux from the tensor names.
    const auto any = pipeline::load_pipeline(file("tiny-flux-dev-aio"), "cpu", dir() / "flux-configs");
    QVERIFY(any->family() == job::ModelFamily::Flux);
    // schnell's file with dev's folder: schnell's own schedule, not the folder's (its CLIP / T5 are
    // the same seeds as schnell's folder).
    expect_same_generation(*flux(file("tiny-flux-schnell-bfl"), folder("dev")), *flux(folder("schnell")));
  }

  // --- errors ----------------------------------------------------------------------------------------
  void namesWhatIsMissingOrWrong() {
    const std::string bfl = file("tiny-flux-dev-bfl").string();
    DIFFRACT_EXPECT_ERROR(load("tiny-flux-dev-bfl", {}), bfl.c_str(), "holding the transformer alone", "the VAE",
                          "CLIP-L", "T5 text encoder", "T5's tokenizer", "--config");
    DIFFRACT_EXPECT_ERROR(flux(file("tiny-flux-dev-bfl")), bfl.c_str(), "--config");
    DIFFRACT_EXPECT_ERROR(load("tiny-flux-dev-aio", dir() / "no-such-folder"), "does not exist");
    const std::string no_tok = (dir() / "flux-no-t5-tokenizer").string();
    DIFFRACT_EXPECT_ERROR(load("tiny-flux-dev-aio", no_tok), "T5's tokenizer", no_tok.c_str());
    const auto broken = [](const std::string& n) { return (dir() / "broken" / (n + ".safetensors")); };
    DIFFRACT_EXPECT_ERROR(pipeline::load_flux_single_file(broken("missing-proj"), with_config(folder("dev")), at::kFloat),
                          "incomplete FLUX.1 transformer", "double_blocks.1.img_attn.proj.weight");
    DIFFRACT_EXPECT_ERROR(pipeline::load_flux_single_file(broken("flux2"), with_config(folder("dev")), at::kFloat),
                          "FLUX.2");
    DIFFRACT_EXPECT_ERROR(pipeline::load_flux_single_file(broken("fill"), with_config(folder("dev")), at::kFloat),
                          "384 input channels", "Fill");
    DIFFRACT_EXPECT_ERROR(pipeline::load_flux_single_file(broken("orphan-scale"), with_config(folder("dev")), at::kFloat),
                          "double_blocks.0.img_attn.nothing.scale_weight", "no 'double_blocks.0.img_attn.nothing.weight'");
    DIFFRACT_EXPECT_ERROR(pipeline::load_flux_single_file(broken("bad-scale"), with_config(folder("dev")), at::kFloat),
                          "double_blocks.0.img_attn.proj.scale_weight", "one per output channel");
    DIFFRACT_EXPECT_ERROR(pipeline::load_flux_single_file(broken("gap"), with_config(folder("dev")), at::kFloat),
                          "single_blocks.N are not numbered");
  }
};

QTEST_GUILESS_MAIN(TestFluxSingleFile)
#include "test_flux_single_file.moc"
