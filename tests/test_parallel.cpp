#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>

#include "core/models/unets/unet_2d_condition.h"
#include "core/parallel/communicator.h"
#include "core/parallel/device_group.h"
#include "core/parallel/strategies.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
using namespace diffract::parallel;

namespace {

// Counts evaluations; optionally fails on one rank.
class Counting final : public Denoiser {
 public:
  Counting(std::unique_ptr<Denoiser> inner, std::atomic<int>& count, bool fail)
      : inner_(std::move(inner)), count_(count), fail_(fail) {}
  at::Tensor eval(const at::Tensor& x, double t, Branch b) override {
    ++count_;
    if (fail_) throw Error("simulated device failure");
    return inner_->eval(x, t, b);
  }
  bool cfg() const override { return inner_->cfg(); }
  double guidance_scale() const override { return inner_->guidance_scale(); }
  std::int64_t batch() const override { return inner_->batch(); }
  at::ScalarType output_dtype() const override { return inner_->output_dtype(); }
  std::unique_ptr<Denoiser> rows(std::int64_t b, std::int64_t n) const override {
    return std::make_unique<Counting>(inner_->rows(b, n), count_, fail_);
  }

 private:
  std::unique_ptr<Denoiser> inner_;
  std::atomic<int>& count_;
  bool fail_;
};

}  // namespace

class TestParallel : public QObject {
  Q_OBJECT

  models::UNet2DConditionModel unet_{nullptr};
  std::atomic<int> evals_{0};
  int fail_rank_ = -1;

  LoopInputs inputs(schedulers::SamplerKind kind, int steps, int batch, double cfg, std::uint64_t seed = 7) {
    at::Generator g = at::detail::createCPUGenerator(seed);
    const auto& c = unet_->config;
    const int64_t ctx = c.cross_attention_dim.front();
    models::UNetConditioning pos, neg;
    pos.encoder_hidden_states = at::randn({batch, 5, ctx}, g);
    neg.encoder_hidden_states = at::randn({batch, 5, ctx}, g);
    LoopInputs in;
    in.kind = kind;
    in.config = schedulers::SchedulerConfig::from_json(test::fixtures() / "tiny-sd" / "scheduler" / "scheduler_config.json", kind);
    in.steps = steps;
    auto sampler = schedulers::Sampler::create(kind, in.config, steps);
    in.latents = at::randn({batch, c.in_channels, c.sample_size, c.sample_size}, g) * sampler->init_noise_sigma();
    in.generator = g;
    auto unet = std::make_shared<models::UNetGraphRunner>(unet_);
    in.make_denoiser = [this, unet, pos, neg, cfg](int rank, const c10::Device& d) -> std::unique_ptr<Denoiser> {
      return std::make_unique<Counting>(std::make_unique<UNetDenoiser>(unet, pos, neg, cfg, at::kFloat, d), evals_,
                                        rank == fail_rank_);
    };
    return in;
  }

  LoopOutput run(const Strategy& s, const LoopInputs& in) {
    evals_ = 0;
    auto group = DeviceGroup::virtual_cpu(s.devices());
    return s.run(*group, in);
  }

 private slots:
  void initTestCase() {
    unet_ = models::load_unet_2d_condition(test::fixtures() / "tiny-sd" / "unet");
    unet_->eval();
  }

  void communicatorCollectives() {
    for (int n : {2, 4}) {
      auto comms = make_in_process_group(n);
      std::vector<std::thread> ts;
      std::vector<int> ok(static_cast<std::size_t>(n), 0);
      for (int r = 0; r < n; ++r)
        ts.emplace_back([&, r] {
          auto& c = *comms[static_cast<std::size_t>(r)];
          bool good = true;
          for (int round = 0; round < 20; ++round) {  // reuse of the rendezvous
            auto all = c.all_gather(at::full({2}, r * 100 + round, at::kFloat));
            for (int q = 0; q < n; ++q) good &= all[static_cast<std::size_t>(q)][1].item<float>() == q * 100 + round;
          }
          good &= c.broadcast(at::full({1}, r, at::kFloat), n - 1).item<float>() == n - 1;
          c.send(at::full({3}, r, at::kFloat), (r + 1) % n);
          at::Tensor got = at::empty({3}, at::kFloat);
          c.recv(got, (r + n - 1) % n);
          good &= got[0].item<float>() == (r + n - 1) % n;
          c.barrier();
          ok[static_cast<std::size_t>(r)] = good;
        });
      for (auto& t : ts) t.join();
      for (int v : ok) QVERIFY(v);
    }
  }

