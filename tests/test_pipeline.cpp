#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <fstream>
#include <limits>
#include <random>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/engine/engine.h"
#include "core/io/weights.h"
#include "core/util/error.h"
#include "cancel_storm.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

// diffusers' float image (x * 255, rounded) against our 8-bit image. Euler, Euler ancestral
// and DPM++ runs come out bit-identical; DDIM and DDPM work their coefficients out in double
// where diffusers uses float32, which moves a few pixels by one level.
constexpr int kMaxLevels = 1;
constexpr double kMaxMeanLevels = 0.05;

// A job on a fixture's model (the tiny SD folder unless named), the rest left at the defaults.
job::GenerationRequest fixture_request(const std::string& prompt, int steps, const std::string& model = "tiny-sd") {
  job::GenerationRequest r;
  r.model = (test::fixtures() / model).string();
  r.prompt = prompt;
  r.steps = steps;
  return r;
}

job::GenerationRequest request_for(const nlohmann::json& c, const std::string& model) {
  job::GenerationRequest r;
  r.model = (test::fixtures() / model).string();
  r.prompt = c["prompt"];
  r.negative_prompt = c["negative_prompt"];
  r.steps = c["num_inference_steps"];
  r.cfg = c["guidance_scale"];
  r.width = c["width"];
  r.height = c["height"];
  r.seed = c["seed"];
  r.sampler = c["sampler"];
  r.batch = c.value("num_images_per_prompt", 1);
  r.preview_every = 0;
  return r;
}

}  // namespace

class TestPipeline : public QObject {
  Q_OBJECT
 private slots:
  void seedGivesDiffusersNoise() {
    auto e = io::load_state_dict(test::fixtures() / "pipeline_cases.safetensors");
    at::Generator gen = at::detail::createCPUGenerator(42);
    QVERIFY(at::equal(at::randn({1, 4, 8, 8}, gen, at::kFloat), e.at("randn.seed42")));
  }

  void matchesDiffusersEndToEnd_data() {
    QTest::addColumn<int>("index");
    std::ifstream in(test::fixtures() / "pipeline_cases.json");
    const auto cases = nlohmann::json::parse(in);
    for (std::size_t i = 0; i < cases.size(); ++i)
      QTest::newRow(cases[i]["name"].get<std::string>().c_str()) << static_cast<int>(i);
    // After the rows, so that a cut-short list still runs the cases it has. make_pipeline_cases writes
    // SD with each of 6 samplers and 2 more, 3 SDXL runs and 2 of an SDXL that encodes an empty negative.
    QCOMPARE(cases.size(), std::size_t(13));
  }

