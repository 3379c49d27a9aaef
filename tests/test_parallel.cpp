#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>
#include <tuple>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/models/common/layers.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/parallel/asyncdiff.h"
#include "core/parallel/communicator.h"
#include "core/parallel/device_group.h"
#include "core/parallel/pipefusion.h"
#include "core/parallel/strategies.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/util/error.h"
#include "test_util.h"
#include "loop_inputs.h"

using namespace diffract;
using namespace diffract::parallel;

namespace {

// Counts evaluations; optionally fails on one rank.
class Counting final : public Denoiser {
 public:
  using StageHook = std::function<void(int begin, double t)>;
  Counting(std::unique_ptr<Denoiser> inner, std::atomic<int>& count, bool fail, StageHook on_stage = {})
      : inner_(std::move(inner)), count_(count), fail_(fail), on_stage_(std::move(on_stage)) {}
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
    return std::make_unique<Counting>(inner_->rows(b, n), count_, fail_, on_stage_);
  }
  int splits() const override { return inner_->splits(); }
  models::UNetOuterState outer_down(const at::Tensor& x, double t, Branch b, int split) override {
    return inner_->outer_down(x, t, b, split);
  }
  at::Tensor inner(const at::Tensor& h, double t, Branch b, int split) override { return inner_->inner(h, t, b, split); }
  at::Tensor outer_up(models::UNetOuterState st, const at::Tensor& in, Branch b, int split) override {
    return inner_->outer_up(std::move(st), in, b, split);
  }
  std::vector<models::UNetLayerInfo> stage_layers(std::int64_t h, std::int64_t w) const override {
    return inner_->stage_layers(h, w);
  }
  models::UNetStageState stage_input(const at::Tensor& x, double t, Branch b) override {
    return inner_->stage_input(x, t, b);
  }
  void run_stage(models::UNetStageState& s, int begin, int end, double t, Branch b) override {
    if (fail_) throw Error("simulated device failure");
    if (on_stage_) on_stage_(begin, t);
    inner_->run_stage(s, begin, end, t, b);
  }
  at::Tensor stage_output(const models::UNetStageState& s, Branch b) override { return inner_->stage_output(s, b); }
  std::vector<std::vector<std::int64_t>> stage_shapes(int layer, std::int64_t h, std::int64_t w, Branch b) const override {
    return inner_->stage_shapes(layer, h, w, b);
  }

 private:
  std::unique_ptr<Denoiser> inner_;
  std::atomic<int>& count_;
  bool fail_;
  StageHook on_stage_;
};

}  // namespace

class TestParallel : public QObject {
  Q_OBJECT

  models::UNet2DConditionModel unet_{nullptr};
  std::atomic<int> evals_{0};
  int fail_rank_ = -1;
  models::UNetConditioning pos_, neg_;  // the last inputs()' conditioning

  // The batch a guided evaluation runs: [negative; prompt] with CFG, else the prompt.
  models::UNetConditioning guided_conditioning(bool cfg) const {
    models::UNetConditioning c = pos_;
    if (!cfg) return c;
    c.encoder_hidden_states = at::cat({neg_.encoder_hidden_states, pos_.encoder_hidden_states});
    if (pos_.text_embeds.defined()) {
      c.text_embeds = at::cat({neg_.text_embeds, pos_.text_embeds});
      c.time_ids = at::cat({neg_.time_ids, pos_.time_ids});
    }
    return c;
  }

  // `model`: the tiny SD UNet when null (the tiny SDXL one gets pooled text and time ids too).
  LoopInputs inputs(schedulers::SamplerKind kind, int steps, int batch, double cfg, std::uint64_t seed = 7,
                    models::UNet2DConditionModel model = nullptr) {
    if (!model) model = unet_;
    auto made = test::unet_loop_inputs(kind, steps, batch, model, seed);
    pos_ = made.pos;
    neg_ = made.neg;
    auto in = made.in;
    const auto unet = made.unet;
    const auto pos = made.pos, neg = made.neg;
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

  models::UNet2DConditionModel sdxl_{nullptr};
  models::UNet2DConditionModel sdxl() {
    if (!sdxl_) {
      sdxl_ = models::load_unet_2d_condition(test::fixtures() / "tiny-sdxl" / "unet");
      sdxl_->eval();
    }
    return sdxl_;
  }

  // AsyncDiff as its header describes it, in one thread, on the UNet's layers directly: the
  // first `warmup` steps through the components in order; later, component 0 on x_t and
  // component k > 0 on the state component k-1 produced at the step before, at this step's
  // timestep; the last component's output is the step's (guided) eps. pos_ / neg_ as inputs() left them.
  // Without `lineage`, as the reference runs it: every layer before component k's returns its
  // output of the step before (a skip-pushing layer pushes it, a consuming one pops), which is
  // component k's input; with `lineage`, component k takes component k-1's whole output state.
  at::Tensor simulate_asyncdiff(const LoopInputs& in, models::UNet2DConditionModel u, int n, int warmup, double scale,
                                bool lineage = false) {
    at::NoGradGuard no_grad;
    auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);
    at::Generator gen = in.generator.clone();
    const bool cfg = scale > 1;
    const models::UNetConditioning c = guided_conditioning(cfg);
    std::vector<double> cost;
    for (const auto& l : u->layer_info(in.latents.size(2), in.latents.size(3))) cost.push_back(l.cost);
    const auto b = AsyncDiff::balanced_split(cost, n);
    const int layers = u->layer_count();
    std::vector<int> depth;  // the skip stack's depth before each layer
    for (int j = 0; j <= layers; ++j)
      depth.push_back(static_cast<int>(u->stage_shapes(j, 1, in.latents.size(2), in.latents.size(3)).size()) - 1);
    std::vector<at::Tensor> cached(static_cast<std::size_t>(layers));  // each layer's output h at the step before
    std::vector<models::UNetStageState> prev(static_cast<std::size_t>(n));  // each component's input at the step before
    auto x = in.latents.clone();
    for (int i = 0; i < in.steps; ++i) {
      const auto x1 = sampler->scale_model_input(x, i);
      const auto xin = cfg ? at::cat({x1, x1}) : x1;
      const auto t = at::full({xin.size(0)}, sampler->timesteps()[static_cast<std::size_t>(i)], at::kFloat);
      std::vector<models::UNetStageState> now(static_cast<std::size_t>(n));
      now[0] = u->stage_begin(xin, t, c);
      at::Tensor out;
      auto fresh = cached;
      for (int k = 0; k < n; ++k) {
        const auto uk = static_cast<std::size_t>(k);
        auto s = i < warmup || k == 0 ? now[uk] : prev[uk];
        if (i >= warmup && k > 0 && !lineage) {
          s = models::UNetStageState{};
          for (int j = 0; j < b[uk]; ++j) {
            s.h = cached[static_cast<std::size_t>(j)];
            if (depth[static_cast<std::size_t>(j) + 1] > depth[static_cast<std::size_t>(j)]) s.skips.push_back(s.h);
            if (depth[static_cast<std::size_t>(j) + 1] < depth[static_cast<std::size_t>(j)]) s.skips.pop_back();
          }
        }
        s.temb = u->embed_time(t, c, at::kFloat);
        for (int j = b[uk]; j < b[uk + 1]; ++j) {
          u->forward_range(s, j, j + 1, c);
          fresh[static_cast<std::size_t>(j)] = s.h;
        }
        if (k + 1 < n) now[uk + 1] = s;
        else out = s.h;
      }
      cached = fresh;
      prev = now;
      at::Tensor eps = out;
      if (cfg) {
        auto parts = out.chunk(2);
        eps = parts[0] + scale * (parts[1] - parts[0]);
      }
      x = sampler->step(eps, i, x, gen);
    }
    return x;
  }