  void failureAbortsAllRanks() {
    auto group = DeviceGroup::virtual_cpu(3);
    std::atomic<int> released{0};
    DIFFRACT_EXPECT_ERROR(group->run([&](int rank, Communicator& c) {
      if (rank == 1) throw Error("out of memory");
      try {
        c.all_gather(at::ones({1}));
      } catch (const Aborted&) {
        ++released;
        throw;
      }
    }), "device 1 (cpu:virtual 1): out of memory");
    QCOMPARE(released.load(), 2);
    // The group stays usable.
    std::atomic<int> ran{0};
    group->run([&](int, Communicator& c) {
      c.barrier();
      ++ran;
    });
    QCOMPARE(ran.load(), 3);
  }

  void strategyFailureIsOneError() {
    fail_rank_ = 1;
    auto in = inputs(schedulers::SamplerKind::Euler, 3, 1, 5.0);
    DIFFRACT_EXPECT_ERROR(run(CfgParallel{}, in), "device 1", "simulated device failure");
    fail_rank_ = -1;
    DIFFRACT_EXPECT_ERROR(run(CfgParallel{}, inputs(schedulers::SamplerKind::Euler, 3, 1, 1.0)), "needs classifier-free");
  }

  void cfgParallelEqualsOneDevice() {
    for (auto kind : {schedulers::SamplerKind::Euler, schedulers::SamplerKind::DPMPP2M}) {
      auto in = inputs(kind, 6, 1, 5.0);
      const auto base = run(SingleDevice{}, in);
      const auto par = run(CfgParallel{}, in);
      DIFFRACT_COMPARE_TENSORS(par.latents, base.latents, 1e-4);
      QCOMPARE(par.stats.rounds, 6);
      QCOMPARE(par.stats.evaluations, 12);  // one branch per device per step
      QCOMPARE(static_cast<int>(par.stats.rel_mae.size()), 6);
      QVERIFY(par.stats.rel_mae[0] > 0);
      QVERIFY(par.stats.bytes_sent > 0);
    }
  }

  void driffusionOneDeviceEqualsBaseline() {
    for (auto kind : {schedulers::SamplerKind::Euler, schedulers::SamplerKind::DDIM, schedulers::SamplerKind::DPMPP2M}) {
      for (double cfg : {1.0, 5.0}) {
        auto in = inputs(kind, 7, 1, cfg);
        const auto base = run(SingleDevice{}, in);
        for (auto mode : {DRiffusion::Mode::Aggressive, DRiffusion::Mode::Conservative}) {
          DRiffusion d;
          d.n = 1;
          d.mode = mode;
          const auto out = run(d, in);
          QVERIFY2(at::equal(out.latents, base.latents), qPrintable(QString::fromStdString(d.name())));
          QCOMPARE(out.stats.rounds, 7);
        }
      }
    }
  }

  void driffusionRoundsMatchFormulas() {
    const int steps = 10;
    for (int n : {2, 4}) {
      for (auto mode : {DRiffusion::Mode::Aggressive, DRiffusion::Mode::Conservative}) {
        DRiffusion d;
        d.n = n;
        d.mode = mode;
        auto in = inputs(schedulers::SamplerKind::Euler, steps, 1, 4.0);
        std::vector<int> reported;
        in.on_step = [&](int i, const at::Tensor&, const at::Tensor&, const at::Tensor&) { reported.push_back(i); };
        const auto out = run(d, in);
        const int expected = mode == DRiffusion::Mode::Aggressive ? 1 + (steps - 1 + n - 1) / n
                                                                  : 2 * (steps / (n + 1)) + (steps % (n + 1) == 0 ? 0 : steps % (n + 1) == 1 ? 1 : 2);
        QCOMPARE(DRiffusion::expected_rounds(mode, steps, n), expected);
        QCOMPARE(out.stats.rounds, expected);
        QCOMPARE(out.stats.evaluations, steps);  // every step's output is evaluated exactly once
        QCOMPARE(evals_.load(), steps);
        QCOMPARE(static_cast<int>(reported.size()), steps);
        for (int i = 0; i < steps; ++i) QCOMPARE(reported[static_cast<std::size_t>(i)], i);
        QVERIFY(at::isfinite(out.latents).all().item<bool>());
        // Drafts change the trajectory a little, not wholesale.
        const auto base = run(SingleDevice{}, in).latents;
        const double rel = ((out.latents - base).norm() / base.norm()).item<double>();
        qInfo("%s n=%d: relative L2 to one device %.10g", d.name().c_str(), n, rel);
        QVERIFY(rel > 0 && rel < 0.5);
      }
    }
    // Asymptotic latencies: 1/n and 2/(n+1).
    QCOMPARE(DRiffusion::expected_rounds(DRiffusion::Mode::Aggressive, 401, 4), 101);
    QCOMPARE(DRiffusion::expected_rounds(DRiffusion::Mode::Conservative, 500, 4), 200);
  }

