// The Flux pipeline against diffusers' FluxPipeline: tests/reference/make_flux_fixtures.py's tiny
// seeded dev (guidance embedding, resolution-dependent shift) and schnell pipelines, CPU fp32.
#include <fstream>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/io/weights.h"
#include "core/parallel/strategies.h"
#include "core/pipeline/factory.h"
#include "core/pipeline/flux.h"
#include "core/util/error.h"
#include "strategy_job.h"
#include "diffusers_case.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "flux"; }
fs::path model(const std::string& variant) { return dir() / ("tiny-flux-" + variant); }

nlohmann::json cases() {
  std::ifstream in(dir() / "flux_pipeline_cases.json");
  return nlohmann::json::parse(in);
}

const io::StateDict& expected() {
  static const io::StateDict e = io::load_state_dict(dir() / "flux_pipeline_cases.safetensors");
  return e;
}

job::GenerationRequest request_for(const nlohmann::json& c) {
  return test::request_from_call(c, model(c["model"]).string(), /*distilled=*/true);
}

// fp32 on both sides, the same operations: differences are summation order.
constexpr double kEmbedTol = 1e-5;
constexpr double kLatentTol = 1e-4;
constexpr int kMaxLevels = 1;  // 8-bit image against diffusers' float image * 255, rounded

}  // namespace

class TestFluxPipeline : public QObject {
  Q_OBJECT
 private slots:
  void initTestCase() {
    dev_ = pipeline::Flux::load(model("dev"), "cpu");
    schnell_ = pipeline::Flux::load(model("schnell"), "cpu");
  }

  void loadsTheFolders() {
    QVERIFY(dev_->guidance_embedded());
    QVERIFY(!schnell_->guidance_embedded());
    QCOMPARE(dev_->max_sequence_length(), 512);
    QCOMPARE(schnell_->max_sequence_length(), 256);
    QVERIFY(dev_->family() == job::ModelFamily::Flux);
    // The factory picks the family from model_index.json.
    const auto any = pipeline::load_pipeline(model("schnell"), "cpu");
    QVERIFY(any->family() == job::ModelFamily::Flux);
  }

  void cases_data() {
    QTest::addColumn<int>("index");
    const auto c = cases();
    for (std::size_t i = 0; i < c.size(); ++i) QTest::newRow(c[i]["name"].get<std::string>().c_str()) << static_cast<int>(i);
    QCOMPARE(c.size(), std::size_t(3));  // make_flux_fixtures.py's CASES
  }

