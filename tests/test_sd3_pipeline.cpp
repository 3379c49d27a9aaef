// The SD3 pipeline against diffusers' StableDiffusion3Pipeline, without T5 (text_encoder_3=None)
// and with a tiny T5: tests/reference/make_sd3_pipeline_fixtures.py's tiny seeded pipelines, CPU fp32.
#include <fstream>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/engine/engine.h"
#include "core/parallel/strategies.h"
#include "core/io/weights.h"
#include "core/pipeline/factory.h"
#include "core/pipeline/stable_diffusion_3.h"
#include "core/text/t5_tokenizer.h"
#include "core/util/error.h"
#include "strategy_job.h"
#include "diffusers_case.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "sd3_pipeline"; }
fs::path model() { return dir() / "tiny-sd3"; }
fs::path model_t5() { return dir() / "tiny-sd3-t5"; }

fs::path copy_of(const QTemporaryDir& tmp, const fs::path& src) {
  const fs::path copy = fs::path(tmp.path().toStdString()) / "sd3";
  fs::copy(src, copy, fs::copy_options::recursive);
  return copy;
}

nlohmann::json cases() {
  std::ifstream in(dir() / "sd3_pipeline_cases.json");
  return nlohmann::json::parse(in);
}

job::GenerationRequest request_for(const nlohmann::json& c) {
  return test::request_from_call(c, model().string(), /*distilled=*/false);
}

// The same fp32 operations as diffusers (text encoders, 3-4 transformer steps
// and the VAE) came out bit-identical here (max diff 0 everywhere); the tolerances leave room
// for another BLAS or thread split.
constexpr double kEmbedTol = 1e-5;
constexpr double kLatentTol = 1e-4;
constexpr int kMaxLevels = 1;  // 8-bit image against diffusers' float image * 255, rounded

}  // namespace

class TestSD3Pipeline : public QObject {
  Q_OBJECT
 private slots:
  void initTestCase() { pipe_ = pipeline::StableDiffusion3::load(model(), "cpu"); }

  void loadsTheFolder() {
    QCOMPARE(pipe_->native_size(), 32);  // sample_size 16 x VAE factor 2
    QVERIFY(!pipe_->t5_dropped());
    QCOMPARE(pipe_->max_sequence_length(), 256);
    QVERIFY(pipeline::is_sd3_folder(model()));
    QVERIFY(!pipeline::is_sd3_folder(test::fixtures() / "tiny-sd"));
  }

  void cases_data() {
    QTest::addColumn<int>("index");
    const auto c = cases();
    for (std::size_t i = 0; i < c.size(); ++i) QTest::newRow(c[i]["name"].get<std::string>().c_str()) << static_cast<int>(i);
    // After the rows, so that a cut-short list still runs the cases it has.
    QCOMPARE(c.size(), std::size_t(3));  // make_sd3_pipeline_fixtures.py's CASES
  }