  void hybridSwitchingRule() {
    // Falls by 0.05 a step until step 8, flat at 0.5 (slope 0) from step 9, then rises gently.
    std::vector<double> r;
    for (int t = 0; t < 30; ++t) r.push_back(t < 9 ? 1.0 - 0.05 * t : t < 20 ? 0.5 : 0.5 + 1e-4 * (t - 19));
    auto w = hybrid_cfg_window(r, 4, 4e-4, 15, 5);
    // The first window wholly in the flat part is [9, 12]: tau1 = 12.
    QCOMPARE(w.tau1, 12);
    QCOMPARE(w.tau2, 17);
    QVERIFY(std::isnan(w.slopes[2]));
    QVERIFY(std::abs(w.slopes[3] + 0.05) < 1e-12);
    QVERIFY(w.slopes[11] < 0);
    // The cap wins when the curve flattens late.
    w = hybrid_cfg_window(r, 4, 4e-4, 10, 5);
    QCOMPARE(w.tau1, 10);
    QCOMPARE(w.tau2, 15);
    // A rising slope at or above eps does not count; one just below does.
    std::vector<double> up;
    for (int t = 0; t < 20; ++t) up.push_back(t * 1e-3);
    QCOMPARE(hybrid_cfg_window(up, 12, 4e-4, 15, 5).tau1, 15);
    up.assign(20, 0);
    for (int t = 0; t < 20; ++t) up[static_cast<std::size_t>(t)] = t * 3e-4;
    QCOMPARE(hybrid_cfg_window(up, 12, 4e-4, 15, 5).tau1, 11);  // first full window
    // Online: the prefix decides.
    const std::vector<double> prefix(r.begin(), r.begin() + 13);
    QCOMPARE(hybrid_cfg_window(prefix, 4, 4e-4, 15, 5).tau1, 12);
    // The strategy reports the curve and the window.
    HybridCfg h;
    h.L = 3;
    const auto out = run(h, inputs(schedulers::SamplerKind::Euler, 5, 1, 5.0));
    QCOMPARE(static_cast<int>(out.stats.rel_mae.size()), 5);
    const auto expect = hybrid_cfg_window(out.stats.rel_mae, 3, 4e-4, 15, 5);
    QCOMPARE(out.stats.tau1, expect.tau1);
    QCOMPARE(out.stats.tau2, expect.tau2);
  }

  void dataParallelEqualsOneDevice() {
    for (int n : {2, 4}) {
      for (double cfg : {1.0, 5.0}) {
        auto in = inputs(schedulers::SamplerKind::Euler, 4, 5, cfg);
        const auto base = run(SingleDevice{}, in);
        DataParallel dp;
        dp.n = n;
        const auto out = run(dp, in);
        DIFFRACT_COMPARE_TENSORS(out.latents, base.latents, 1e-4);
        QCOMPARE(out.stats.evaluations, 4 * n);
      }
    }
    DataParallel dp;
    dp.n = 4;
    DIFFRACT_EXPECT_ERROR(run(dp, inputs(schedulers::SamplerKind::Euler, 2, 3, 1.0)), "batch of at least 4");
  }

  void stepSkipping() {
    auto in = inputs(schedulers::SamplerKind::DDIM, 9, 1, 3.0);
    const auto base = run(SingleDevice{}, in);
    StepSkipping one;
    one.skip = 1;
    QVERIFY(at::equal(run(one, in).latents, base.latents));
    StepSkipping s;
    s.skip = 2;
    const auto out = run(s, in);
    QCOMPARE(out.stats.rounds, 5);
    QVERIFY(at::isfinite(out.latents).all().item<bool>());
    QVERIFY(!at::equal(out.latents, base.latents));
  }