  void encodesAsDiffusers_data() { cases_data(); }
  void encodesAsDiffusers() {
    QFETCH(int, index);
    const auto c = cases()[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    const auto& e = expected();
    auto& pipe = c["model"] == "dev" ? *dev_ : *schnell_;
    const int batch = c.value("num_images_per_prompt", 1);
    const auto ours = pipe.encode_prompt(c["prompt"], batch);
    DIFFRACT_COMPARE_TENSORS(ours.prompt_embeds, e.at(name + ".prompt_embeds"), kEmbedTol);
    DIFFRACT_COMPARE_TENSORS(ours.pooled, e.at(name + ".pooled"), kEmbedTol);
    qInfo("%s: T5 embeddings max |diff| %.3g, pooled %.3g", name.c_str(),
          test::max_abs_diff(ours.prompt_embeds, e.at(name + ".prompt_embeds")),
          test::max_abs_diff(ours.pooled, e.at(name + ".pooled")));
    if (c.contains("negative_prompt")) {
      const auto neg = pipe.encode_prompt(c["negative_prompt"], batch);
      DIFFRACT_COMPARE_TENSORS(neg.prompt_embeds, e.at(name + ".negative_prompt_embeds"), kEmbedTol);
      DIFFRACT_COMPARE_TENSORS(neg.pooled, e.at(name + ".negative_pooled"), kEmbedTol);
    }
    // A second call comes from the prompt cache, unchanged.
    QVERIFY(at::equal(pipe.encode_prompt(c["prompt"], batch).prompt_embeds, ours.prompt_embeds));
  }

  void matchesDiffusersEndToEnd_data() { cases_data(); }
  void matchesDiffusersEndToEnd() {
    QFETCH(int, index);
    const auto c = cases()[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    const auto& e = expected();
    auto& pipe = c["model"] == "dev" ? *dev_ : *schnell_;
    const auto initial = e.at(name + ".latents.initial");
    // diffusers drew the unpacked latents from the seed as the skeleton does.
    at::Generator gen = at::detail::createCPUGenerator(c["seed"].get<uint64_t>());
    QVERIFY(at::equal(at::randn(initial.sizes(), gen, at::kFloat), initial));

    const auto request = request_for(c);
    const auto result = pipe.generate(request, {}, job::CancelToken{}, initial);
    const auto latents = test::latents_tensor(result);
    const auto expected_latents = e.at(name + ".latents.final");
    DIFFRACT_COMPARE_TENSORS(latents, expected_latents, kLatentTol);
    qInfo("%s: final latents max |diff| %.3g (|latents| up to %.3g)", name.c_str(),
          test::max_abs_diff(latents, expected_latents), expected_latents.abs().max().item<double>());
    // The seed alone gives the same job.
    DIFFRACT_COMPARE_TENSORS(test::latents_tensor(pipe.generate(request, {}, job::CancelToken{})), expected_latents,
                             kLatentTol);

    const auto images = e.at(name + ".image");  // [B, 3, H, W] in [0, 1]
    QCOMPARE(static_cast<int64_t>(result.images.size()), images.size(0));
    for (std::size_t b = 0; b < result.images.size(); ++b) {
      const auto& img = result.images[b];
      auto ours = at::from_blob(const_cast<std::uint8_t*>(img.rgb.data()), {img.height, img.width, 3}, at::kByte).to(at::kInt);
      auto theirs = (images[static_cast<int64_t>(b)].permute({1, 2, 0}) * 255).round().to(at::kInt);
      QCOMPARE(ours.sizes(), theirs.sizes());
      const auto diff = (ours - theirs).abs();
      qInfo("%s[%zu]: image max %d levels", name.c_str(), b, diff.max().item<int>());
      QVERIFY(diff.max().item<int>() <= kMaxLevels);
      QVERIFY(ours.max().item<int>() - ours.min().item<int>() > 20);
    }
    const auto meta = nlohmann::json::parse(result.metadata_json);
    QCOMPARE(meta["family"].get<std::string>(), std::string("flux"));
    QCOMPARE(meta["true_cfg"].get<bool>(), c.contains("negative_prompt"));
    QCOMPARE(meta.contains("mu"), c["model"] == "dev");
    QCOMPARE(result.a1111_parameters.find("Distilled CFG Scale") != std::string::npos, c["model"] == "dev");
  }

  // A CFG scale without a negative prompt is not true CFG: the job runs (and says) CFG 1.
  void cfgNeedsANegativePrompt() {
    auto r = request_for(cases()[0]);
    r.cfg = 7.0;
    const auto with_scale = dev_->generate(r, {}, job::CancelToken{});
    r.cfg = 1.0;
    const auto without = dev_->generate(r, {}, job::CancelToken{});
    QVERIFY(at::equal(test::latents_tensor(with_scale), test::latents_tensor(without)));
    QCOMPARE(nlohmann::json::parse(with_scale.metadata_json)["cfg"].get<double>(), 1.0);
  }

  void refusesWhatDoesNotApply() {
    auto r = request_for(cases()[0]);
    r.sampler = "euler";
    DIFFRACT_EXPECT_ERROR(dev_->generate(r, {}, job::CancelToken{}), "flow-matching model", "flow-euler");
    r = request_for(cases()[0]);
    r.width = 34;
    DIFFRACT_EXPECT_ERROR(dev_->generate(r, {}, job::CancelToken{}), "not a positive multiple of 4", "2x2 patches");
    r = request_for(cases()[0]);
    r.guidance = -1;
    DIFFRACT_EXPECT_ERROR(dev_->generate(r, {}, job::CancelToken{}), "guidance -1 is outside 0..100");
    r = request_for(cases()[0]);
    r.strategy.name = "hybrid-cfg";
    r.strategy.devices = 2;
    DIFFRACT_EXPECT_ERROR(dev_->generate(r, {}, job::CancelToken{}), "hybrid-cfg does not run flux models");
  }

  // The strategies that evaluate whole steps, on CPU virtual devices, against one device.
  void runsStrategies() {
    auto r = request_for(cases()[1]);  // true CFG, batch 2
    r.batch = 1;
    job::CancelToken never;
    const auto base = test::latents_tensor(dev_->generate(r, {}, never));
    int steps = 0;
    job::JobObserver obs;
    obs.on_step = [&](const job::StepEvent&) { ++steps; };
    const auto run = [&](const std::string& name, int devices, int batch = 1) {
      steps = 0;
      return test::strategy_job(*dev_, r, name, devices, batch, 0, obs);
    };
    const auto rel = [&](const at::Tensor& a) { return ((a - base).norm() / base.norm()).item<double>(); };
    DIFFRACT_COMPARE_TENSORS(run("cfg-parallel", 2).first, base, 1e-4);
    QCOMPARE(steps, 3);
    for (const char* mode : {"driffusion", "driffusion-aggressive"}) {
      DIFFRACT_COMPARE_TENSORS(run(mode, 1).first, base, 1e-6);
      const auto out = run(mode, 2).first;
      qInfo("%s n=2: relative L2 to one device %.3g", mode, rel(out));
      QVERIFY(rel(out) > 0 && rel(out) < 0.5);
    }
    auto batch2 = r;
    batch2.batch = 2;
    const auto base2 = test::latents_tensor(dev_->generate(batch2, {}, never));
    DIFFRACT_COMPARE_TENSORS(run("data-parallel", 2, 2).first, base2, 1e-4);
    QVERIFY(rel(run("step-skip", 2).first) > 0);
    test::check_first_block_cache(*dev_, r, base, 3);
    // Ulysses: every device a share of the image tokens, the same job up to rounding, CFG batched.
    const auto [sp, sp_strategy] = run("sequence-parallel", 2);
    DIFFRACT_COMPARE_TENSORS(sp, base, 1e-4);
    qInfo("sequence-parallel n=2: max |diff| to one device %.3g, %lld bytes sent", test::max_abs_diff(sp, base),
          sp_strategy["bytes_sent"].get<long long>());
    QCOMPARE(steps, 3);
    QCOMPARE(sp_strategy["evaluations"].get<int>(), 3);
    // Per step and block the q, k, v and image-output all-to-alls and the text all-gather: more than
    // the latents' worth.
    QVERIFY(sp_strategy["bytes_sent"].get<long long>() > 3 * (int64_t)base.numel() * 4);
    DIFFRACT_COMPARE_TENSORS(run("sequence-parallel", 1).first, base, 1e-6);
    DIFFRACT_COMPARE_TENSORS(run("sequence-parallel", 2, 2).first, base2, 1e-4);
    DIFFRACT_EXPECT_ERROR(run("sequence-parallel", 4), "2 attention heads do not split over 4 devices");
    // PipeFusion: the 5 blocks in stages, the latent's 12 token rows in patches, a step stale.
    const auto [piped, pf_strategy] = test::strategy_job(*dev_, r, "pipefusion", 2, 1, 3, obs);
    qInfo("pipefusion 2x3: relative L2 to one device %.3g", rel(piped));
    QVERIFY(rel(piped) > 0 && rel(piped) < 0.3);
    QCOMPARE(pf_strategy["weights_per_rank"].size(), std::size_t(2));
    const auto [split, split_strategy] = test::strategy_job(*dev_, r, "cfg-pipefusion", 4, 1, 3, obs);
    DIFFRACT_COMPARE_TENSORS(split, piped, 1e-4);
    DIFFRACT_EXPECT_ERROR(test::strategy_job(*dev_, r, "pipefusion", 2, 1, 5, obs), "do not split into 5 equal");
    r.negative_prompt.clear();
    DIFFRACT_EXPECT_ERROR(run("cfg-parallel", 2), "needs classifier-free guidance");
    DIFFRACT_EXPECT_ERROR(run("cfg-pipefusion", 2), "cfg-pipefusion", "needs CFG");
  }

  // T5 placed apart from the model: the same job; placements the machine cannot serve are named.
  void t5PlacementKeepsTheJob() {
    pipeline::Flux::LoadOptions o;
    o.t5_placement = "cpu";
    const auto apart = pipeline::Flux::load(model("dev"), "cpu", o);
    QCOMPARE(apart->t5_placement(), std::string("cpu"));
    const auto r = request_for(cases()[0]);
    const auto a = apart->generate(r, {}, job::CancelToken{});
    QVERIFY(at::equal(test::latents_tensor(a), test::latents_tensor(dev_->generate(r, {}, job::CancelToken{}))));
    QCOMPARE(nlohmann::json::parse(a.metadata_json)["t5_placement"].get<std::string>(), std::string("cpu"));
    o.t5_placement = "offload";
    DIFFRACT_EXPECT_ERROR(pipeline::Flux::load(model("dev"), "cpu", o), "'offload'", "model's GPU", "runs on cpu");
    o.t5_placement = "cuda:7";
    DIFFRACT_EXPECT_ERROR(pipeline::Flux::load(model("dev"), "cpu", o), "T5 placement 'cuda:7'", "use cpu, cuda:N, offload");
    o.t5_placement = "gpu";
    DIFFRACT_EXPECT_ERROR(pipeline::Flux::load(model("dev"), "cpu", o), "T5 placement 'gpu'");
    // The factory passes it on.
    DIFFRACT_EXPECT_ERROR(pipeline::load_pipeline(model("dev"), "cpu", {}, false, "gpu"), "T5 placement 'gpu'");
  }

  void missingComponentIsNamed() {
    for (const char* component : {"text_encoder_2", "vae", "tokenizer_2"}) {
      QTemporaryDir tmp;
      const fs::path copy = fs::path(tmp.path().toStdString()) / "flux";
      fs::copy(model("dev"), copy, fs::copy_options::recursive);
      fs::remove_all(copy / component);
      DIFFRACT_EXPECT_ERROR(pipeline::Flux::load(copy, "cpu"), component);
    }
  }

 private:
  std::unique_ptr<pipeline::Flux> dev_, schnell_;
};

QTEST_GUILESS_MAIN(TestFluxPipeline)
#include "test_flux_pipeline.moc"