  void matchesDiffusersEndToEnd() {
    QFETCH(int, index);
    std::ifstream in(test::fixtures() / "pipeline_cases.json");
    const auto c = nlohmann::json::parse(in)[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    const auto expected = io::load_state_dict(test::fixtures() / "pipeline_cases.safetensors").at(name);
    auto request = request_for(c, c["model"].get<std::string>());
    job::CancelToken never;
    const auto result = engine_.run(request, {}, never);
    QCOMPARE(static_cast<int64_t>(result.images.size()), expected.size(0));
    for (std::size_t b = 0; b < result.images.size(); ++b) {
      const auto& img = result.images[b];
      auto ours = at::from_blob(const_cast<std::uint8_t*>(img.rgb.data()), {img.height, img.width, 3}, at::kByte).to(at::kInt);
      auto theirs = (expected[static_cast<int64_t>(b)] * 255).round().to(at::kInt);
      QCOMPARE(ours.sizes(), theirs.sizes());
      const auto diff = (ours - theirs).abs();
      qInfo("%s: max %d levels, mean %.4f", name.c_str(), diff.max().item<int>(), diff.to(at::kFloat).mean().item<float>());
      QVERIFY2(diff.max().item<int>() <= kMaxLevels && diff.to(at::kFloat).mean().item<float>() <= kMaxMeanLevels,
               qPrintable(QString("%1: max diff %2 levels, mean %3").arg(name.c_str()).arg(diff.max().item<int>())
                              .arg(diff.to(at::kFloat).mean().item<float>())));
    }
    QCOMPARE(result.request.sampler, c["sampler"].get<std::string>());
    // Zeros or an encoded empty prompt for the negative branch, as diffusers chose for this model.
    QCOMPARE(nlohmann::json::parse(result.metadata_json)["negative_conditioning"].get<std::string>(),
             c["negative_conditioning"].get<std::string>());
    QVERIFY(result.a1111_parameters.find("Seed: " + std::to_string(request.seed)) != std::string::npos);
    QCOMPARE(static_cast<int>(result.timings.step_ms.size()), request.steps);
  }

  void singleFileGivesTheFolderImage() {
    for (const char* name : {"tiny-sd", "tiny-sdxl"}) {
      job::GenerationRequest folder;
      folder.model = (test::fixtures() / name).string();
      folder.prompt = "a glass bottle of perfume on white";
      folder.steps = 3;
      folder.seed = 9;
      folder.preview_every = 0;
      auto single = folder;
      single.model = (test::fixtures() / "single_file" / (std::string(name) + ".safetensors")).string();
      single.model_config = folder.model;  // tiny models break the families' head-count conventions
      job::CancelToken never;
      const auto a = engine_.run(folder, {}, never);
      const auto b = engine_.run(single, {}, never);
      QVERIFY2(a.images.front().rgb == b.images.front().rgb, name);
      QCOMPARE(b.family, a.family);
    }
  }

  void streamsEventsAndPreviews() {
    auto r = fixture_request("a cat", 4);
    r.width = r.height = 64;
    r.preview_every = 2;
    std::vector<int> steps, previews;
    std::vector<std::string> stages;
    job::JobObserver o;
    o.on_step = [&](const job::StepEvent& e) { steps.push_back(e.index); };
    o.on_preview = [&](const job::PreviewEvent& e) {
      previews.push_back(e.index);
      QCOMPARE(e.image.rgb.size(), std::size_t(e.image.width) * e.image.height * 3);
    };
    o.on_stage = [&](const std::string& s, double) { stages.push_back(s); };
    job::CancelToken never;
    const auto result = engine_.run(r, o, never);
    QCOMPARE(steps, (std::vector<int>{0, 1, 2, 3}));
    QCOMPARE(previews, (std::vector<int>{1, 3}));
    QCOMPARE(stages, (std::vector<std::string>{"tokenize", "text_encode", "vae_decode", "total"}));
    const auto meta = nlohmann::json::parse(result.metadata_json);
    QCOMPARE(meta["timings_ms"]["steps"].size(), std::size_t(4));
    QCOMPARE(meta["sampler"].get<std::string>(), std::string("euler"));  // the model's own scheduler
  }

  void previewsThroughTAESD() {
    auto r = fixture_request("a cat", 2);
    r.taesd = (test::fixtures() / "vae" / "tiny4").string();  // a 4-channel AutoencoderTiny from the VAE oracle
    r.width = 64;
    r.height = 48;
    r.preview_max_side = 0;  // full size
    std::vector<std::pair<int, int>> sizes;
    job::JobObserver o;
    o.on_preview = [&](const job::PreviewEvent& e) { sizes.emplace_back(e.image.width, e.image.height); };
    job::CancelToken never;
    engine_.run(r, o, never);
    // TAESD decodes to full resolution (its 8x upscale of the tiny model's 32x24 latents), where
    // the latent projection would give 32x24.
    QCOMPARE(sizes.size(), std::size_t(2));
    QCOMPARE(sizes.front(), std::make_pair(256, 192));
    // Larger than preview_max_side (in image pixels, 64 here): the latents are averaged down first.
    sizes.clear();
    r.preview_max_side = 32;
    engine_.run(r, o, never);
    QCOMPARE(sizes.front(), std::make_pair(128, 96));
    r.preview_max_side = -2;
    DIFFRACT_EXPECT_ERROR(engine_.run(r, o, never), "preview size -2 must be -1 (auto");
    // Auto (the default): half the image's longer side, at most 512.
    sizes.clear();
    r.preview_max_side = -1;
    QCOMPARE(r.preview_side(), 32);
    engine_.run(r, o, never);
    QCOMPARE(sizes.front(), std::make_pair(128, 96));
    r.width = 1536;
    QCOMPARE(r.preview_side(), 512);
    r.width = 64;
    r.preview_max_side = 512;
    r.taesd = (test::fixtures() / "nowhere").string();
    DIFFRACT_EXPECT_ERROR(engine_.run(r, o, never), "nowhere");
  }

  void cancelsPromptlyAndStaysUsable() {
    auto r = fixture_request("a cat", 50);
    r.width = r.height = 64;
    r.preview_every = 0;
    job::CancelToken token;
    int seen = 0;
    job::JobObserver o;
    o.on_step = [&](const job::StepEvent& e) {
      seen = e.index + 1;
      if (e.index == 2) token.cancel();
    };
    bool cancelled = false;
    try {
      engine_.run(r, o, token);
    } catch (const job::Cancelled&) {
      cancelled = true;
    }
    QVERIFY(cancelled);
    QCOMPARE(seen, 3);  // stopped before the 4th step
    r.steps = 2;
    job::CancelToken fresh;
    QCOMPARE(engine_.run(r, {}, fresh).images.size(), std::size_t(1));
  }

  // A cancel inside one long step lands within a block: the embedded model at 2048² on the CPU
  // (a step there takes seconds; its blocks a fraction of one), cancelled a second into the
  // first step, ends well before that step would have; the decode at that size stops likewise.
  void cancelLandsInsideALongStep() {
    job::GenerationRequest r;
    r.model = test::emoji_model().string();
    r.prompt = "a red apple";
    r.steps = 2;
    r.width = r.height = 2048;
    r.preview_every = 0;
    engine_.run([&] {  // loads the model first, so that the cancel falls inside the step
      auto small = r;
      small.width = small.height = 128;
      return small;
    }(), {}, job::CancelToken{});
    for (const bool in_decode : {false, true}) {
      job::CancelToken token;
      std::atomic<int> steps{0};
      std::chrono::steady_clock::time_point cancelled_at{};
      job::JobObserver o;
      o.on_step = [&](const job::StepEvent&) { ++steps; };
      std::thread canceller([&] {
        // In the decode: after both steps have reported; else a second into the first step.
        if (in_decode) {
          while (steps < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          std::this_thread::sleep_for(std::chrono::milliseconds(1000));
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(1000));
        }
        cancelled_at = std::chrono::steady_clock::now();
        token.cancel();
      });
      const auto start = std::chrono::steady_clock::now();
      bool cancelled = false;
      try {
        engine_.run(r, o, token);
      } catch (const job::Cancelled&) {
        cancelled = true;
      }
      const auto end = std::chrono::steady_clock::now();
      canceller.join();
      const double after_ms = std::chrono::duration<double, std::milli>(end - cancelled_at).count();
      qInfo("2048² %s: cancelled %.0f ms into the job, ended %.0f ms after the cancel (steps done: %d)",
            in_decode ? "decode" : "step", std::chrono::duration<double, std::milli>(cancelled_at - start).count(),
            after_ms, steps.load());
      QVERIFY(cancelled);
      QCOMPARE(steps.load(), in_decode ? 2 : 0);
      QVERIFY2(after_ms < 1500, qPrintable(QString("ended %1 ms after the cancel").arg(after_ms)));
    }
  }

  // Cancel at any moment, 200 times in a row (during the load, text encoding, a step, a preview,
  // the decode, or after the end): every job ends, cancelled or done, none fails, the engine
  // runs the next, and the process's memory stays where it was after the first 20.
  void cancelAtAnyMomentTwoHundredTimes() {
    auto r = fixture_request("a red apple", 4);
    r.width = r.height = 32;
    r.preview_every = 1;
    engine::Engine engine;
    std::mt19937 rng(7);
    std::int64_t settled = 0;
    const auto storm = test::cancel_storm(
        engine, 200, [&](int) { return r; },
        // Mostly early (inside the job), every fourth late enough for some jobs to have finished.
        [&](int i) { return std::chrono::microseconds(rng() % (i == 0 ? 400000 : i % 4 ? 40000 : 400000)); },
        [&](int i) {
          if (i == 19) settled = test::process_memory_bytes();
        });
    QVERIFY2(!storm.hung, "a cancelled job had not ended a minute later");
    QVERIFY2(storm.errors.empty(), storm.errors.empty() ? "" : storm.errors.front().c_str());
    const auto growth = test::process_memory_bytes() - settled;
    qInfo("cancelled %d, finished %d; %s after 20 jobs %.1f MB, after 200 %+.1f MB", storm.cancelled, storm.finished,
#if defined(__SANITIZE_ADDRESS__)
          "allocated",
#else
          "RSS",
#endif
          settled / 1e6, growth / 1e6);
    QVERIFY(storm.cancelled > 0);
    QVERIFY2(growth < (std::int64_t(64) << 20), "memory grows with cancelled jobs");
  }

  void workerThreadReportsOutcomes() {
    auto good = fixture_request("a cat", 2);
    good.width = good.height = 64;
    auto bad = good;
    bad.sampler = "heun";
    std::atomic<int> done{0}, errors{0};
    std::string message;
    job::JobObserver o;
    o.on_done = [&](const job::GenerationResult&) { ++done; };
    o.on_error = [&](const std::string& m) {
      message = m;
      ++errors;
    };
    engine::Engine engine;
    engine.submit(bad, o);
    engine.submit(good, o);
    QTRY_COMPARE_WITH_TIMEOUT(done.load() + errors.load(), 2, 60000);
    QCOMPARE(errors.load(), 1);
    QVERIFY2(message.find("unknown sampler 'heun'") != std::string::npos, message.c_str());
  }

  void rejectsBadRequests() {
    auto r = fixture_request("x", 2);
    job::CancelToken never;
    auto expect = [&](job::GenerationRequest req, const char* fragment) {
      DIFFRACT_EXPECT_ERROR(engine_.run(req, {}, never), fragment);
    };
    auto q = r;
    q.sampler = "heun";
    expect(q, "unknown sampler 'heun'");
    q = r;
    q.width = 61;  // the tiny VAE's latent factor is 2
    expect(q, "size 61x32 is not a positive multiple of 2");
    q = r;
    q.steps = 0;
    expect(q, "steps 0 must be between 1 and the model's 1000");
    q = r;
    q.steps = 1001;
    expect(q, "steps 1001");
    q = r;
    q.cfg = -1;
    expect(q, "CFG scale -1 must be a number from 0 to 1000");
    q.cfg = std::numeric_limits<double>::infinity();  // the user's value, not blamed on the weights
    expect(q, "CFG scale inf must be a number from 0 to 1000");
    q.cfg = std::nan("");
    expect(q, "must be a number from 0 to 1000");
    q = r;
    q.device = "tpu:0";
    expect(q, "device 'tpu:0'");
    q = r;
    q.model = (test::fixtures() / "nowhere").string();
    expect(q, "no such file or folder");

    QTemporaryDir tmp;
    const fs::path dir = fs::path(tmp.path().toStdString()) / "no-unet";
    fs::copy(test::fixtures() / "tiny-sd", dir, fs::copy_options::recursive);
    fs::remove_all(dir / "unet");
    q = r;
    q.model = dir.string();
    expect(q, "component 'unet' is unusable");
  }

  // A rank of a multi-device strategy running out of memory (LibTorch's error thrown where the
  // rank reports a step): the same error as one device's, naming that rank's device, and the
  // engine runs the next job.
  void outOfMemoryOnARankNamesItsDevice() {
    auto r = fixture_request("x", 4);
    r.cfg = 5;
    r.strategy.name = "cfg-parallel";
    r.strategy.devices = 2;
    job::CancelToken never;
    job::JobObserver o;
    int steps = 0;
    o.on_step = [&](const job::StepEvent&) {
      if (++steps == 2) TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 GiB");
    };
    try {
      engine_.run(r, o, never);
      QFAIL("expected an out-of-memory error");
    } catch (const Error& e) {
      const std::string msg = e.what();
      qInfo("%s", msg.c_str());
      QVERIFY2(msg.rfind("out of memory on cpu:virtual 0 (after ", 0) == 0, msg.c_str());
      QVERIFY2(msg.find(", 2 steps done; native size, batch 1, cfg-parallel): CUDA out of memory. Tried to allocate "
                        "2.00 GiB. What the job held is freed") != std::string::npos,
               msg.c_str());
      QVERIFY2(msg.find("Exception raised from") == std::string::npos, msg.c_str());
    }
    const auto next = engine_.run(r, {}, never);
    QCOMPARE(next.images.size(), std::size_t{1});
  }

  // The CPU allocator refusing memory mid-job (a real refusal: a petabyte asked where a step is
  // reported) is the pipeline's out-of-memory error naming the CPU, not an internal error with
  // LibTorch's backtrace.
  void outOfHostMemoryNamesTheCpu() {
    auto r = fixture_request("x", 3);
    job::CancelToken never;
    job::JobObserver o;
    o.on_step = [](const job::StepEvent& e) {
      if (e.index == 1) (void)at::empty({std::int64_t(1) << 50}, at::kByte);
    };
    DIFFRACT_EXPECT_ERROR(engine_.run(r, o, never), "out of memory on cpu (after text_encode, ",
                          "; native size, batch 1): DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                          "1125899906842624 bytes");
    QCOMPARE(engine_.run(r, {}, never).images.size(), std::size_t{1});
  }

  void reportsNaNsInsteadOfABlackImage() {
    auto r = fixture_request("x", 2, "tiny-sd-nan");  // the oracle poisons conv_out.bias
    r.width = r.height = 64;
    job::CancelToken never;
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "NaN or Inf after step 1");
  }

 private:
  engine::Engine engine_;
};

QTEST_GUILESS_MAIN(TestPipeline)
#include "test_pipeline.moc"