  // The pipeline's loop hook: the strategy path equals the built-in loop, and reports its stats.
  void pipelineRunsStrategies() {
    for (const char* model : {"tiny-sd", "tiny-sdxl"}) {
      auto sd = pipeline::StableDiffusion::load(test::fixtures() / model, "cpu");
      engine::GenerationRequest req;
      req.prompt = "a red apple";
      req.negative_prompt = "blurry";
      req.steps = 4;
      req.cfg = 5.0;
      req.seed = 3;
      req.sampler = "euler";
      req.preview_every = 2;
      engine::CancelToken never;
      int previews = 0, steps = 0;
      engine::JobObserver obs;
      obs.on_preview = [&](const engine::PreviewEvent&) { ++previews; };
      obs.on_step = [&](const engine::StepEvent&) { ++steps; };
      const auto base = sd->generate(req, {}, never);
      const auto same = sd->generate(req, obs, never, make_strategy("single", 1).get());
      QCOMPARE(previews, 2);
      QCOMPARE(steps, 4);
      QVERIFY(same.images.front().rgb == base.images.front().rgb);
      QCOMPARE(static_cast<int>(same.timings.step_ms.size()), 4);
      const auto par = sd->generate(req, {}, never, make_strategy("cfg-parallel", 2).get());
      const auto& a = par.images.front().rgb;
      const auto& b = base.images.front().rgb;
      int worst = 0;
      for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(int(a[i]) - int(b[i])));
      QVERIFY2(worst <= 1, qPrintable(QString("%1: cfg-parallel differs by %2 levels").arg(model).arg(worst)));
      QVERIFY(par.metadata_json.find("\"strategy\":{") != std::string::npos);
      QVERIFY(par.metadata_json.find("\"rel_mae\"") != std::string::npos);
    }
  }

  void cancellationStopsAllRanks() {
    engine::CancelToken token;
    auto in = inputs(schedulers::SamplerKind::Euler, 6, 1, 5.0);
    in.cancel = &token;
    in.on_step = [&](int i, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
      if (i == 1) token.cancel();
    };
    DRiffusion d;
    d.n = 2;
    bool cancelled = false;
    try {
      run(d, in);
    } catch (const engine::Cancelled&) {
      cancelled = true;
    }
    QVERIFY(cancelled);
  }

  // What each strategy evaluates before its loop (GPU ranks capture their graphs there): the
  // shapes and branches run() will use, nothing else.
  void warmEvaluatesTheLoopShapes() {
    struct Recording final : Denoiser {
      std::vector<std::pair<std::int64_t, Branch>>* log;
      explicit Recording(std::vector<std::pair<std::int64_t, Branch>>* l) : log(l) {}
      at::Tensor eval(const at::Tensor& x, double, Branch b) override {
        log->emplace_back(x.size(0), b);
        return x;
      }
      bool cfg() const override { return true; }
      double guidance_scale() const override { return 5; }
      std::int64_t batch() const override { return 5; }
      at::ScalarType output_dtype() const override { return at::kFloat; }
      std::unique_ptr<Denoiser> rows(std::int64_t, std::int64_t) const override { return std::make_unique<Recording>(log); }
    };
    const auto x = at::zeros({5, 4, 8, 8});
    auto warm = [&](const std::string& name, int n) {
      std::vector<std::pair<std::int64_t, Branch>> log;
      Recording d(&log);
      make_strategy(name, n)->warm(d, x, 999);
      return log;
    };
    using L = std::vector<std::pair<std::int64_t, Branch>>;
    QVERIFY(warm("cfg-parallel", 2) == (L{{5, Branch::Cond}}));
    QVERIFY(warm("hybrid-cfg", 2) == (L{{5, Branch::Cond}}));
    QVERIFY(warm("driffusion-aggressive", 2) == (L{{5, Branch::Guided}}));
    QVERIFY(warm("single", 1) == (L{{5, Branch::Guided}}));
    QVERIFY(warm("data-parallel", 2) == (L{{2, Branch::Guided}, {3, Branch::Guided}}));  // 5 rows: 3 + 2
    QVERIFY(warm("data-parallel", 5) == (L{{1, Branch::Guided}}));
  }

  void strategyFactoryAndDeviceChecks() {
    QCOMPARE(make_strategy("driffusion-aggressive", 4)->devices(), 4);
    QCOMPARE(make_strategy("cfg-parallel", 4)->devices(), 2);
    DIFFRACT_EXPECT_ERROR(make_strategy("pipefusion", 2), "unknown strategy");
    auto group = DeviceGroup::virtual_cpu(3);
    DIFFRACT_EXPECT_ERROR(CfgParallel{}.run(*group, inputs(schedulers::SamplerKind::Euler, 2, 1, 5.0)), "needs 2 device");
    DIFFRACT_EXPECT_ERROR(DeviceGroup::parse("cuda:0,gpu1"), "'gpu1' is not cuda:N");
    DIFFRACT_EXPECT_ERROR(DeviceGroup::parse("cuda:0,cuda:x"), "'cuda:x' is not cuda:N");
    DIFFRACT_EXPECT_ERROR(DeviceGroup::parse("cuda:99"), "cuda:99 does not exist");
    DIFFRACT_EXPECT_ERROR(DeviceGroup::parse("tpu:0"), "is not 'virtual:N'");
    QCOMPARE(DeviceGroup::parse("virtual:4")->size(), 4);
  }
};

QTEST_APPLESS_MAIN(TestParallel)
#include "test_parallel.moc"