  void encodesAsDiffusers_data() { cases_data(); }
  void encodesAsDiffusers() {
    QFETCH(int, index);
    const auto c = cases()[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    const auto e = io::load_state_dict(dir() / "sd3_pipeline_cases.safetensors");
    const bool cfg = c["guidance_scale"].get<double>() > 1;
    const auto ours = pipe_->encode_prompt(c["prompt"], c["negative_prompt"], c.value("num_images_per_prompt", 1), cfg);
    DIFFRACT_COMPARE_TENSORS(ours.prompt_embeds, e.at(name + ".prompt_embeds"), kEmbedTol);
    DIFFRACT_COMPARE_TENSORS(ours.pooled, e.at(name + ".pooled"), kEmbedTol);
    qInfo("%s: prompt embeddings max |diff| %.3g, pooled %.3g", name.c_str(),
          test::max_abs_diff(ours.prompt_embeds, e.at(name + ".prompt_embeds")),
          test::max_abs_diff(ours.pooled, e.at(name + ".pooled")));
    // CLIP's 77 tokens of 32 + 40 features, zero-padded to 96, then 256 zero T5 tokens.
    QCOMPARE(ours.prompt_embeds.size(1), int64_t(77 + 256));
    QVERIFY(at::equal(ours.prompt_embeds.narrow(1, 77, 256), at::zeros_like(ours.prompt_embeds.narrow(1, 77, 256))));
    QVERIFY(at::equal(ours.prompt_embeds.narrow(2, 72, 24), at::zeros_like(ours.prompt_embeds.narrow(2, 72, 24))));
    if (cfg) {
      DIFFRACT_COMPARE_TENSORS(ours.negative_prompt_embeds, e.at(name + ".negative_prompt_embeds"), kEmbedTol);
      DIFFRACT_COMPARE_TENSORS(ours.negative_pooled, e.at(name + ".negative_pooled"), kEmbedTol);
    } else {
      QVERIFY(!ours.negative_prompt_embeds.defined());
    }
  }

  void matchesDiffusersEndToEnd_data() { cases_data(); }
  void matchesDiffusersEndToEnd() {
    QFETCH(int, index);
    const auto c = cases()[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    const auto e = io::load_state_dict(dir() / "sd3_pipeline_cases.safetensors");
    const auto initial = e.at(name + ".latents.initial");
    // The latents handed to diffusers are what the seed draws here, as diffusers' prepare_latents does.
    at::Generator gen = at::detail::createCPUGenerator(c["seed"].get<uint64_t>());
    QVERIFY(at::equal(at::randn(initial.sizes(), gen, at::kFloat), initial));

    const auto request = request_for(c);
    job::CancelToken never;
    const auto result = pipe_->generate(request, {}, never, initial);
    const auto latents = at::from_blob(const_cast<float*>(result.latents.data()), result.latents_shape, at::kFloat);
    const auto expected_latents = e.at(name + ".latents.final");
    DIFFRACT_COMPARE_TENSORS(latents, expected_latents, kLatentTol);
    qInfo("%s: final latents max |diff| %.3g (|latents| up to %.3g)", name.c_str(),
          test::max_abs_diff(latents, expected_latents), expected_latents.abs().max().item<double>());

    const auto expected = e.at(name + ".image");  // [B, 3, H, W] in [0, 1]
    QCOMPARE(static_cast<int64_t>(result.images.size()), expected.size(0));
    for (std::size_t b = 0; b < result.images.size(); ++b) {
      const auto& img = result.images[b];
      auto ours = at::from_blob(const_cast<std::uint8_t*>(img.rgb.data()), {img.height, img.width, 3}, at::kByte).to(at::kInt);
      auto theirs = (expected[static_cast<int64_t>(b)].permute({1, 2, 0}) * 255).round().to(at::kInt);
      QCOMPARE(ours.sizes(), theirs.sizes());
      const auto diff = (ours - theirs).abs();
      qInfo("%s[%zu]: image max %d levels, mean %.4f", name.c_str(), b, diff.max().item<int>(),
            diff.to(at::kFloat).mean().item<float>());
      QVERIFY(diff.max().item<int>() <= kMaxLevels);
      QVERIFY(ours.max().item<int>() - ours.min().item<int>() > 20);  // a picture, not a flat field
    }
    QCOMPARE(result.family, std::string("sd3"));
    QCOMPARE(result.request.sampler, std::string("flow-euler"));
    QCOMPARE(static_cast<int>(result.timings.step_ms.size()), request.steps);
    const auto meta = nlohmann::json::parse(result.metadata_json);
    QCOMPARE(meta["t5"].get<std::string>(), std::string("absent"));
    QCOMPARE(meta["shift"].get<double>(), 3.0);

    // The seed alone gives the same job.
    const auto seeded = pipe_->generate(request, {}, never);
    QVERIFY(seeded.latents == result.latents);
    // The fixture is not blind to the text: another prompt moves the latents.
    auto other = request;
    other.prompt = "a blue bicycle";
    const auto moved = pipe_->generate(other, {}, never, initial);
    const auto moved_latents = at::from_blob(const_cast<float*>(moved.latents.data()), moved.latents_shape, at::kFloat);
    QVERIFY(test::max_abs_diff(moved_latents, expected_latents) > 1e-2);
  }

  void runsThroughTheEngineWithPreviews() {
    engine::Engine eng;
    job::GenerationRequest r;
    r.model = model().string();
    r.prompt = "a red apple";
    r.steps = 3;
    r.preview_every = 1;
    std::vector<int> steps, previews;
    job::JobObserver o;
    o.on_step = [&](const job::StepEvent& e) { steps.push_back(e.index); };
    int preview_width = 0;
    o.on_preview = [&](const job::PreviewEvent& e) {
      previews.push_back(e.index);
      preview_width = e.image.width;
      QCOMPARE(e.image.rgb.size(), std::size_t(e.image.width) * e.image.height * 3);
    };
    job::CancelToken never;
    const auto result = eng.run(r, o, never);
    QCOMPARE(preview_width, 16);  // the colour projection, at latent resolution
    QCOMPARE(result.family, std::string("sd3"));
    QCOMPARE(result.images.front().width, 32);
    QCOMPARE(steps, (std::vector<int>{0, 1, 2}));
    QCOMPARE(previews, (std::vector<int>{0, 1, 2}));
  }

  void previewsThroughA16ChannelTAESD() {
    job::GenerationRequest r;
    r.model = model().string();
    r.prompt = "a red apple";
    r.steps = 2;
    r.preview_every = 1;
    r.taesd = (test::fixtures() / "vae" / "tiny16").string();  // a tiny random AutoencoderTiny of 16 channels
    r.preview_max_side = 0;  // full size (auto would average the 16 latent rows down to 8)
    std::vector<int> widths;
    job::JobObserver o;
    o.on_preview = [&](const job::PreviewEvent& e) { widths.push_back(e.image.width); };
    job::CancelToken never;
    pipe_->generate(r, o, never);
    QCOMPARE(widths, (std::vector<int>{16 * 8, 16 * 8}));  // TAESD's 8x of the 16-latent side
    r.taesd = (test::fixtures() / "vae" / "tiny4").string();
    DIFFRACT_EXPECT_ERROR(pipe_->generate(r, o, never), "4 latent channels", "taesd3");
  }

  void refusesWhatDoesNotApply() {
    job::GenerationRequest r;
    r.model = model().string();
    r.prompt = "x";
    r.steps = 2;
    job::CancelToken never;
    r.sampler = "euler";
    DIFFRACT_EXPECT_ERROR(pipe_->generate(r, {}, never), "flow-matching", "euler");
    r.sampler.clear();
    r.width = 42;  // a multiple of the VAE's 2, not of 2 x patch 2
    DIFFRACT_EXPECT_ERROR(pipe_->generate(r, {}, never), "size 42x32", "multiple of 4");
    r.width = 0;
    r.strategy.name = "hybrid-cfg";
    r.strategy.devices = 2;
    DIFFRACT_EXPECT_ERROR(pipe_->generate(r, {}, never), "hybrid-cfg", "SD3's MMDiT has none");
    r.strategy = {};
    DIFFRACT_EXPECT_ERROR(pipe_->generate(r, {}, never, at::zeros({1, 4, 16, 16})), "initial latents");
  }

  // The multi-device strategies on CPU virtual devices against the plain loop.
  void runsStrategies() {
    job::GenerationRequest r;
    r.model = model().string();
    r.prompt = "a red apple";
    r.negative_prompt = "blurry";
    r.steps = 4;
    r.cfg = 5.0;
    r.seed = 3;
    r.preview_every = 2;
    job::CancelToken never;
    const auto base = test::latents_tensor(pipe_->generate(r, {}, never));
    int previews = 0, steps = 0;
    job::JobObserver obs;
    obs.on_preview = [&](const job::PreviewEvent&) { ++previews; };
    obs.on_step = [&](const job::StepEvent&) { ++steps; };
    const auto run = [&](const std::string& name, int devices, int batch = 1, int patches = 0) {
      previews = steps = 0;
      return test::strategy_job(*pipe_, r, name, devices, batch, patches, obs);
    };
    const auto rel = [&](const at::Tensor& a) { return ((a - base).norm() / base.norm()).item<double>(); };

    auto [cfg_par, cfg_stats] = run("cfg-parallel", 2);
    DIFFRACT_COMPARE_TENSORS(cfg_par, base, 1e-4);
    QCOMPARE(cfg_stats["rel_mae"].size(), std::size_t(4));
    QCOMPARE(previews, 2);  // previews and steps come through the step reporter
    QCOMPARE(steps, 4);

    for (const char* mode : {"driffusion", "driffusion-aggressive"}) {
      DIFFRACT_COMPARE_TENSORS(run(mode, 1).first, base, 1e-6);
      auto [out, stats] = run(mode, 2);
      const auto m = std::string(mode) == "driffusion" ? parallel::DRiffusion::Mode::Conservative
                                                       : parallel::DRiffusion::Mode::Aggressive;
      QCOMPARE(stats["rounds"].get<int>(), parallel::DRiffusion::expected_rounds(m, 4, 2));
      qInfo("%s n=2: relative L2 to one device %.3g", mode, rel(out));
      QVERIFY(rel(out) > 0 && rel(out) < 0.5);
      QCOMPARE(steps, 4);
    }

    auto batch2 = r;
    batch2.batch = 2;
    const auto base2 = test::latents_tensor(pipe_->generate(batch2, {}, never));
    DIFFRACT_COMPARE_TENSORS(run("data-parallel", 2, 2).first, base2, 1e-4);

    auto [skipped, skip_stats] = run("step-skip", 2);
    QCOMPARE(skip_stats["rounds"].get<int>(), 2);
    QVERIFY(rel(skipped) > 0);

    test::check_first_block_cache(*pipe_, r, base, 4);
    // Ulysses: each device a share of the image tokens; the same job up to rounding, CFG batched.
    auto [sp, sp_stats] = run("sequence-parallel", 2);
    qInfo("sequence-parallel n=2: max |diff| to one device %.3g, %lld bytes sent", test::max_abs_diff(sp, base),
          sp_stats["bytes_sent"].get<long long>());
    DIFFRACT_COMPARE_TENSORS(sp, base, 1e-4);
    QVERIFY(sp_stats["bytes_sent"].get<long long>() > 0);
    QCOMPARE(steps, 4);
    QCOMPARE(previews, 2);
    DIFFRACT_COMPARE_TENSORS(run("sequence-parallel", 2, 2).first, base2, 1e-4);

    auto [piped, pf_stats] = run("pipefusion", 2, 1, 4);  // 2 blocks, 8 rows of tokens in 4 patches
    qInfo("pipefusion 2x4: relative L2 to one device %.3g", rel(piped));
    QVERIFY(rel(piped) > 0 && rel(piped) < 0.2);
    QCOMPARE(pf_stats["messages_per_step"].get<std::vector<int>>(), (std::vector<int>{2, 8, 8, 8}));
    QCOMPARE(pf_stats["weights_per_rank"].size(), std::size_t(2));
    QCOMPARE(steps, 4);
    QCOMPARE(previews, 2);

    // What cannot run says so before any work.
    DIFFRACT_EXPECT_ERROR(run("warp-drive", 2), "unknown strategy 'warp-drive'");
    DIFFRACT_EXPECT_ERROR(run("data-parallel", 2), "batch of at least 2");
    DIFFRACT_EXPECT_ERROR(run("pipefusion", 2, 1, 1), "1 patches for 2 stages");
    DIFFRACT_EXPECT_ERROR(run("pipefusion", 2, 1, 3), "do not split into 3 equal patches");
    DIFFRACT_EXPECT_ERROR(run("pipefusion", 4), "4 stages for a transformer of 2 blocks");
    r.cfg = 1.0;
    DIFFRACT_EXPECT_ERROR(run("cfg-parallel", 2), "needs classifier-free guidance");
  }

  void missingComponentIsNamed() {
    for (const char* component : {"text_encoder_2", "vae", "tokenizer"}) {
      QTemporaryDir tmp;
      const fs::path copy = fs::path(tmp.path().toStdString()) / "sd3";
      fs::copy(model(), copy, fs::copy_options::recursive);
      fs::remove_all(copy / component);
      DIFFRACT_EXPECT_ERROR(pipeline::StableDiffusion3::load(copy, "cpu"), component, "missing");
      // The engine picks the SD3 pipeline from model_index.json and reports the same.
      engine::Engine eng;
      job::GenerationRequest r;
      r.model = copy.string();
      r.prompt = "x";
      job::CancelToken never;
      DIFFRACT_EXPECT_ERROR(eng.run(r, {}, never), component, "missing");
    }
  }

  // With T5: prompt embeddings (CLIP and T5 parts), final latents and image as diffusers'.
  void withT5MatchesDiffusers_data() { cases_data(); }
  void withT5MatchesDiffusers() {
    if (!text::T5Tokenizer::available()) QSKIP("this build has no SentencePiece: T5 is dropped");
    if (!pipe_t5_) pipe_t5_ = pipeline::StableDiffusion3::load(model_t5(), "cpu");
    QVERIFY(pipe_t5_->has_t5());
    QVERIFY(!pipe_t5_->t5_dropped());
    QFETCH(int, index);
    const auto c = cases()[static_cast<std::size_t>(index)];
    const std::string name = "t5." + c["name"].get<std::string>();
    const auto e = io::load_state_dict(dir() / "sd3_pipeline_cases.safetensors");
    const bool cfg = c["guidance_scale"].get<double>() > 1;
    const auto ours = pipe_t5_->encode_prompt(c["prompt"], c["negative_prompt"], c.value("num_images_per_prompt", 1), cfg);
    DIFFRACT_COMPARE_TENSORS(ours.prompt_embeds, e.at(name + ".prompt_embeds"), kEmbedTol);
    DIFFRACT_COMPARE_TENSORS(ours.pooled, e.at(name + ".pooled"), kEmbedTol);
    if (cfg) DIFFRACT_COMPARE_TENSORS(ours.negative_prompt_embeds, e.at(name + ".negative_prompt_embeds"), kEmbedTol);
    QVERIFY(ours.prompt_embeds.narrow(1, 77, 256).abs().max().item<double>() > 0.1);  // T5's part is not zeros

    const auto request = request_for(c);
    job::CancelToken never;
    const auto result = pipe_t5_->generate(request, {}, never, e.at(name + ".latents.initial"));
    DIFFRACT_COMPARE_TENSORS(test::latents_tensor(result), e.at(name + ".latents.final"), kLatentTol);
    qInfo("%s: prompt embeddings max |diff| %.3g, final latents %.3g", name.c_str(),
          test::max_abs_diff(ours.prompt_embeds, e.at(name + ".prompt_embeds")),
          test::max_abs_diff(test::latents_tensor(result), e.at(name + ".latents.final")));
    const auto expected = e.at(name + ".image");
    for (std::size_t b = 0; b < result.images.size(); ++b) {
      const auto& img = result.images[b];
      auto ours_img = at::from_blob(const_cast<std::uint8_t*>(img.rgb.data()), {img.height, img.width, 3}, at::kByte).to(at::kInt);
      auto theirs = (expected[static_cast<int64_t>(b)].permute({1, 2, 0}) * 255).round().to(at::kInt);
      QVERIFY((ours_img - theirs).abs().max().item<int>() <= kMaxLevels);
    }
    QCOMPARE(nlohmann::json::parse(result.metadata_json)["t5"].get<std::string>(), std::string("used"));

    // Dropped by the request: diffusers with text_encoder_3=None (the T5-less folder's cases).
    auto dropped_request = request;
    dropped_request.drop_t5 = true;
    const std::string plain = c["name"];
    const auto dropped = pipe_t5_->generate(dropped_request, {}, never, e.at(plain + ".latents.initial"));
    DIFFRACT_COMPARE_TENSORS(test::latents_tensor(dropped), e.at(plain + ".latents.final"), kLatentTol);
    QCOMPARE(nlohmann::json::parse(dropped.metadata_json)["t5"].get<std::string>(), std::string("dropped"));
  }

  // Dropped at load (the CLI's --no-t5 through the engine): T5 is not loaded at all.
  void droppedAtLoadEqualsDiffusersWithoutT5() {
    pipeline::StableDiffusion3::LoadOptions options;
    options.drop_t5 = true;
    auto p = pipeline::StableDiffusion3::load(model_t5(), "cpu", options);
    QVERIFY(!p->has_t5());
    QVERIFY(p->t5_dropped());
    const auto c = cases()[0];
    const auto e = io::load_state_dict(dir() / "sd3_pipeline_cases.safetensors");
    const std::string name = c["name"];
    const auto ours = p->encode_prompt(c["prompt"], c["negative_prompt"], 1, true);
    DIFFRACT_COMPARE_TENSORS(ours.prompt_embeds, e.at(name + ".prompt_embeds"), kEmbedTol);
    engine::Engine eng;
    auto r = request_for(c);
    r.model = model_t5().string();
    r.drop_t5 = true;
    job::CancelToken never;
    const auto result = eng.run(r, {}, never);
    QCOMPARE(nlohmann::json::parse(result.metadata_json)["t5"].get<std::string>(), std::string("dropped"));
  }

  void t5Errors() {
    if (!text::T5Tokenizer::available()) QSKIP("this build has no SentencePiece: T5 is dropped");
    {
      QTemporaryDir tmp;
      const auto copy = copy_of(tmp, model_t5());
      fs::remove(copy / "tokenizer_3" / "spiece.model");
      DIFFRACT_EXPECT_ERROR(pipeline::StableDiffusion3::load(copy, "cpu"), "tokenizer_3", "spiece.model is missing");
    }
    {
      QTemporaryDir tmp;
      const auto copy = copy_of(tmp, model_t5());
      nlohmann::json j;
      {
        std::ifstream in(copy / "text_encoder_3" / "config.json");
        j = nlohmann::json::parse(in);
      }
      j["d_ff"] = 64;
      std::ofstream(copy / "text_encoder_3" / "config.json") << j.dump(1);
      DIFFRACT_EXPECT_ERROR(pipeline::StableDiffusion3::load(copy, "cpu"), "encoder.block.0.layer.1.DenseReluDense.wi_0.weight");
    }
    {
      QTemporaryDir tmp;
      const auto copy = copy_of(tmp, model_t5());
      fs::remove_all(copy / "text_encoder_3");
      DIFFRACT_EXPECT_ERROR(pipeline::StableDiffusion3::load(copy, "cpu"), "text_encoder_3", "missing");
    }
  }

  void listedT5IsDroppedWithAWarning() {
    QTemporaryDir tmp;
    const fs::path copy = fs::path(tmp.path().toStdString()) / "sd3";
    fs::copy(model(), copy, fs::copy_options::recursive);
    nlohmann::json index;
    {
      std::ifstream in(copy / "model_index.json");
      index = nlohmann::json::parse(in);
    }
    index["text_encoder_3"] = {"transformers", "T5EncoderModel"};
    index["tokenizer_3"] = {"transformers", "T5TokenizerFast"};
    std::ofstream(copy / "model_index.json") << index.dump(1);
    // Listed without its folders: an error with SentencePiece, dropped (with a warning) without it.
    pipeline::StableDiffusion3::LoadOptions options;
    if (text::T5Tokenizer::available()) {
      DIFFRACT_EXPECT_ERROR(pipeline::StableDiffusion3::load(copy, "cpu"), "text_encoder_3", "missing");
      options.drop_t5 = true;
    }
    auto p = pipeline::StableDiffusion3::load(copy, "cpu", options);
    QVERIFY(p->t5_dropped());
    job::GenerationRequest r;
    r.model = copy.string();
    r.prompt = "a red apple";
    r.steps = 1;
    r.preview_every = 0;
    job::CancelToken never;
    const auto result = p->generate(r, {}, never);
    QCOMPARE(nlohmann::json::parse(result.metadata_json)["t5"].get<std::string>(), std::string("dropped"));
    // Without T5 the job is the T5-less folder's job.
    QVERIFY(result.latents == pipe_->generate(r, {}, never).latents);
  }

 private:
  std::unique_ptr<pipeline::StableDiffusion3> pipe_, pipe_t5_;
};

QTEST_GUILESS_MAIN(TestSD3Pipeline)
#include "test_sd3_pipeline.moc"