  // AsyncDiff's stride denoising as the reference runs it, in one thread, with a cache of every
  // layer's last output: the first `warmup` steps whole; later, a round starts at each step i with
  // (i - 1) % stride == 0 and covers steps i .. last (at most `stride`): component 0 on x_i,
  // component k > 0 on the cached outputs of every layer before it (the round before), all at
  // last's timestep, refreshing the cache; the last component again on the same cached inputs at
  // each other step's timestep gives that step's eps. Steps before the first round reuse the last
  // warm-up eps.
  at::Tensor simulate_asyncdiff_stride(const LoopInputs& in, models::UNet2DConditionModel u, int n, int stride,
                                       int warmup, double scale) {
    at::NoGradGuard no_grad;
    auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);
    at::Generator gen = in.generator.clone();
    const bool cfg = scale > 1;
    const models::UNetConditioning c = guided_conditioning(cfg);
    const auto guide = [&](const at::Tensor& out) {
      if (!cfg) return out;
      auto parts = out.chunk(2);
      return parts[0] + scale * (parts[1] - parts[0]);
    };
    std::vector<double> cost;
    for (const auto& l : u->layer_info(in.latents.size(2), in.latents.size(3))) cost.push_back(l.cost);
    const auto b = AsyncDiff::balanced_split(cost, n);
    const int layers = u->layer_count();
    std::vector<int> depth;
    for (int j = 0; j <= layers; ++j)
      depth.push_back(static_cast<int>(u->stage_shapes(j, 1, in.latents.size(2), in.latents.size(3)).size()) - 1);
    std::vector<at::Tensor> cached(static_cast<std::size_t>(layers));
    const auto rows = cfg ? 2 * in.latents.size(0) : in.latents.size(0);
    const auto time = [&](int i) { return at::full({rows}, sampler->timesteps()[static_cast<std::size_t>(i)], at::kFloat); };
    // The state before layer `upto` as the cache has it.
    const auto replay = [&](int upto, const at::Tensor& t) {
      models::UNetStageState s;
      for (int j = 0; j < upto; ++j) {
        s.h = cached[static_cast<std::size_t>(j)];
        if (depth[static_cast<std::size_t>(j) + 1] > depth[static_cast<std::size_t>(j)]) s.skips.push_back(s.h);
        if (depth[static_cast<std::size_t>(j) + 1] < depth[static_cast<std::size_t>(j)]) s.skips.pop_back();
      }
      s.temb = u->embed_time(t, c, at::kFloat);
      return s;
    };
    at::Tensor warm_eps;
    auto x = in.latents.clone();
    for (int i = 0; i < in.steps;) {
      const auto x1 = sampler->scale_model_input(x, i);
      const auto xin = cfg ? at::cat({x1, x1}) : x1;
      if (i < warmup) {
        auto s = u->stage_begin(xin, time(i), c);
        for (int j = 0; j < layers; ++j) {
          u->forward_range(s, j, j + 1, c);
          cached[static_cast<std::size_t>(j)] = s.h;
        }
        warm_eps = guide(s.h);
        x = sampler->step(warm_eps, i, x, gen);
        ++i;
        continue;
      }
      if ((i - 1) % stride != 0) {
        x = sampler->step(warm_eps, i, x, gen);
        ++i;
        continue;
      }
      const int last = std::min(i + stride - 1, in.steps - 1);
      std::vector<at::Tensor> eps(static_cast<std::size_t>(last - i + 1));
      auto fresh = cached;
      for (int k = 0; k < n; ++k) {
        const auto uk = static_cast<std::size_t>(k);
        auto s = k == 0 ? u->stage_begin(xin, time(last), c) : replay(b[uk], time(last));
        for (int j = b[uk]; j < b[uk + 1]; ++j) {
          u->forward_range(s, j, j + 1, c);
          fresh[static_cast<std::size_t>(j)] = s.h;
        }
        if (k == n - 1) eps.back() = guide(s.h);
      }
      for (int q = i; q < last; ++q) {
        auto s = replay(b[static_cast<std::size_t>(n) - 1], time(q));
        u->forward_range(s, b[static_cast<std::size_t>(n) - 1], layers, c);
        eps[static_cast<std::size_t>(q - i)] = guide(s.h);
      }
      cached = fresh;
      for (int q = i; q <= last; ++q) x = sampler->step(eps[static_cast<std::size_t>(q - i)], q, x, gen);
      i = last + 1;
    }
    return x;
  }

  models::SD3Transformer2DModel sd3_{nullptr};
  SD3Conditioning sd3_pos_, sd3_neg_;

  models::SD3Transformer2DModel& sd3() {
    if (!sd3_) sd3_ = test::tiny_sd3(4, /*sd35=*/true);
    return sd3_;
  }

  LoopInputs sd3_inputs(int steps, int batch, double cfg, std::int64_t side = 16) {
    auto made = test::sd3_loop_inputs(sd3(), steps, batch, cfg, side);
    sd3_pos_ = made.pos;
    sd3_neg_ = made.neg;
    return made.in;
  }

  // PipeFusion as its header describes it, in one thread: items (step, patch) in order, each
  // through every block with one K/V cache per block; the first `warm` steps whole.
  at::Tensor simulate_pipefusion(const LoopInputs& in, int m, int warm, double scale) {
    at::NoGradGuard no_grad;
    auto& model = sd3();
    auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);
    const bool cfg = scale > 1;
    const auto context = cfg ? at::cat({sd3_neg_.context, sd3_pos_.context}) : sd3_pos_.context;
    const auto pooled = cfg ? at::cat({sd3_neg_.pooled, sd3_pos_.pooled}) : sd3_pos_.pooled;
    const auto layers = static_cast<std::size_t>(model->config.num_layers);
    std::vector<models::SD3BlockCache> caches(layers);
    auto x = in.latents.clone();
    const std::int64_t h = x.size(2), rows = h / m, p = model->config.patch_size;
    const std::int64_t patch_tokens = (rows / p) * (x.size(3) / p);
    auto guided = [&](const at::Tensor& out) {
      if (!cfg) return out;
      auto parts = out.chunk(2);
      return parts[0] + scale * (parts[1] - parts[0]);
    };
    for (int i = 0; i < in.steps; ++i) {
      const auto t = at::full({context.size(0)}, sampler->timesteps()[static_cast<std::size_t>(i)], at::kFloat);
      const auto xin = cfg ? at::cat({x, x}) : x;
      models::SD3State s;
      s.temb = model->time_text_embed->forward(t, pooled);
      s.width = x.size(3);
      if (i < warm) {
        s.x = model->pos_embed->forward(xin);
        s.context = model->context_embedder->forward(context);
        s.height = h;
        for (std::size_t l = 0; l < layers; ++l) model->run_block(l, s, caches[l], 0);
        x = sampler->step(guided(model->unpatchify_output(s)), i, x, {});
        continue;
      }
      auto next = x.clone();
      for (int q = 0; q < m; ++q) {
        s.x = model->pos_embed->forward_rows(xin.narrow(2, q * rows, rows), q * rows, h);
        s.context = model->context_embedder->forward(context);
        s.height = rows;
        for (std::size_t l = 0; l < layers; ++l) model->run_block(l, s, caches[l], q * patch_tokens);
        next.narrow(2, q * rows, rows).copy_(sampler->step(guided(model->unpatchify_output(s)), i, x.narrow(2, q * rows, rows), {}));
      }
      x = next;
    }
    return x;
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
          // All-to-all: the chunk for rank d is [d + 1] long on every rank, and moves once.
          std::vector<at::Tensor> chunks;
          std::int64_t others = 0;
          for (int d = 0; d < n; ++d) {
            chunks.push_back(at::full({d + 1}, r * 10 + d, at::kFloat));
            if (d != r) others += (d + 1) * 4;
          }
          const auto before = c.bytes_sent();
          const auto mine = c.all_to_all(chunks);
          good &= c.bytes_sent() - before == others && static_cast<int>(mine.size()) == n;
          for (int q = 0; q < n; ++q)
            good &= mine[static_cast<std::size_t>(q)].sizes() == at::IntArrayRef{r + 1} &&
                    mine[static_cast<std::size_t>(q)][r].item<float>() == q * 10 + r;
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

  // A rank running out of memory comes back typed, naming its device, with LibTorch's first line
  // and without its backtrace (the pipeline turns it into its out-of-memory error); the group
  // stays usable.
  void outOfMemoryOnARankIsTyped() {
    auto group = DeviceGroup::virtual_cpu(2);
    bool typed = false;
    try {
      group->run([&](int rank, Communicator& c) {
        if (rank == 1) TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 GiB.\nmore");
        c.all_gather(at::ones({1}));
      });
    } catch (const DeviceOutOfMemory& e) {
      typed = true;
      QCOMPARE(e.device(), std::string("cpu:virtual 1"));
      QCOMPARE(e.why(), std::string("CUDA out of memory. Tried to allocate 2.00 GiB."));
      QCOMPARE(std::string(e.what()), std::string("device 1 (cpu:virtual 1): CUDA out of memory. Tried to allocate 2.00 GiB."));
    }
    QVERIFY(typed);
    // Other LibTorch errors keep their whole message but lose the backtrace.
    try {
      group->run([&](int rank, Communicator&) { TORCH_CHECK(rank != 0, "shape mismatch"); });
      QFAIL("expected an error");
    } catch (const DeviceOutOfMemory&) {
      QFAIL("not an out-of-memory error");
    } catch (const Error& e) {
      QCOMPARE(std::string(e.what()), std::string("device 0 (cpu:virtual 0): shape mismatch"));
    }
    std::atomic<int> ran{0};
    group->run([&](int, Communicator& c) {
      c.barrier();
      ++ran;
    });
    QCOMPARE(ran.load(), 2);
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
    for (int n : {2, 4, 8}) {
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
        const auto points = DRiffusion::round_points(mode, steps, n);
        QCOMPARE(static_cast<int>(points.size()), expected);
        QCOMPARE(std::accumulate(points.begin(), points.end(), 0), steps);
        QCOMPARE(out.stats.paired_rounds,
                 static_cast<int>(std::count_if(points.begin(), points.end(), [&](int p) { return 2 * p <= n; })));
        QCOMPARE(out.stats.evaluations, steps);  // every step's output is evaluated exactly once
        QCOMPARE(evals_.load(), steps + out.stats.paired_rounds);  // a paired point: two calls, a branch each
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

  // A round with devices to spare runs each point's prompt and negative prompt on two of them:
  // aggressive mode's first and last rounds, conservative mode's anchor rounds, on 2 devices.
  void driffusionPairsIdleDevices() {
    using V = std::vector<int>;
    V aggressive(16, 2);
    aggressive.front() = aggressive.back() = 1;
    QVERIFY(DRiffusion::round_points(DRiffusion::Mode::Aggressive, 30, 2) == aggressive);
    QVERIFY(DRiffusion::round_points(DRiffusion::Mode::Aggressive, 9, 4) == (V{1, 4, 4}));
    QVERIFY(DRiffusion::round_points(DRiffusion::Mode::Aggressive, 7, 2) == (V{1, 2, 2, 2}));
    QVERIFY(DRiffusion::round_points(DRiffusion::Mode::Conservative, 7, 2) == (V{1, 2, 1, 2, 1}));
    QVERIFY(DRiffusion::round_points(DRiffusion::Mode::Conservative, 0, 2).empty());
    const int steps = 7;
    for (auto mode : {DRiffusion::Mode::Aggressive, DRiffusion::Mode::Conservative}) {
      DRiffusion paired;
      paired.n = 2;
      paired.mode = mode;
      DRiffusion idle = paired;
      idle.pair_branches = false;
      auto in = inputs(schedulers::SamplerKind::Euler, steps, 1, 4.0);
      const auto a = run(idle, in);
      QCOMPARE(a.stats.paired_rounds, 0);
      QCOMPARE(evals_.load(), steps);
      const auto b = run(paired, in);
      const int expect = mode == DRiffusion::Mode::Aggressive ? 1 : 3;  // the rounds of one point below
      QCOMPARE(b.stats.paired_rounds, expect);
      QCOMPARE(b.stats.rounds, a.stats.rounds);
      QCOMPARE(b.stats.evaluations, steps);
      QCOMPARE(evals_.load(), steps + expect);
      QVERIFY(nlohmann::json::parse(b.stats.to_json())["paired_rounds"] == expect);
      // The same trajectory: batch-1 against batch-2 rounding, as for CFG-parallel.
      DIFFRACT_COMPARE_TENSORS(b.latents, a.latents, 1e-4);
      // Without CFG there is one branch: nothing to pair.
      auto plain = inputs(schedulers::SamplerKind::Euler, steps, 1, 1.0);
      const auto c = run(paired, plain);
      QCOMPARE(c.stats.paired_rounds, 0);
      QVERIFY(at::equal(c.latents, run(idle, plain).latents));
    }
    setenv("DIFFRACT_DRIFFUSION_PAIRS", "0", 1);
    const auto off = make_strategy("driffusion-aggressive", 2);
    unsetenv("DIFFRACT_DRIFFUSION_PAIRS");
    QVERIFY(!dynamic_cast<const DRiffusion&>(*off).pair_branches);
    QVERIFY(dynamic_cast<const DRiffusion&>(*make_strategy("driffusion", 2)).pair_branches);
  }

  // CFG-parallel x DRiffusion: n drafts on 2n devices, each pair splitting the prompt and the
  // negative prompt. The same trajectory as DRiffusion on n devices (branches apart instead of
  // batched) in the same rounds; on 2 devices the plain loop. Up to 8 virtual devices: issue 9's
  // 2 x 2 and 2 x 4 layouts.
  void cfgDriffusionPairsTheBranches() {
    const int steps = 10;
    for (int n : {1, 2, 4}) {
      for (auto mode : {DRiffusion::Mode::Aggressive, DRiffusion::Mode::Conservative}) {
        auto in = inputs(schedulers::SamplerKind::Euler, steps, 1, 4.0);
        DRiffusion plain;
        plain.n = n;
        plain.mode = mode;
        DRiffusion split = plain;
        split.cfg_split = true;
        const auto a = run(plain, in);
        const auto b = run(split, in);
        QCOMPARE(split.devices(), 2 * n);
        QCOMPARE(b.stats.devices, 2 * n);
        QCOMPARE(b.stats.rounds, DRiffusion::expected_rounds(mode, steps, n));
        QCOMPARE(b.stats.evaluations, steps);
        QCOMPARE(evals_.load(), 2 * steps);  // each step's two branches, on two devices
        // Batch-1 against batch-2 rounding, as for CFG-parallel.
        DIFFRACT_COMPARE_TENSORS(b.latents, a.latents, 1e-4);
        if (n == 1) DIFFRACT_COMPARE_TENSORS(b.latents, run(SingleDevice{}, in).latents, 1e-4);
      }
    }
    QCOMPARE(make_strategy("cfg-driffusion-aggressive", 8)->devices(), 8);
    QCOMPARE(make_strategy("cfg-driffusion", 4)->name(), std::string("cfg-driffusion"));
    DIFFRACT_EXPECT_ERROR(make_strategy("cfg-driffusion", 3), "even number of devices");
    DIFFRACT_EXPECT_ERROR(make_strategy("cfg-driffusion", 4)->validate(1, /*cfg=*/false), "needs CFG");
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

  // The U split's three stages chained on one branch are the UNet's forward.
  void hybridStageSplitIsExact() {
    at::Generator g = at::detail::createCPUGenerator(3);
    const auto& c = unet_->config;
    const auto x = at::randn({2, c.in_channels, c.sample_size, c.sample_size}, g);
    const auto t = at::tensor({500.0f, 20.0f});
    models::UNetConditioning cond;
    cond.encoder_hidden_states = at::randn({2, 5, c.cross_attention_dim.front()}, g);
    at::NoGradGuard no_grad;
    const auto full = unet_->forward(x, t, cond);
    auto st = unet_->forward_outer_down(x, t, cond, 1);
    QVERIFY(st.h.sizes().vec() == (std::vector<int64_t>{2, 32, 8, 8}));  // down_blocks[1]'s input
    const auto inner = unet_->forward_inner(st.h, t, cond, 1);
    const auto split = unet_->forward_outer_up(std::move(st), inner, cond, 1);
    DIFFRACT_COMPARE_TENSORS(split, full, 1e-6);
    DIFFRACT_EXPECT_ERROR(unet_->forward_inner(x, t, cond, 2), "split at down block 2", "must be 1 to 1");
    DIFFRACT_EXPECT_ERROR(unet_->forward_outer_down(x, t, cond, 0), "must be 1 to 1");
    // The same through the denoiser, per branch.
    auto in = inputs(schedulers::SamplerKind::Euler, 2, 1, 5.0);
    auto d = in.make_denoiser(0, c10::Device(c10::kCPU));
    QCOMPARE(d->splits(), 1);
    const auto x1 = x.narrow(0, 0, 1);
    for (auto b : {Branch::Cond, Branch::Uncond}) {
      auto s1 = d->outer_down(x1, 321, b, 1);
      const auto h = s1.h;
      DIFFRACT_COMPARE_TENSORS(d->outer_up(std::move(s1), d->inner(h, 321, b, 1), b, 1), d->eval(x1, 321, b), 1e-6);
    }
    DIFFRACT_EXPECT_ERROR(d->outer_down(x1, 321, Branch::Guided, 1), "one branch");
  }

  // No stale step: hybrid is CFG-parallel, bit for bit.
  void hybridEmptyWindowEqualsCfgParallel() {
    auto in = inputs(schedulers::SamplerKind::Euler, 6, 1, 5.0);
    const auto base = run(CfgParallel{}, in);
    auto check = [&](const HybridCfg& h) {
      const auto out = run(h, in);
      QVERIFY(at::equal(out.latents, base.latents));
      QCOMPARE(out.stats.evaluations, 12);
      QCOMPARE(out.stats.bytes_sent, base.stats.bytes_sent);
      QVERIFY(out.stats.note.find("every step ran CFG-parallel") != std::string::npos);
      QCOMPARE(out.stats.rel_mae.size(), base.stats.rel_mae.size());
      for (std::size_t i = 0; i < base.stats.rel_mae.size(); ++i) QCOMPARE(out.stats.rel_mae[i], base.stats.rel_mae[i]);
    };
    HybridCfg h;
    h.tau_cap = 1;
    h.k = 0;  // the rule fires at step 1, but the window is empty
    check(h);
    h.k = 1;  // only the fill step, which is not needed
    check(h);
    h = HybridCfg{};  // the cap (15) and L (12) lie beyond 6 steps
    check(h);
    QCOMPARE(run(h, in).stats.tau1, 15);
  }

  // The window on: the strategy equals a one-device replay of the stale algorithm written
  // here from the design (header of HybridCfg), and moves a little away from CFG-parallel.
  void hybridStaleWindowMatchesSimulation() {
    for (auto kind : {schedulers::SamplerKind::Euler, schedulers::SamplerKind::DPMPP2M}) {
      const int steps = 8;
      auto in = inputs(kind, steps, 1, 5.0);
      HybridCfg h;
      h.tau_cap = 1;  // L = 12 never gets a slope in 8 steps: tau1 = 1, fill step 2, stale 3..5
      h.k = 4;
      const auto out = run(h, in);
      const auto base = run(CfgParallel{}, in);
      QCOMPARE(out.stats.tau1, 1);
      QCOMPARE(out.stats.tau2, 5);
      QVERIFY(out.stats.note.find("steps 3..5 ran layer-split one-step-stale") != std::string::npos);

      at::NoGradGuard no_grad;
      auto sampler = schedulers::Sampler::create(kind, in.config, steps);
      at::Generator gen = in.generator.clone();
      const double scale = 5.0;
      auto x = in.latents.clone();
      at::Tensor h_prev, d_prev;
      std::int64_t eps_bytes = 0, h_bytes = 0, d_bytes = 0;
      for (int i = 0; i < steps; ++i) {
        const auto xin = sampler->scale_model_input(x, i);
        const auto t = at::full({1}, sampler->timesteps()[static_cast<std::size_t>(i)], at::kFloat);
        at::Tensor e;
        if (i >= 3 && i <= 5) {
          auto st = unet_->forward_outer_down(xin, t, pos_, 1);  // rank 0: Cond, fresh outer
          const auto hh = st.h;
          e = unet_->forward_outer_up(std::move(st), d_prev, pos_, 1);  // stale inner output
          d_prev = unet_->forward_inner(h_prev, t, neg_, 1);         // rank 1: Uncond on h_{i-1}
          h_prev = hh;
        } else {
          const auto c = unet_->forward(xin, t, pos_), u = unet_->forward(xin, t, neg_);
          e = u + scale * (c - u);
          eps_bytes = static_cast<std::int64_t>(c.nbytes());
          if (i == 2) {
            h_prev = unet_->forward_outer_down(xin, t, pos_, 1).h;
            d_prev = unet_->forward_inner(unet_->forward_outer_down(xin, t, neg_, 1).h, t, neg_, 1);
            h_bytes = static_cast<std::int64_t>(h_prev.nbytes());
            d_bytes = static_cast<std::int64_t>(d_prev.nbytes());
          }
        }
        x = sampler->step(e, i, x, gen);
      }
      DIFFRACT_COMPARE_TENSORS(out.latents, x, 1e-5);
      const double rel = (out.latents - base.latents).norm().item<double>() / base.latents.norm().item<double>();
      QVERIFY2(rel > 1e-6 && rel < 0.5, qPrintable(QString("rel L2 to CFG-parallel %1").arg(rel)));
      // 5 CFG-parallel steps (all_gather: 2 eps), the fill step's h + inner output, stale steps
      // 3 and 4 send eps + h + inner output, the last stale step eps alone.
      QCOMPARE(out.stats.bytes_sent, 10 * eps_bytes + (h_bytes + d_bytes) + 2 * (eps_bytes + h_bytes + d_bytes) + eps_bytes);
      QCOMPARE(out.stats.evaluations, 5 * 2 + 3);
      QCOMPARE(out.stats.rounds, steps);
      for (int i = 0; i < steps; ++i)
        QCOMPARE(std::isnan(out.stats.rel_mae[static_cast<std::size_t>(i)]), i >= 3 && i <= 5);
    }
  }

  void hybridBadParameters() {
    auto expect = [&](HybridCfg h, const char* what) {
      DIFFRACT_EXPECT_ERROR(run(h, inputs(schedulers::SamplerKind::Euler, 4, 1, 5.0)), what);
    };
    HybridCfg h;
    h.L = 1;
    expect(h, "slope window L must be 2 or more, not 1");
    h = HybridCfg{};
    h.eps = 0;
    expect(h, "eps must be above 0");
    h = HybridCfg{};
    h.tau_cap = -2;
    expect(h, "tau_cap must be 0 or more, not -2");
    h = HybridCfg{};
    h.k = -1;
    expect(h, "window length k must be 0 or more, not -1");
    h = HybridCfg{};
    h.split = 0;
    expect(h, "split must be a down block index of 1 or more");
    h = HybridCfg{};
    h.split = 3;
    expect(h, "split 3 is past this UNet's last split point 1");
    DIFFRACT_EXPECT_ERROR(run(HybridCfg{}, inputs(schedulers::SamplerKind::Euler, 4, 1, 1.0)), "needs classifier-free");
    // A denoiser that cannot split: clear errors from the strategy and from the stage calls.
    struct Plain final : Denoiser {
      at::Tensor eval(const at::Tensor& x, double, Branch) override { return x; }
      bool cfg() const override { return true; }
      double guidance_scale() const override { return 5; }
      std::int64_t batch() const override { return 1; }
      at::ScalarType output_dtype() const override { return at::kFloat; }
      std::unique_ptr<Denoiser> rows(std::int64_t, std::int64_t) const override { return std::make_unique<Plain>(); }
    };
    Plain p;
    DIFFRACT_EXPECT_ERROR(p.outer_down(at::zeros({1, 4, 8, 8}), 1, Branch::Cond, 1), "cannot run the layer-split stages");
    auto in = inputs(schedulers::SamplerKind::Euler, 4, 1, 5.0);
    in.make_denoiser = [](int, const c10::Device&) -> std::unique_ptr<Denoiser> { return std::make_unique<Plain>(); };
    DIFFRACT_EXPECT_ERROR(run(HybridCfg{}, in), "cannot be split into layer stages");
  }

  void dataParallelEqualsOneDevice() {
    for (int n : {2, 4, 8}) {  // 8: issue 9's batch of 8 over 8 devices, here virtual
      for (double cfg : {1.0, 5.0}) {
        auto in = inputs(schedulers::SamplerKind::Euler, 4, std::max(5, n), cfg);
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
      job::GenerationRequest req;
      req.prompt = "a red apple";
      req.negative_prompt = "blurry";
      req.steps = 4;
      req.cfg = 5.0;
      req.seed = 3;
      req.sampler = "euler";
      req.preview_every = 2;
      job::CancelToken never;
      int previews = 0, steps = 0;
      job::JobObserver obs;
      obs.on_preview = [&](const job::PreviewEvent&) { ++previews; };
      obs.on_step = [&](const job::StepEvent&) { ++steps; };
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
      DIFFRACT_EXPECT_ERROR(sd->generate(req, {}, never, make_strategy("pipefusion", 2).get()), "pipefusion",
                            "runs SD3 and Flux");
      // AsyncDiff through the pipeline: all steps synchronous is the plain loop; with its
      // default one warm-up step it runs stale and says so.
      AsyncDiff sync;
      sync.n = 3;
      sync.warmup = req.steps;
      const auto synced = sd->generate(req, {}, never, &sync);
      const auto& s3 = synced.images.front().rgb;
      worst = 0;
      for (std::size_t i = 0; i < s3.size(); ++i) worst = std::max(worst, std::abs(int(s3[i]) - int(b[i])));
      QVERIFY2(worst <= 1, qPrintable(QString("%1: synchronous asyncdiff differs by %2 levels").arg(model).arg(worst)));
      const auto stale = sd->generate(req, {}, never, make_strategy("asyncdiff", 2).get());
      QVERIFY(stale.metadata_json.find("one-step-stale") != std::string::npos);
      QVERIFY(stale.metadata_json.find("\"messages_per_step\":[2,2,2,1]") != std::string::npos);
    }
  }

  void cancellationStopsAllRanks() {
    // Runs `s` on `in`, cancelling after step `when`; true when the run ended in Cancelled.
    // `last`: the last step reported.
    int last = -1;
    const auto cancelled_at = [&](const Strategy& s, LoopInputs in, int when) {
      job::CancelToken token;
      in.cancel = &token;
      last = -1;
      in.on_step = [&](int i, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
        last = i;
        if (i == when) token.cancel();
      };
      try {
        run(s, in);
      } catch (const job::Cancelled&) {
        return true;
      }
      return false;
    };
    DRiffusion d;
    d.n = 2;
    QVERIFY(cancelled_at(d, inputs(schedulers::SamplerKind::Euler, 6, 1, 5.0), 1));
    PipeFusion pf;  // cancelled while patches are in flight
    pf.patches = 4;
    QVERIFY(cancelled_at(pf, sd3_inputs(6, 1, 4.0), 2));
    AsyncDiff a;  // cancelled in its stale steps while states are in flight between 3 ranks
    a.n = 3;
    QVERIFY(cancelled_at(a, inputs(schedulers::SamplerKind::Euler, 6, 1, 5.0), 2));
    QVERIFY(last >= 2 && last < 5);
    a.n = 2;  // with a stride (rounds (1, 2), (3, 4), ...), within two rounds of the cancel
    a.stride = 2;
    QVERIFY(cancelled_at(a, inputs(schedulers::SamplerKind::Euler, 9, 1, 5.0), 3));
    QVERIFY(last >= 4 && last < 8);
    QVERIFY(cancelled_at(a, inputs(schedulers::SamplerKind::Euler, 7, 1, 5.0), 0));
    QVERIFY(last >= 0 && last < 6);
  }

  // --- AsyncDiff: the UNet's sequential layers, the synchronous and the stale loop ---

  // (a) The layers chained, one at a time or in balanced components, are forward() bit for bit,
  // for the tiny SD and SDXL UNets, at the fixture's latent size and an odd one; the state's
  // shapes are stage_shapes(); through the denoiser, every branch equals eval().
  void asyncdiffStagesEqualForward() {
    at::NoGradGuard no_grad;
    for (auto u : {unet_, sdxl()}) {
      auto in = inputs(schedulers::SamplerKind::Euler, 2, 2, 5.0, 3, u);
      const auto& c = u->config;
      QCOMPARE(u->layer_count(), 16);  // conv_in, 3 + 2 down, 2 mid, 4 + 3 up, head
      at::Generator g = at::detail::createCPUGenerator(4);
      const std::vector<std::pair<std::int64_t, std::int64_t>> sizes = {{16, 16}, {13, 10}};
      for (const auto& [hh, ww] : sizes) {
        const auto x = at::randn({2, c.in_channels, hh, ww}, g);
        const auto t = at::tensor({500.0f, 20.0f});
        const auto full = u->forward(x, t, pos_);
        auto s = u->stage_begin(x, t, pos_);
        for (int j = 0; j < u->layer_count(); ++j) {
          const auto shapes = u->stage_shapes(j, 2, hh, ww);
          QCOMPARE(shapes.size(), s.skips.size() + 1);
          QVERIFY(shapes[0] == s.h.sizes().vec());
          for (std::size_t k = 0; k < s.skips.size(); ++k) QVERIFY(shapes[k + 1] == s.skips[k].sizes().vec());
          u->forward_range(s, j, j + 1, pos_);
        }
        QVERIFY(s.skips.empty());
        QVERIFY(at::equal(s.h, full));
        std::vector<double> cost;
        const auto info = u->layer_info(hh, ww);
        for (const auto& l : info) {
          QVERIFY(l.cost > 0 && l.parameters > 0);
          cost.push_back(l.cost);
        }
        QCOMPARE(info.front().name, std::string("conv_in"));
        QCOMPARE(info[3].name, std::string("down_blocks.0.downsamplers.0"));
        for (int n = 1; n <= 4; ++n) {
          const auto b = AsyncDiff::balanced_split(cost, n);
          QCOMPARE(static_cast<int>(b.size()), n + 1);
          auto s2 = u->stage_begin(x, t, pos_);
          for (int k = 0; k < n; ++k) u->forward_range(s2, b[static_cast<std::size_t>(k)], b[static_cast<std::size_t>(k) + 1], pos_);
          QVERIFY(at::equal(s2.h, full));
        }
      }
      models::UNetStageState none;
      DIFFRACT_EXPECT_ERROR(u->forward_range(none, 3, 17, pos_), "layers [3, 17)", "0 to 15");
      // Through the denoiser (batch 2 of conditioning), per branch and guided.
      auto d = in.make_denoiser(0, c10::Device(c10::kCPU));
      std::vector<double> cost;
      for (const auto& l : d->stage_layers(16, 16)) cost.push_back(l.cost);
      const auto b = AsyncDiff::balanced_split(cost, 3);
      const auto x2 = at::randn({2, c.in_channels, 16, 16}, g);
      for (auto br : {Branch::Cond, Branch::Uncond, Branch::Guided}) {
        auto st = d->stage_input(x2, 321, br);
        for (int k = 0; k < 3; ++k) {
          const auto shapes = d->stage_shapes(b[static_cast<std::size_t>(k)], 16, 16, br);
          QVERIFY(shapes[0] == st.h.sizes().vec());
          QCOMPARE(shapes.size(), st.skips.size() + 1);
          d->run_stage(st, b[static_cast<std::size_t>(k)], b[static_cast<std::size_t>(k) + 1], 321, br);
        }
        DIFFRACT_COMPARE_TENSORS(d->stage_output(st, br), d->eval(x2, 321, br), 1e-6);
      }
      auto st = d->stage_input(x2, 321, Branch::Guided);
      d->run_stage(st, 0, 3, 321, Branch::Guided);
      DIFFRACT_EXPECT_ERROR(d->stage_output(st, Branch::Guided), "still holds");
    }
    // The split itself.
    QVERIFY(AsyncDiff::balanced_split({1, 1, 1, 1}, 2) == (std::vector<int>{0, 2, 4}));
    QVERIFY(AsyncDiff::balanced_split({10, 1, 1, 1, 1}, 2) == (std::vector<int>{0, 1, 5}));
    QVERIFY(AsyncDiff::balanced_split({1, 2, 3, 4, 5}, 3) == (std::vector<int>{0, 3, 4, 5}));
    QVERIFY(AsyncDiff::balanced_split({5}, 1) == (std::vector<int>{0, 1}));
    DIFFRACT_EXPECT_ERROR(AsyncDiff::balanced_split({1, 2}, 3), "3 components for a model of 2 sequential layers");
  }

  // (b) warmup >= steps: every step synchronous through the components, which is one device.
  void asyncdiffSynchronousEqualsOneDevice() {
    for (auto kind : {schedulers::SamplerKind::Euler, schedulers::SamplerKind::DPMPP2M})
      for (double cfg : {5.0, 1.0})
        for (int n : {2, 3}) {
          auto in = inputs(kind, 4, 1, cfg);
          const auto base = run(SingleDevice{}, in);
          AsyncDiff a;
          a.n = n;
          a.warmup = 4;
          const auto out = run(a, in);
          DIFFRACT_COMPARE_TENSORS(out.latents, base.latents, 1e-6);
          QVERIFY(out.stats.messages_per_step == std::vector<std::int64_t>(4, n));
          QCOMPARE(out.stats.rounds, 4);
        }
    auto in = inputs(schedulers::SamplerKind::Euler, 3, 1, 5.0, 7, sdxl());
    AsyncDiff a;
    a.n = 4;
    a.warmup = 10;
    DIFFRACT_COMPARE_TENSORS(run(a, in).latents, run(SingleDevice{}, in).latents, 1e-6);
  }

  // (c) Stale steps on: the strategy equals the one-thread replay above, and moves away from
  // the single device.
  void asyncdiffStaleMatchesSimulation() {
    struct Case {
      schedulers::SamplerKind kind;
      int n, warmup;
      double cfg;
      bool xl;
      bool lineage = false;
    };
    for (const auto& k : {Case{schedulers::SamplerKind::Euler, 2, 1, 5.0, false}, Case{schedulers::SamplerKind::Euler, 2, 2, 1.0, false},
                          Case{schedulers::SamplerKind::DPMPP2M, 3, 1, 5.0, false}, Case{schedulers::SamplerKind::Euler, 3, 2, 1.0, false},
                          Case{schedulers::SamplerKind::DDIM, 4, 1, 5.0, false}, Case{schedulers::SamplerKind::Euler, 2, 1, 5.0, true},
                          Case{schedulers::SamplerKind::Euler, 3, 1, 1.0, true},
                          Case{schedulers::SamplerKind::Euler, 3, 1, 5.0, false, true},
                          Case{schedulers::SamplerKind::DPMPP2M, 4, 2, 1.0, false, true},
                          Case{schedulers::SamplerKind::Euler, 8, 1, 5.0, false}}) {  // 8: issue 9's largest group
      const int steps = 6;
      auto in = inputs(k.kind, steps, 1, k.cfg, 7, k.xl ? sdxl() : unet_);
      AsyncDiff a;
      a.n = k.n;
      a.warmup = k.warmup;
      a.lineage_skips = k.lineage;
      const auto out = run(a, in);
      const auto sim = simulate_asyncdiff(in, k.xl ? sdxl() : unet_, k.n, k.warmup, k.cfg, k.lineage);
      const auto what =
          QString("n %1 warmup %2 cfg %3 xl %4 lineage %5").arg(k.n).arg(k.warmup).arg(k.cfg).arg(k.xl).arg(k.lineage);
      QVERIFY2(test::max_abs_diff(out.latents, sim) < 1e-5, qPrintable(what));
      // The other skip rule: the same for 2 components, different from 3 on.
      const auto other = simulate_asyncdiff(in, k.xl ? sdxl() : unet_, k.n, k.warmup, k.cfg, !k.lineage);
      QVERIFY2(k.n == 2 ? test::max_abs_diff(other, sim) < 1e-5 : test::max_abs_diff(other, sim) > 1e-6, qPrintable(what));
      const auto base = run(SingleDevice{}, in);
      const double rel = (out.latents - base.latents).norm().item<double>() / base.latents.norm().item<double>();
      // Four components of a tiny random UNet, three of them stale, drift far (0.97 at 6 steps).
      QVERIFY2(rel > 1e-6 && rel < (k.n < 4 ? 0.5 : 2.0), qPrintable(what + QString(": rel L2 to one device %1").arg(rel)));
      QCOMPARE(out.stats.evaluations, steps);
      QVERIFY(out.stats.note.find("one-step-stale") != std::string::npos);
    }
  }

  // (d) n messages a step (n - 1 states and eps), only eps in a stale last step; their bytes.
  void asyncdiffMessagesPerStep() {
    const int steps = 5, n = 3;
    auto in = inputs(schedulers::SamplerKind::Euler, steps, 1, 5.0);
    AsyncDiff a;
    a.n = n;
    a.warmup = 2;
    const auto out = run(a, in);
    QVERIFY(out.stats.messages_per_step == (std::vector<std::int64_t>{3, 3, 3, 3, 1}));
    for (int i = 0; i < steps; ++i) QCOMPARE(AsyncDiff::messages_per_step(i, steps, 2, n), static_cast<int>(out.stats.messages_per_step[static_cast<std::size_t>(i)]));
    QCOMPARE(AsyncDiff::messages_per_step(4, 5, 5, 3), 3);  // a synchronous last step feeds its components
    auto d = in.make_denoiser(0, c10::Device(c10::kCPU));
    std::vector<double> cost;
    std::int64_t total_weights = 0;
    for (const auto& l : d->stage_layers(16, 16)) {
      cost.push_back(l.cost);
      total_weights += l.parameters;
    }
    const auto b = AsyncDiff::balanced_split(cost, n);
    std::int64_t state_bytes = 0;
    for (int k = 1; k < n; ++k)
      for (const auto& shape : d->stage_shapes(b[static_cast<std::size_t>(k)], 16, 16, Branch::Guided)) {
        QCOMPARE(shape[0], std::int64_t{2});  // both branches
        std::int64_t count = 4;               // float
        for (auto v : shape) count *= v;
        state_bytes += count;
      }
    const std::int64_t eps_bytes = in.latents.numel() * 4;
    QVERIFY(out.stats.bytes_per_step ==
            (std::vector<std::int64_t>{state_bytes + eps_bytes, state_bytes + eps_bytes, state_bytes + eps_bytes,
                                       state_bytes + eps_bytes, eps_bytes}));
    QCOMPARE(out.stats.bytes_sent, 4 * (state_bytes + eps_bytes) + eps_bytes);
    QCOMPARE(static_cast<int>(out.stats.weights_per_rank.size()), n);
    std::int64_t sum = 0;
    for (auto w : out.stats.weights_per_rank) {
      QVERIFY(w > 0);
      sum += w;
    }
    QCOMPARE(sum, total_weights);
    QVERIFY(out.stats.note.find("2 synchronous step(s), then 3 one-step-stale") != std::string::npos);
    QVERIFY(out.stats.to_json().find("messages_per_step") != std::string::npos);
  }

  // (e) What it cannot run, with clear errors.
  void asyncdiffRefusesWhatItCannotSplit() {
    auto in = inputs(schedulers::SamplerKind::Euler, 3, 1, 5.0);
    AsyncDiff a;
    a.n = 17;
    DIFFRACT_EXPECT_ERROR(run(a, in), "17 components for a model of 16 sequential layers");
    a = AsyncDiff{};
    a.warmup = 0;
    DIFFRACT_EXPECT_ERROR(run(a, in), "1 or more synchronous warm-up steps");
    a = AsyncDiff{};
    a.n = 1;
    DIFFRACT_EXPECT_ERROR(run(a, in), "2 or more devices");
    DIFFRACT_EXPECT_ERROR(run(AsyncDiff{}, sd3_inputs(2, 1, 4.0)), "cannot be split into sequential stages");
    auto group = DeviceGroup::virtual_cpu(3);
    DIFFRACT_EXPECT_ERROR(AsyncDiff{}.run(*group, in), "needs 2 device");
    // A failing rank is one error, and nobody hangs.
    fail_rank_ = 1;
    DIFFRACT_EXPECT_ERROR(run(AsyncDiff{}, inputs(schedulers::SamplerKind::Euler, 3, 1, 5.0)), "device 1",
                          "simulated device failure");
    fail_rank_ = -1;
    SD3Denoiser sd3d(sd3(), sd3_pos_, sd3_neg_, 4.0, at::kFloat, c10::Device(c10::kCPU));
    QVERIFY(sd3d.stage_layers(16, 16).empty());
    DIFFRACT_EXPECT_ERROR(sd3d.stage_input(at::zeros({1, 4, 16, 16}), 1, Branch::Guided),
                          "cannot run AsyncDiff's sequential stages");
    QCOMPARE(make_strategy("asyncdiff", 3)->devices(), 3);
    QCOMPARE(make_strategy("asyncdiff", 3)->name(), std::string("asyncdiff"));
  }

  // --- AsyncDiff's stride denoising ---

  // (f) warmup >= steps: every step synchronous, the helpers idle, which is one device.
  void asyncdiffStrideSynchronousEqualsOneDevice() {
    for (int stride : {2, 3})
      for (double cfg : {5.0, 1.0})
        for (int n : {2, 3}) {
          auto in = inputs(schedulers::SamplerKind::DPMPP2M, 4, 1, cfg);
          const auto base = run(SingleDevice{}, in);
          AsyncDiff a;
          a.n = n;
          a.stride = stride;
          a.warmup = 4 + stride - 2;  // also past the steps
          QCOMPARE(a.devices(), n + stride - 1);
          const auto out = run(a, in);
          QCOMPARE(out.stats.devices, n + stride - 1);
          DIFFRACT_COMPARE_TENSORS(out.latents, base.latents, 1e-6);
          QVERIFY(out.stats.messages_per_step == std::vector<std::int64_t>(4, n));
          QCOMPARE(out.stats.rounds, 4);
          QCOMPARE(out.stats.evaluations, 4);
        }
  }

  // (g) Rounds on: the strategy equals the one-thread replay of the reference's scheme, differs
  // from stride 1 and stays near one device.
  void asyncdiffStrideMatchesSimulation() {
    struct Case {
      schedulers::SamplerKind kind;
      int n, stride, warmup;
      double cfg;
      bool xl;
    };
    for (const auto& k : {Case{schedulers::SamplerKind::Euler, 2, 2, 1, 5.0, false},
                          Case{schedulers::SamplerKind::DPMPP2M, 3, 2, 1, 5.0, false},
                          Case{schedulers::SamplerKind::Euler, 2, 2, 2, 1.0, false},  // a step reusing warm-up's eps
                          Case{schedulers::SamplerKind::DDIM, 4, 2, 3, 1.0, false},
                          Case{schedulers::SamplerKind::Euler, 3, 3, 2, 5.0, false},
                          Case{schedulers::SamplerKind::Euler, 2, 2, 1, 5.0, true},
                          Case{schedulers::SamplerKind::Euler, 3, 2, 1, 1.0, true}}) {
      const int steps = 6;
      auto in = inputs(k.kind, steps, 1, k.cfg, 7, k.xl ? sdxl() : unet_);
      AsyncDiff a;
      a.n = k.n;
      a.stride = k.stride;
      a.warmup = k.warmup;
      const auto out = run(a, in);
      const auto sim = simulate_asyncdiff_stride(in, k.xl ? sdxl() : unet_, k.n, k.stride, k.warmup, k.cfg);
      const auto what = QString("n %1 stride %2 warmup %3 cfg %4 xl %5").arg(k.n).arg(k.stride).arg(k.warmup).arg(k.cfg).arg(k.xl);
      QVERIFY2(test::max_abs_diff(out.latents, sim) < 1e-5,
               qPrintable(what + QString(": %1 from the replay").arg(test::max_abs_diff(out.latents, sim))));
      AsyncDiff one;
      one.n = k.n;
      one.warmup = k.warmup;
      QVERIFY2(test::max_abs_diff(run(one, in).latents, out.latents) > 1e-6, qPrintable(what + ": the same as stride 1"));
      const auto base = run(SingleDevice{}, in);
      const double rel = (out.latents - base.latents).norm().item<double>() / base.latents.norm().item<double>();
      QVERIFY2(rel > 1e-6 && rel < (k.n < 4 ? 0.5 : 2.0), qPrintable(what + QString(": rel L2 to one device %1").arg(rel)));
      QVERIFY(out.stats.note.find("one-round-stale") != std::string::npos);
      QCOMPARE(out.stats.strategy, "asyncdiff-stride" + std::to_string(k.stride));
    }
    // For 2 components the skip rules agree; for 3 they differ (and the producers' rule is the replay's).
    for (int n : {2, 3}) {
      auto in = inputs(schedulers::SamplerKind::Euler, 6, 1, 5.0);
      AsyncDiff a;
      a.n = n;
      a.stride = 2;
      const auto producers = run(a, in).latents;
      a.lineage_skips = true;
      const double d = test::max_abs_diff(run(a, in).latents, producers);
      QVERIFY2(n == 2 ? d < 1e-6 : d > 1e-6, qPrintable(QString("n %1: lineage differs by %2").arg(n).arg(d)));
    }
  }

  // (h) Messages per step, counted through the communicator, against the formula and by hand.
  void asyncdiffStrideMessagesPerStep() {
    struct Case {
      int n, stride, warmup, steps;
      std::vector<std::int64_t> expected;
    };
    for (const auto& k : {Case{3, 2, 1, 6, {4, 4, 1, 3, 1, 1}}, Case{2, 2, 2, 6, {2, 3, 0, 2, 1, 1}},
                          Case{2, 3, 1, 7, {4, 4, 1, 1, 1, 1, 1}}, Case{2, 2, 3, 7, {2, 2, 3, 3, 1, 1, 1}},
                          Case{3, 2, 1, 5, {4, 4, 1, 1, 1}}}) {
      auto in = inputs(schedulers::SamplerKind::Euler, k.steps, 1, 5.0);
      AsyncDiff a;
      a.n = k.n;
      a.stride = k.stride;
      a.warmup = k.warmup;
      const auto out = run(a, in);
      const auto what = QString("n %1 stride %2 warmup %3 steps %4").arg(k.n).arg(k.stride).arg(k.warmup).arg(k.steps);
      QVERIFY2(out.stats.messages_per_step == k.expected, qPrintable(what));
      std::int64_t bytes = 0;
      for (int i = 0; i < k.steps; ++i) {
        QCOMPARE(AsyncDiff::messages_per_step(i, k.steps, k.warmup, k.n, k.stride),
                 static_cast<int>(out.stats.messages_per_step[static_cast<std::size_t>(i)]));
        bytes += out.stats.bytes_per_step[static_cast<std::size_t>(i)];
      }
      QCOMPARE(out.stats.bytes_sent, bytes);
    }
    // Stride 1 through the general formula is the old one.
    for (int i = 0; i < 5; ++i) QCOMPARE(AsyncDiff::messages_per_step(i, 5, 2, 3, 1), AsyncDiff::messages_per_step(i, 5, 2, 3));
    QCOMPARE(AsyncDiff::first_group(6, 1, 2), 1);
    QCOMPARE(AsyncDiff::first_group(6, 2, 2), 3);
    QCOMPARE(AsyncDiff::first_group(6, 2, 3), 4);
    QCOMPARE(AsyncDiff::first_group(6, 9, 2), 6);
  }

  // (i) What a stride saves: component 0 (the latency chain's start) runs once a round, the last
  // component once a step, spread over rank n-1 and the helpers, at the steps' timesteps.
  void asyncdiffStrideRunsFewerRounds() {
    struct Call {
      int rank, begin;
      double t;
    };
    std::mutex m;
    std::vector<Call> calls;
    for (int stride : {1, 2, 3}) {
      const int steps = 6, n = 2;
      auto in = inputs(schedulers::SamplerKind::Euler, steps, 1, 5.0);
      calls.clear();
      const auto plain = in.make_denoiser;
      in.make_denoiser = [&, plain](int rank, const c10::Device& d) -> std::unique_ptr<Denoiser> {
        return std::make_unique<Counting>(plain(rank, d), evals_, false, [&m, &calls, rank](int begin, double t) {
          std::lock_guard<std::mutex> lock(m);
          calls.push_back({rank, begin, t});
        });
      };
      AsyncDiff a;
      a.n = n;
      a.stride = stride;
      const auto out = run(a, in);
      const auto ts = schedulers::Sampler::create(in.kind, in.config, steps)->timesteps();
      // Per rank, the timesteps (as step indices) it ran its component at.
      std::vector<std::vector<int>> at(static_cast<std::size_t>(n + stride - 1));
      for (const auto& c : calls) {
        const auto it = std::find(ts.begin(), ts.end(), c.t);
        QVERIFY(it != ts.end());
        at[static_cast<std::size_t>(c.rank)].push_back(static_cast<int>(it - ts.begin()));
      }
      using V = std::vector<int>;
      if (stride == 1) {
        QVERIFY(at[0] == (V{0, 1, 2, 3, 4, 5}) && at[1] == (V{0, 1, 2, 3, 4, 5}));
      } else if (stride == 2) {  // rounds (1, 2), (3, 4), (5)
        QVERIFY(at[0] == (V{0, 2, 4, 5}));
        QVERIFY(at[1] == (V{0, 2, 4, 5}));
        QVERIFY(at[2] == (V{1, 3}));
      } else {  // rounds (1, 2, 3), (4, 5)
        QVERIFY(at[0] == (V{0, 3, 5}));
        QVERIFY(at[1] == (V{0, 3, 5}));
        QVERIFY(at[2] == (V{1, 4}));
        QVERIFY(at[3] == (V{2}));
      }
      QCOMPARE(out.stats.rounds, static_cast<int>(at[0].size()));
      QCOMPARE(out.stats.rounds, 1 + (steps - 1 + stride - 1) / stride);
      QCOMPARE(out.stats.evaluations, steps);  // one eps a step, none reused
    }
  }

  // (j) Strides it cannot run, and the strategy's name form.
  void asyncdiffStrideRefusals() {
    auto in = inputs(schedulers::SamplerKind::Euler, 3, 1, 5.0);
    for (int bad : {0, -1}) {
      AsyncDiff a;
      a.stride = bad;
      QCOMPARE(a.devices(), 2);
      const auto named = "stride " + std::to_string(bad);
      DIFFRACT_EXPECT_ERROR(run(a, in), named.c_str(), "must be 1 or more");
    }
    AsyncDiff a;
    a.n = 1;
    a.stride = 2;
    DIFFRACT_EXPECT_ERROR(run(a, in), "needs 2 or more UNet components", "3 or more devices");
    a.n = 2;
    auto two = DeviceGroup::virtual_cpu(2);
    DIFFRACT_EXPECT_ERROR(a.run(*two, in), "asyncdiff-stride2 needs 3 device");
    DIFFRACT_EXPECT_ERROR(make_strategy("asyncdiff-stride2", 2), "needs 3 or more devices, not 2");
    DIFFRACT_EXPECT_ERROR(make_strategy("asyncdiff-stride3", 3), "needs 4 or more devices, not 3");
    for (const char* bad : {"asyncdiff-stride0", "asyncdiff-stride", "asyncdiff-stride-1", "asyncdiff-stridex"})
      DIFFRACT_EXPECT_ERROR(make_strategy(bad, 3), "whole number 1 or more");
    const auto s = make_strategy("asyncdiff-stride2", 4);
    QCOMPARE(s->devices(), 4);
    QCOMPARE(s->name(), std::string("asyncdiff-stride2"));
    const auto* ad = dynamic_cast<const AsyncDiff*>(s.get());
    QVERIFY(ad && ad->n == 3 && ad->stride == 2);
    QCOMPARE(make_strategy("asyncdiff-stride1", 3)->name(), std::string("asyncdiff"));
    QCOMPARE(make_strategy("asyncdiff-stride1", 3)->devices(), 3);
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
    QVERIFY(warm("driffusion-aggressive", 2) == (L{{5, Branch::Guided}, {5, Branch::Cond}}));  // paired rounds
    QVERIFY(warm("driffusion", 1) == (L{{5, Branch::Guided}}));
    QVERIFY(warm("cfg-driffusion", 4) == (L{{5, Branch::Cond}}));
    QVERIFY(warm("single", 1) == (L{{5, Branch::Guided}}));
    QVERIFY(warm("data-parallel", 2) == (L{{2, Branch::Guided}, {3, Branch::Guided}}));  // 5 rows: 3 + 2
    QVERIFY(warm("data-parallel", 5) == (L{{1, Branch::Guided}}));
    QVERIFY(warm("asyncdiff", 2).empty());  // no stages to warm on a denoiser that cannot split

    // A denoiser of 5 CFG rows that logs its calls and returns its input.
    struct Logging : Denoiser {
      std::vector<std::string> log;
      at::Tensor eval(const at::Tensor& x, double, Branch) override {
        log.push_back("eval");
        return x;
      }
      bool cfg() const override { return true; }
      double guidance_scale() const override { return 5; }
      std::int64_t batch() const override { return 5; }
      at::ScalarType output_dtype() const override { return at::kFloat; }
      std::unique_ptr<Denoiser> rows(std::int64_t, std::int64_t) const override { return nullptr; }
    };
    // Hybrid CFG also runs its stages once on a denoiser that can split, so that their first
    // calls never happen while the peer waits in NCCL.
    struct Staged final : Logging {
      int splits() const override { return 2; }
      models::UNetOuterState outer_down(const at::Tensor& x, double, Branch, int s) override {
        log.push_back("outer_down " + std::to_string(s));
        models::UNetOuterState st;
        st.h = x;
        return st;
      }
      at::Tensor inner(const at::Tensor& h, double, Branch, int s) override {
        log.push_back("inner " + std::to_string(s));
        return h;
      }
      at::Tensor outer_up(models::UNetOuterState, const at::Tensor& i, Branch, int s) override {
        log.push_back("outer_up " + std::to_string(s));
        return i;
      }
    };
    Staged staged;
    make_strategy("hybrid-cfg", 2)->warm(staged, x, 999);
    QVERIFY(staged.log == (std::vector<std::string>{"eval", "outer_down 2", "inner 2", "outer_up 2"}));

    // AsyncDiff runs every component once, chained, guided (its loop never calls eval()).
    struct Sequential final : Logging {
      std::vector<models::UNetLayerInfo> stage_layers(std::int64_t, std::int64_t) const override {
        return std::vector<models::UNetLayerInfo>(6, models::UNetLayerInfo{"layer", 1, 1.0});
      }
      models::UNetStageState stage_input(const at::Tensor& x, double, Branch b) override {
        log.push_back(b == Branch::Guided ? "input guided" : "input one branch");
        models::UNetStageState s;
        s.h = x;
        return s;
      }
      at::Tensor stage_output(const models::UNetStageState& s, Branch) override {
        log.push_back("output");
        return s.h;
      }
      std::vector<std::vector<std::int64_t>> stage_shapes(int layer, std::int64_t, std::int64_t, Branch) const override {
        return {{10, 4, 8, 8}, std::vector<std::int64_t>{10, 2, 8, static_cast<std::int64_t>(layer)}};
      }
      void run_stage(models::UNetStageState& s, int begin, int end, double, Branch) override {
        if (!s.skips.empty())  // warm_rank's zero state of the shapes the rank receives in the loop
          log.push_back("state " + std::to_string(s.skips.size()) + " skip(s), width " +
                        std::to_string(s.skips.back().size(3)) + ", rows " + std::to_string(s.h.size(0)) +
                        (s.h.abs().sum().item<double>() == 0 ? ", zero" : ", not zero"));
        log.push_back("stage " + std::to_string(begin) + ".." + std::to_string(end));
      }
    };
    Sequential seq;
    make_strategy("asyncdiff", 3)->warm(seq, x, 999);
    QVERIFY(seq.log == (std::vector<std::string>{"input guided", "stage 0..2", "stage 2..4", "stage 4..6", "output"}));
    // Per rank (what the pipeline calls): each rank its own component only, on the state it
    // receives in the loop, so that it captures one stage graph, not n.
    using S = std::vector<std::string>;
    const S per_rank[] = {{"input guided", "stage 0..2"},
                          {"state 1 skip(s), width 2, rows 10, zero", "stage 2..4"},
                          {"state 1 skip(s), width 4, rows 10, zero", "stage 4..6", "output"}};
    for (int r = 0; r < 3; ++r) {
      Sequential one;
      make_strategy("asyncdiff", 3)->warm_rank(one, x, 999, r);
      QVERIFY(one.log == per_rank[r]);
    }
    // With a stride the extra ranks run the last component, and warm only it.
    for (int r = 0; r < 4; ++r) {
      Sequential one;
      make_strategy("asyncdiff-stride2", 4)->warm_rank(one, x, 999, r);
      QVERIFY(one.log == per_rank[std::min(r, 2)]);
    }
    // Strategies whose ranks run alike warm every rank as warm() does.
    Staged staged1;
    make_strategy("hybrid-cfg", 2)->warm_rank(staged1, x, 999, 1);
    QVERIFY(staged1.log == staged.log);
  }

  // --- SD3: the denoiser and PipeFusion on a tiny random MMDiT (4 blocks, qk norm, SD3.5's
  // second attention in blocks 0 and 1, 16x16 latents of 8x8 tokens) ---

  // A block pass over a patch with the cache holding this step's K/V of every other patch is
  // the whole-image pass on those tokens; a pass over the whole image is forward() itself.
  void sd3PatchPassesAreExact() {
    at::NoGradGuard no_grad;
    auto& model = sd3();
    at::Generator g = at::detail::createCPUGenerator(2);
    const auto x = at::randn({2, 4, 16, 16}, g);
    const auto ctx = at::randn({2, 6, 24}, g), pooled = at::randn({2, 12}, g);
    const auto t = at::tensor({700.0f, 300.0f});
    const auto full = model->forward(x, ctx, pooled, t);
    auto s = model->embed(x, ctx, pooled, t);
    std::vector<models::SD3BlockCache> caches(4);
    std::vector<models::SD3State> per_block;  // the whole image's state before each block
    for (std::size_t l = 0; l < 4; ++l) {
      per_block.push_back(s);
      model->run_block(l, s, caches[l], 0);
    }
    QVERIFY(at::equal(model->unpatchify_output(s), full));
    // Rows 4..8 of the latent (token rows 2..4: tokens 16..32) through block 1 with fresh caches.
    const auto pe = model->pos_embed->forward_rows(x.narrow(2, 4, 4), 4, 16);
    DIFFRACT_COMPARE_TENSORS(pe, model->pos_embed->forward(x).narrow(1, 16, 16), 1e-6);
    auto patch = per_block[1];
    patch.x = per_block[1].x.narrow(1, 16, 16);
    patch.height = 4;
    auto whole = per_block[1];
    model->run_block(1, whole);
    model->run_block(1, patch, caches[1], 16);
    DIFFRACT_COMPARE_TENSORS(patch.x, whole.x.narrow(1, 16, 16), 1e-5);
    DIFFRACT_EXPECT_ERROR(model->pos_embed->forward_rows(x.narrow(2, 3, 4), 3, 16), "whole patches");
  }

  void sd3DenoiserBranches() {
    auto in = sd3_inputs(2, 2, 4.0);
    auto d = in.make_denoiser(0, c10::Device(c10::kCPU));
    QVERIFY(d->cfg());
    QCOMPARE(d->splits(), 0);
    at::NoGradGuard no_grad;
    const auto x = in.latents;
    const auto c = d->eval(x, 500, Branch::Cond), u = d->eval(x, 500, Branch::Uncond);
    DIFFRACT_COMPARE_TENSORS(d->eval(x, 500, Branch::Guided), combine_cfg(u, c, 4.0), 1e-5);
    const auto t = at::full({2}, 500.0, at::kFloat);
    QVERIFY(at::equal(c, sd3()->forward(x, sd3_pos_.context, sd3_pos_.pooled, t)));
    DIFFRACT_COMPARE_TENSORS(d->rows(1, 1)->eval(x.narrow(0, 1, 1), 500, Branch::Guided),
                             d->eval(x, 500, Branch::Guided).narrow(0, 1, 1), 1e-5);
    DIFFRACT_EXPECT_ERROR(d->outer_down(x, 500, Branch::Cond, 1), "cannot run the layer-split stages");
    auto no_cfg = sd3_inputs(2, 1, 1.0).make_denoiser(0, c10::Device(c10::kCPU));
    QVERIFY(!no_cfg->cfg());
    DIFFRACT_EXPECT_ERROR(no_cfg->eval(x.narrow(0, 0, 1), 500, Branch::Uncond), "without CFG");
  }

  // Staleness off (every step synchronous): one device's result.
  void pipefusionSynchronousEqualsOneDevice() {
    for (double cfg : {1.0, 4.0}) {
      auto in = sd3_inputs(4, 1, cfg);
      const auto base = run(SingleDevice{}, in);
      for (auto [n, m] : {std::pair{2, 2}, std::pair{2, 4}, std::pair{4, 4}}) {
        PipeFusion pf;
        pf.n = n;
        pf.patches = m;
        pf.warmup_steps = 4;
        const auto out = run(pf, in);
        DIFFRACT_COMPARE_TENSORS(out.latents, base.latents, 1e-6);
        QCOMPARE(out.stats.messages_per_step, std::vector<std::int64_t>(4, n));
      }
    }
  }

  // Staleness on: the strategy is the one-thread simulation of the same algorithm, near one device.
  void pipefusionMatchesSimulation() {
    for (double cfg : {1.0, 4.0}) {
      for (auto [n, m, warm] : {std::tuple{2, 2, 1}, std::tuple{2, 4, 1}, std::tuple{3, 4, 2}, std::tuple{1, 2, 1},
                                std::tuple{4, 4, 1}}) {
        const int steps = 5;
        auto in = sd3_inputs(steps, 1, cfg);
        std::vector<int> reported;
        in.on_step = [&](int i, const at::Tensor& out, const at::Tensor& before, const at::Tensor& after) {
          reported.push_back(i);
          QCOMPARE(out.sizes(), before.sizes());
          QCOMPARE(after.sizes(), before.sizes());
        };
        PipeFusion pf;
        pf.n = n;
        pf.patches = m;
        pf.warmup_steps = warm;
        const auto out = run(pf, in);
        const auto sim = simulate_pipefusion(in, m, warm, cfg);
        DIFFRACT_COMPARE_TENSORS(out.latents, sim, 1e-5);
        QCOMPARE(reported, (std::vector<int>{0, 1, 2, 3, 4}));
        const auto base = run(SingleDevice{}, in).latents;
        const double rel = ((out.latents - base).norm() / base.norm()).item<double>();
        qInfo("pipefusion n=%d M=%d warm-up %d cfg %.0f: relative L2 to one device %.3g", n, m, warm, cfg, rel);
        QVERIFY(rel > 0 && rel < 0.2);

        // Messages per step (the header's formula) and their bytes.
        const std::int64_t rows_b = cfg > 1 ? 2 : 1, tokens = 64, text = 6, dim = 16, f = 4;
        const std::int64_t v_bytes = 1 * 4 * 16 * 16 * f;
        for (int i = 0; i < steps; ++i) {
          const bool sync = i < warm;
          const auto got = out.stats.messages_per_step[static_cast<std::size_t>(i)];
          QCOMPARE(got, static_cast<std::int64_t>(PipeFusion::messages_per_step(sync, n, m)));
          QCOMPARE(got, static_cast<std::int64_t>(n < 2 ? 0 : sync ? n : m * n));
          const std::int64_t act = sync ? rows_b * (tokens + text) * dim * f : m * rows_b * (tokens / m + text) * dim * f;
          QCOMPARE(out.stats.bytes_per_step[static_cast<std::size_t>(i)], n < 2 ? 0 : (n - 1) * act + v_bytes);
        }
        std::int64_t sum = 0;
        for (auto b : out.stats.bytes_per_step) sum += b;
        QCOMPARE(out.stats.bytes_sent, sum);
        // Every stage holds its blocks and the timestep embedder; only the ends the rest.
        std::int64_t total = 0;
        for (const auto& t : sd3()->parameters()) total += t.numel();
        for (const auto& t : sd3()->buffers()) total += t.numel();
        QCOMPARE(static_cast<int>(out.stats.weights_per_rank.size()), n);
        for (auto w : out.stats.weights_per_rank) QVERIFY(n == 1 ? w == total : w < total);
      }
    }
  }

  void pipefusionRefusesWhatItCannotSplit() {
    auto in = sd3_inputs(3, 1, 4.0);
    auto expect = [&](int n, int m, const char* what) {
      PipeFusion pf;
      pf.n = n;
      pf.patches = m;
      DIFFRACT_EXPECT_ERROR(run(pf, in), what);
    };
    expect(2, 1, "1 patches for 2 stages");
    expect(5, 8, "5 stages for a transformer of 4 blocks");
    expect(2, 3, "8 rows of transformer patches");
    PipeFusion pf;
    pf.warmup_steps = 0;
    DIFFRACT_EXPECT_ERROR(run(pf, in), "1 or more synchronous warm-up steps");
    in.kind = schedulers::SamplerKind::DPMPP2M;
    DIFFRACT_EXPECT_ERROR(run(PipeFusion{}, in), "without history or noise");
    // A UNet has no joint blocks.
    DIFFRACT_EXPECT_ERROR(run(PipeFusion{}, inputs(schedulers::SamplerKind::Euler, 2, 1, 5.0)), "(SD3, Flux)",
                          "this model has none");
    QVERIFY(PipeFusion::uses_weight("transformer_blocks.1.attn.to_q.weight", 0, 2, 4));
    QVERIFY(!PipeFusion::uses_weight("transformer_blocks.2.attn.to_q.weight", 0, 2, 4));
    QVERIFY(PipeFusion::uses_weight("pos_embed.pos_embed", 0, 2, 4) && !PipeFusion::uses_weight("pos_embed.pos_embed", 1, 2, 4));
    QVERIFY(PipeFusion::uses_weight("proj_out.weight", 1, 2, 4) && !PipeFusion::uses_weight("proj_out.weight", 0, 2, 4));
    QVERIFY(PipeFusion::uses_weight("time_text_embed.text_embedder.linear_1.weight", 1, 2, 4));
    QCOMPARE(PipeFusion::stage_blocks(2, 3, 4), (std::pair<int, int>{2, 4}));
  }

  void strategyFactoryAndDeviceChecks() {
    QCOMPARE(make_strategy("driffusion-aggressive", 4)->devices(), 4);
    QCOMPARE(make_strategy("cfg-parallel", 4)->devices(), 2);
    DIFFRACT_EXPECT_ERROR(make_strategy("tensor-parallel", 2), "unknown strategy", "pipefusion");
    QCOMPARE(make_strategy("pipefusion", 2)->devices(), 2);
    QCOMPARE(dynamic_cast<PipeFusion&>(*make_strategy("pipefusion", 2, 4)).patch_count(), 4);
    QCOMPARE(dynamic_cast<PipeFusion&>(*make_strategy("pipefusion", 3)).patch_count(), 3);
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
