#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>

#include "core/models/common/attention.h"
#include "core/models/common/layers.h"
#include "core/models/common/patch_parallel.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/parallel/communicator.h"
#include "core/parallel/distrifusion.h"
#include "core/parallel/device_group.h"
#include "core/parallel/strategies.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/util/error.h"
#include "test_util.h"
#include "loop_inputs.h"

using namespace diffract;
using namespace diffract::parallel;

namespace {

// Rows [r h, (r + 1) h) of dim `dim` split n ways.
at::Tensor band(const at::Tensor& x, int r, int n, int dim = 2) {
  const auto h = x.size(dim) / n;
  return x.narrow(dim, r * h, h);
}

double rel_l2(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() / b.to(at::kDouble).norm().item<double>();
}

// A band context answering from fixed tables: the layer-level tests' "fresh neighbours".
class Fixed final : public models::BandContext {
 public:
  Fixed(int rank, std::vector<at::Tensor> values) : BandContext(rank, static_cast<int>(values.size())), values_(std::move(values)) {}
  std::vector<at::Tensor> exchange(const at::Tensor& mine) override {
    ++calls;
    auto all = values_;
    all[static_cast<std::size_t>(rank_)] = mine;
    return all;
  }
  int calls = 0;

 private:
  std::vector<at::Tensor> values_;
};

// Runs the whole image on one thread and writes down what each of n bands would contribute to
// every hooked layer call: table[call][band]. The layers run whole (no context inside).
class Recorder final : public models::PatchContext {
 public:
  Recorder(int n, std::vector<std::vector<at::Tensor>>& table) : n_(n), table_(table) { table_.clear(); }
  at::Tensor conv2d(models::Conv2dImpl& conv, const at::Tensor& x) override {
    record([&](int b) { return models::conv_halo(band(x, b, n_), conv.options.padding_); });
    const models::PatchScope none(nullptr);
    return conv.forward(x);
  }
  at::Tensor group_norm(models::GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add, bool silu) override {
    const auto in = add.defined() ? x + add.view({add.size(0), add.size(1), 1, 1}) : x;
    record([&](int b) { return models::group_stats(band(in, b, n_), norm.options.groups); });
    const models::PatchScope none(nullptr);
    return norm.forward(x, add, silu);
  }
  std::pair<at::Tensor, at::Tensor> self_attention_kv(const at::Tensor& k, const at::Tensor& v) override {
    record([&](int b) { return models::kv_pack(band(k, b, n_, 1), band(v, b, n_, 1)); });
    return {k, v};
  }

 private:
  template <class F>
  void record(F f) {
    std::vector<at::Tensor> row;
    for (int b = 0; b < n_; ++b) row.push_back(f(b));
    table_.push_back(std::move(row));
  }
  int n_;
  std::vector<std::vector<at::Tensor>>& table_;
};

// Band `rank` at a stale step: the other bands' contributions from `before`, its own written
// into `now`.
class StaleBand final : public models::BandContext {
 public:
  StaleBand(int rank, int n, const std::vector<std::vector<at::Tensor>>& before, std::vector<std::vector<at::Tensor>>& now)
      : BandContext(rank, n), before_(before), now_(now) {}
  std::vector<at::Tensor> exchange(const at::Tensor& mine) override {
    const auto layer = static_cast<std::size_t>(calls_++);
    auto all = before_.at(layer);
    all[static_cast<std::size_t>(rank_)] = mine;
    if (now_.size() <= layer) now_.resize(layer + 1, std::vector<at::Tensor>(static_cast<std::size_t>(size_)));
    now_[layer][static_cast<std::size_t>(rank_)] = mine;
    return all;
  }

 private:
  int calls_ = 0;
  const std::vector<std::vector<at::Tensor>>& before_;
  std::vector<std::vector<at::Tensor>>& now_;
};

// A denoiser that passes every call to `inner` (the failing ones below change run_stage).
class Forwarding : public Denoiser {
 public:
  explicit Forwarding(std::unique_ptr<Denoiser> inner) : inner_(std::move(inner)) {}
  at::Tensor eval(const at::Tensor& x, double t, Branch b) override { return inner_->eval(x, t, b); }
  bool cfg() const override { return inner_->cfg(); }
  double guidance_scale() const override { return inner_->guidance_scale(); }
  std::int64_t batch() const override { return inner_->batch(); }
  at::ScalarType output_dtype() const override { return inner_->output_dtype(); }
  std::unique_ptr<Denoiser> rows(std::int64_t, std::int64_t) const override { return nullptr; }
  std::vector<models::UNetLayerInfo> stage_layers(std::int64_t h, std::int64_t w) const override {
    return inner_->stage_layers(h, w);
  }
  models::UNetStageState stage_input(const at::Tensor& x, double t, Branch b) override { return inner_->stage_input(x, t, b); }
  void run_stage(models::UNetStageState& s, int begin, int end, double t, Branch b) override {
    inner_->run_stage(s, begin, end, t, b);
  }
  at::Tensor stage_output(const models::UNetStageState& s, Branch b) override { return inner_->stage_output(s, b); }

 protected:
  std::unique_ptr<Denoiser> inner_;
};

// A UNet denoiser whose stage run throws on one rank from its `after`-th call on.
class Failing final : public Forwarding {
 public:
  Failing(std::unique_ptr<Denoiser> inner, bool fail, int after) : Forwarding(std::move(inner)), fail_(fail), after_(after) {}
  void run_stage(models::UNetStageState& s, int begin, int end, double t, Branch b) override {
    if (fail_ && calls_++ >= after_) throw Error("simulated device failure");
    inner_->run_stage(s, begin, end, t, b);
  }

 private:
  bool fail_;
  int after_, calls_ = 0;
};

// A UNet denoiser that, on one rank, throws at hooked layer call `call` of its `evaluation`-th
// evaluation: between two buckets' gathers of a stale step, while the other ranks have theirs
// in flight.
class FailingInLayer final : public Forwarding {
 public:
  FailingInLayer(std::unique_ptr<Denoiser> inner, bool fail, int evaluation, int call)
      : Forwarding(std::move(inner)), fail_(fail), evaluation_(evaluation), call_(call) {}
  void run_stage(models::UNetStageState& s, int begin, int end, double t, Branch b) override {
    if (!fail_ || evaluations_++ != evaluation_) return inner_->run_stage(s, begin, end, t, b);
    Thrower thrower(models::patch_context(), call_);
    const models::PatchScope scope(&thrower);
    inner_->run_stage(s, begin, end, t, b);
  }

 private:
  class Thrower final : public models::PatchContext {
   public:
    Thrower(models::PatchContext* inner, int at) : inner_(inner), at_(at) {}
    at::Tensor conv2d(models::Conv2dImpl& conv, const at::Tensor& x) override {
      tick();
      return inner_->conv2d(conv, x);
    }
    at::Tensor group_norm(models::GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add, bool silu) override {
      tick();
      return inner_->group_norm(norm, x, add, silu);
    }
    std::pair<at::Tensor, at::Tensor> self_attention_kv(const at::Tensor& k, const at::Tensor& v) override {
      tick();
      return inner_->self_attention_kv(k, v);
    }

   private:
    void tick() {
      if (calls_++ == at_) throw Error("simulated device failure in a layer");
    }
    models::PatchContext* inner_;
    int at_, calls_ = 0;
  };
  bool fail_;
  int evaluation_, call_, evaluations_ = 0;
};

}  // namespace

class TestDistriFusion : public QObject {
  Q_OBJECT

  models::UNet2DConditionModel unet_{nullptr}, sdxl_{nullptr};
  models::UNetConditioning pos_, neg_;  // the last inputs()' conditioning

  // `model`: the tiny SD UNet when null (the tiny SDXL one gets pooled text and time ids too).
  LoopInputs inputs(schedulers::SamplerKind kind, int steps, int batch, double cfg, models::UNet2DConditionModel model,
                    std::int64_t side = 0) {
    auto made = test::unet_loop_inputs(kind, steps, batch, model, 7, side);
    pos_ = made.pos;
    neg_ = made.neg;
    auto in = made.in;
    const auto unet = made.unet;
    const auto pos = made.pos, neg = made.neg;
    in.make_denoiser = [unet, pos, neg, cfg](int, const c10::Device& d) -> std::unique_ptr<Denoiser> {
      return std::make_unique<UNetDenoiser>(unet, pos, neg, cfg, at::kFloat, d);
    };
    return in;
  }

  LoopOutput run(const Strategy& s, const LoopInputs& in) {
    auto group = DeviceGroup::virtual_cpu(s.devices());
    return s.run(*group, in);
  }

  models::UNet2DConditionModel sdxl() {
    if (!sdxl_) {
      sdxl_ = models::load_unet_2d_condition(test::fixtures() / "tiny-sdxl" / "unet");
      sdxl_->eval();
    }
    return sdxl_;
  }

  models::UNetConditioning guided(double scale) const {
    if (scale <= 1) return pos_;
    models::UNetConditioning c;
    c.encoder_hidden_states = at::cat({neg_.encoder_hidden_states, pos_.encoder_hidden_states});
    if (pos_.text_embeds.defined()) {
      c.text_embeds = at::cat({neg_.text_embeds, pos_.text_embeds});
      c.time_ids = at::cat({neg_.time_ids, pos_.time_ids});
    }
    return c;
  }

  // DistriFusion as its header describes it, in one thread, on the UNet directly, sharing none
  // of the strategy's loop, threads or communicator: a synchronous step runs the whole image
  // (one device) and writes down every band's contribution to every hooked layer call; a stale
  // step runs the bands one after the other, each with the other bands' contributions of the
  // step before and its own fresh. pos_ / neg_ as inputs() left them.
  at::Tensor simulate(const LoopInputs& in, models::UNet2DConditionModel u, int n, int warmup, double scale) {
    at::NoGradGuard no_grad;
    auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);
    at::Generator gen = in.generator.clone();
    const bool cfg = scale > 1;
    const auto c = guided(scale);
    std::vector<std::vector<at::Tensor>> table;
    auto x = in.latents.clone();
    for (int i = 0; i < in.steps; ++i) {
      const auto x1 = sampler->scale_model_input(x, i);
      const auto xin = cfg ? at::cat({x1, x1}) : x1;
      const auto t = at::full({xin.size(0)}, sampler->timesteps()[static_cast<std::size_t>(i)], at::kFloat);
      at::Tensor out;
      if (i < warmup) {
        Recorder rec(n, table);
        const models::PatchScope scope(&rec);
        out = u->forward(xin, t, c);
      } else {
        std::vector<std::vector<at::Tensor>> now;
        std::vector<at::Tensor> bands;
        for (int b = 0; b < n; ++b) {
          StaleBand ctx(b, n, table, now);
          const models::PatchScope scope(&ctx);
          bands.push_back(u->forward(band(xin, b, n).contiguous(), t, c));
        }
        out = at::cat(bands, 2);
        table = now;
      }
      at::Tensor eps = out;
      if (cfg) {
        auto parts = out.chunk(2);
        eps = parts[0] + scale * (parts[1] - parts[0]);
      }
      x = sampler->step(eps, i, x, gen);
    }
    return x;
  }

  // The hooked layer calls of one evaluation and each call's contribution per band, by the
  // Recorder (the UNet's own count, not the strategy's).
  std::vector<std::vector<at::Tensor>> record_layers(models::UNet2DConditionModel u, const at::Tensor& x, double scale, int n) {
    at::NoGradGuard no_grad;
    const auto xin = scale > 1 ? at::cat({x, x}) : x;
    std::vector<std::vector<at::Tensor>> table;
    Recorder rec(n, table);
    const models::PatchScope scope(&rec);
    u->forward(xin, at::full({xin.size(0)}, 500.0, at::kFloat), guided(scale));
    return table;
  }

  models::SD3Transformer2DModel sd3_{nullptr};
  models::SD3Transformer2DModel& sd3() {
    if (!sd3_) sd3_ = test::tiny_sd3(2, /*sd35=*/false);
    return sd3_;
  }

 private slots:
  void initTestCase() {
    unet_ = models::load_unet_2d_condition(test::fixtures() / "tiny-sd" / "unet");
    unet_->eval();
  }

  // (1) The patch-aware layers on bands with fresh neighbours equal the whole-tensor layers,
  // through the layers' own hooks.
  void layersOnBandsEqualWholeLayers() {
    at::NoGradGuard no_grad;
    at::Generator g = at::detail::createCPUGenerator(3);
    for (int n : {2, 4}) {
      const auto x = at::randn({2, 8, 16, 12}, g);
      for (std::int64_t stride : {1, 2}) {
        models::Conv2d conv(models::Conv2dOptions(8, 6, 3).stride(stride).padding(1));
        models::init_random(*conv, at::detail::createCPUGenerator(5));
        const auto whole = conv->forward(x);
        std::vector<at::Tensor> halos;
        for (int b = 0; b < n; ++b) halos.push_back(models::conv_halo(band(x, b, n), 1));
        std::vector<at::Tensor> parts;
        for (int b = 0; b < n; ++b) {
          Fixed ctx(b, halos);
          const models::PatchScope scope(&ctx);
          parts.push_back(conv->forward(band(x, b, n)));
          QCOMPARE(ctx.calls, 1);
        }
        DIFFRACT_COMPARE_TENSORS(at::cat(parts, 2), whole, 1e-5);
      }
      // A 1x1 convolution never asks.
      models::Conv2d pointwise(models::Conv2dOptions(8, 4, 1));
      models::init_random(*pointwise, at::detail::createCPUGenerator(6));
      Fixed none(0, std::vector<at::Tensor>(static_cast<std::size_t>(n)));
      {
        const models::PatchScope scope(&none);
        pointwise->forward(band(x, 0, n));
      }
      QCOMPARE(none.calls, 0);

      models::GroupNorm norm(models::GroupNormOptions(4, 8));
      norm->weight.uniform_(0.5, 1.5, g);
      norm->bias.uniform_(-0.5, 0.5, g);
      const auto add = at::randn({2, 8}, g);
      for (bool silu : {false, true}) {
        const auto shifted = x * 3 + 2;  // a mean far from 0
        const auto whole = norm->forward(shifted, add, silu);
        std::vector<at::Tensor> stats;
        for (int b = 0; b < n; ++b)
          stats.push_back(models::group_stats(band(shifted, b, n) + add.view({2, 8, 1, 1}), 4));
        std::vector<at::Tensor> parts;
        for (int b = 0; b < n; ++b) {
          Fixed ctx(b, stats);
          const models::PatchScope scope(&ctx);
          parts.push_back(norm->forward(band(shifted, b, n), add, silu));
        }
        DIFFRACT_COMPARE_TENSORS(at::cat(parts, 2), whole, 1e-5);
        // bf16 activations (as on GPUs): fp32 statistics, scale and shift, the output in bf16
        // within bf16's rounding of the fp32 layer.
        const auto add16 = add.to(at::kBFloat16);
        std::vector<at::Tensor> stats16, parts16;
        for (int b = 0; b < n; ++b)
          stats16.push_back(models::group_stats(band(shifted, b, n).to(at::kBFloat16) + add16.view({2, 8, 1, 1}), 4));
        for (int b = 0; b < n; ++b) {
          Fixed ctx(b, stats16);
          const models::PatchScope scope(&ctx);
          parts16.push_back(norm->forward(band(shifted, b, n).to(at::kBFloat16), add16, silu));
          QCOMPARE(parts16.back().scalar_type(), at::kBFloat16);
        }
        DIFFRACT_COMPARE_TENSORS(at::cat(parts16, 2).to(at::kFloat), whole, 0.1);
      }

      // Self-attention on [B, T, C] tokens (row-major, so a band of rows is a run of tokens);
      // cross-attention never asks.
      models::AttentionOptions o;
      o.query_dim = 16;
      o.heads = 2;
      o.dim_head = 8;
      models::Attention attn(o);
      models::init_random(*attn, at::detail::createCPUGenerator(8));
      const auto tokens = at::randn({2, 32, 16}, g);
      const auto whole = attn->forward(tokens);
      std::vector<at::Tensor> kv;
      for (int b = 0; b < n; ++b) {
        const auto tb = band(tokens, b, n, 1);
        kv.push_back(models::kv_pack(attn->to_k->forward(tb), attn->to_v->forward(tb)));
      }
      std::vector<at::Tensor> parts;
      for (int b = 0; b < n; ++b) {
        Fixed ctx(b, kv);
        const models::PatchScope scope(&ctx);
        parts.push_back(attn->forward(band(tokens, b, n, 1)));
      }
      DIFFRACT_COMPARE_TENSORS(at::cat(parts, 1), whole, 1e-5);
      models::AttentionOptions co = o;
      co.cross_attention_dim = 12;
      models::Attention cross(co);
      models::init_random(*cross, at::detail::createCPUGenerator(9));
      Fixed unused(0, kv);
      {
        const models::PatchScope scope(&unused);
        cross->forward(band(tokens, 0, n, 1), at::randn({2, 5, 12}, g));
      }
      QCOMPARE(unused.calls, 0);
    }
    QVERIFY(models::patch_context() == nullptr);  // every scope restored
  }

  // (2) Every step synchronous (warmup >= steps) is one device: the bands' layers see their
  // neighbours' fresh values, so only fp32 rounding differs (band-shaped convolution / GEMM
  // blocking, GroupNorm statistics combined from the bands'). rel-L2 < 1e-5 over 4 steps (the
  // differences are ~1e-7 per op and the tiny UNets do not amplify them).
  void synchronousEqualsOneDevice() {
    struct Case {
      int n;
      double cfg;
      bool xl;
      schedulers::SamplerKind kind;
    };
    for (const auto& k : {Case{2, 5.0, false, schedulers::SamplerKind::Euler}, Case{4, 5.0, false, schedulers::SamplerKind::DPMPP2M},
                          Case{2, 1.0, false, schedulers::SamplerKind::DDIM}, Case{4, 1.0, false, schedulers::SamplerKind::Euler},
                          Case{2, 5.0, true, schedulers::SamplerKind::Euler}, Case{4, 1.0, true, schedulers::SamplerKind::Euler},
                          Case{4, 5.0, true, schedulers::SamplerKind::EulerAncestral},
                          Case{8, 5.0, false, schedulers::SamplerKind::Euler}}) {  // 8: issue 9's largest group
      auto in = inputs(k.kind, 4, 1, k.cfg, k.xl ? sdxl() : unet_);
      const auto base = run(SingleDevice{}, in);
      DistriFusion d;
      d.n = k.n;
      d.warmup = 4;
      const auto out = run(d, in);
      const double rel = rel_l2(out.latents, base.latents);
      const auto what = QString("n %1 cfg %2 xl %3: rel L2 %4").arg(k.n).arg(k.cfg).arg(k.xl).arg(rel);
      qInfo("%s", qPrintable(what));
      QVERIFY2(rel < 1e-5, qPrintable(what));
      QCOMPARE(out.stats.rounds, 4);
      QCOMPARE(out.stats.evaluations, 4 * k.n);
      QVERIFY(out.stats.note.find("4 synchronous step(s), then 0 one-step-stale") != std::string::npos);
    }
  }

  // (3) Stale steps: the strategy equals the one-thread simulation above; (4) it moves away
  // from one device, not far.
  void staleMatchesSimulation() {
    struct Case {
      int n, warmup;
      double cfg;
      bool xl;
      schedulers::SamplerKind kind;
    };
    for (const auto& k : {Case{2, 1, 5.0, false, schedulers::SamplerKind::Euler}, Case{4, 2, 5.0, false, schedulers::SamplerKind::DPMPP2M},
                          Case{2, 2, 1.0, false, schedulers::SamplerKind::DDIM}, Case{4, 1, 1.0, false, schedulers::SamplerKind::Euler},
                          Case{2, 1, 5.0, true, schedulers::SamplerKind::Euler}, Case{4, 2, 1.0, true, schedulers::SamplerKind::Euler},
                          Case{8, 1, 5.0, false, schedulers::SamplerKind::Euler}}) {
      const int steps = 6;
      auto in = inputs(k.kind, steps, 1, k.cfg, k.xl ? sdxl() : unet_);
      DistriFusion d;
      d.n = k.n;
      d.warmup = k.warmup;
      const auto out = run(d, in);
      const auto sim = simulate(in, k.xl ? sdxl() : unet_, k.n, k.warmup, k.cfg);
      const auto base = run(SingleDevice{}, in);
      const double to_sim = rel_l2(out.latents, sim), to_one = rel_l2(out.latents, base.latents);
      const auto what = QString("n %1 warmup %2 cfg %3 xl %4: rel L2 to the simulation %5, to one device %6")
                            .arg(k.n).arg(k.warmup).arg(k.cfg).arg(k.xl).arg(to_sim).arg(to_one);
      qInfo("%s", qPrintable(what));
      QVERIFY2(to_sim < 1e-5, qPrintable(what));
      QVERIFY2(to_one > 100 * std::max(to_sim, 1e-7) && to_one < 0.3, qPrintable(what));
      QVERIFY(out.stats.note.find(std::to_string(steps - k.warmup) + " one-step-stale") != std::string::npos);
    }
  }

  // (4) Messages and bytes per step as the header counts them: in a synchronous step every rank
  // contributes once to each hooked layer call's all_gather and to eps's; in a stale step once
  // to each bucket's asynchronous all_gather (min(buckets, L) of them, every hooked layer call's
  // contribution in one) and to eps's; eps alone in a stale last step. The buckets' bytes are
  // the per-layer gathers' (fp32: no padding).
  void messagesPerStep() {
    struct Case {
      bool xl;
      int n, buckets;
    };
    for (const auto& k : {Case{false, 2, 1}, Case{false, 2, 3}, Case{false, 2, 8}, Case{false, 2, 1000}, Case{false, 4, 3},
                          Case{true, 2, 8}, Case{true, 4, 8}}) {
      const bool xl = k.xl;
      const int n = k.n, buckets = k.buckets;
      const int steps = 5, warmup = 2;
      const double scale = 5.0;
      auto in = inputs(schedulers::SamplerKind::Euler, steps, 1, scale, xl ? sdxl() : unet_);
      DistriFusion d;
      d.n = n;
      d.warmup = warmup;
      d.buckets = buckets;
      const auto out = run(d, in);
      const auto table = record_layers(xl ? sdxl() : unet_, in.latents, scale, n);
      const int layers = static_cast<int>(table.size());
      std::int64_t layer_bytes = 0;
      int convs = 0, norms = 0, kvs = 0;
      for (const auto& row : table) {
        for (const auto& t : row) layer_bytes += static_cast<std::int64_t>(t.nbytes());
        const auto& t = row.front();
        if (t.dim() == 4) ++convs;  // halo rows [2B, C, 2, W]
        else if (t.size(2) == (xl ? sdxl() : unet_)->config.norm_num_groups) ++norms;  // [2, 2B, G]; K / V: [2B, t, 2C]
      }
      kvs = layers - convs - norms;
      QVERIFY(convs > 0 && norms > 0);
      // Transformer blocks: SD 2 down + 1 mid + 3 up; SDXL's two per transformer there: 4 + 2 + 6.
      QVERIFY2(kvs == (xl ? 12 : 6), qPrintable(QString("%1 self-attention calls").arg(kvs)));
      const std::int64_t eps_bytes = in.latents.numel() * 4;  // n bands of 1/n each
      std::vector<std::int64_t> messages, bytes;
      for (int i = 0; i < steps; ++i) {
        const bool only_eps = i >= warmup && i + 1 == steps;
        const int exchanged = std::min(buckets, layers);  // K > L: one call per bucket
        messages.push_back(std::int64_t{n} * (i < warmup ? layers + 1 : only_eps ? 1 : exchanged + 1));
        bytes.push_back(eps_bytes + (only_eps ? 0 : layer_bytes));
        QCOMPARE(DistriFusion::messages_per_step(i, steps, warmup, n, layers, buckets), static_cast<int>(messages.back()));
      }
      QVERIFY2(out.stats.messages_per_step == messages,
               qPrintable(QString("xl %1 n %2 buckets %3: %4 hooked layer calls; steps' messages %5 %6 %7")
                              .arg(xl).arg(n).arg(buckets).arg(layers).arg(out.stats.messages_per_step[0])
                              .arg(out.stats.messages_per_step[2]).arg(out.stats.messages_per_step[4])));
      QVERIFY(out.stats.note.find(std::to_string(std::min(buckets, layers)) + " asynchronous all_gather(s)") != std::string::npos);
      QVERIFY(out.stats.bytes_per_step == bytes);
      std::int64_t total = 0;
      for (auto b : bytes) total += b;
      QCOMPARE(out.stats.bytes_sent, total);
      QVERIFY(out.stats.note.find(std::to_string(layers) + " hooked layer calls") != std::string::npos);
      QVERIFY(out.stats.to_json().find("messages_per_step") != std::string::npos);
    }
    QCOMPARE(DistriFusion::messages_per_step(4, 5, 5, 3, 10, 8), 33);  // a synchronous last step exchanges
    QCOMPARE(DistriFusion::messages_per_step(3, 5, 2, 3, 10, 4), 15);    // 4 buckets and eps
    QCOMPARE(DistriFusion::messages_per_step(3, 5, 2, 3, 10, 40), 33);   // clamped to one per call
    QCOMPARE(DistriFusion::messages_per_step(4, 5, 2, 3, 10, 4), 3);     // a stale last step: eps alone
    QCOMPARE(DistriFusion::bucket_count(8, 5), 5);
    QCOMPARE(DistriFusion::bucket_count(1, 5), 1);
  }

  // (6) The stale steps' buckets change when values travel, not which: every bucket count (1 is
  // the former single packed gather; more than the hooked layer calls is one call per bucket)
  // gives bit-identical latents, and they are the simulation's.
  void bucketsGiveIdenticalLatents() {
    struct Case {
      int n, warmup;
      double cfg;
      bool xl;
    };
    for (const auto& k : {Case{2, 1, 5.0, false}, Case{4, 2, 1.0, true}}) {
      const int steps = 5;
      auto in = inputs(schedulers::SamplerKind::Euler, steps, 1, k.cfg, k.xl ? sdxl() : unet_);
      const auto sim = simulate(in, k.xl ? sdxl() : unet_, k.n, k.warmup, k.cfg);
      at::Tensor first;
      for (int buckets : {1, 3, 8, 100000}) {
        DistriFusion d;
        d.n = k.n;
        d.warmup = k.warmup;
        d.buckets = buckets;
        const auto out = run(d, in);
        const double to_sim = rel_l2(out.latents, sim);
        const auto what = QString("n %1 xl %2 buckets %3: rel L2 to the simulation %4").arg(k.n).arg(k.xl).arg(buckets).arg(to_sim);
        qInfo("%s", qPrintable(what));
        QVERIFY2(to_sim < 1e-5, qPrintable(what));
        if (!first.defined()) first = out.latents;
        QVERIFY2(at::equal(out.latents, first), qPrintable(what + ": differs from 1 bucket"));
      }
    }
    DistriFusion d;
    d.buckets = 0;
    auto in = inputs(schedulers::SamplerKind::Euler, 2, 1, 5.0, unet_);
    DIFFRACT_EXPECT_ERROR(run(d, in), "1 or more buckets", "not 0");
  }

  // (7) Graphed stale steps (warm_rank() left every rank its fixed buffers; on the CPU they run
  // eagerly through the same buffers): bit for bit the buckets' latents, one all_gather of the
  // whole step's contributions (as one bucket) plus eps's per stale step, the bytes of one
  // bucket. Without the buffers (released) the same strategy takes the buckets.
  void graphedStaleStepsEqualBuckets() {
    struct Case {
      int n, warmup;
      double cfg;
      bool xl;
    };
    for (const auto& k : {Case{2, 1, 5.0, false}, Case{4, 2, 1.0, true}, Case{3, 1, 5.0, false}}) {
      const int steps = 5;
      auto in = inputs(schedulers::SamplerKind::Euler, steps, 1, k.cfg, k.xl ? sdxl() : unet_);
      if (k.n == 3) in.latents = at::randn({1, 4, 24, 16}, in.generator);  // 3 bands of 8 rows
      DistriFusion buckets;
      buckets.n = k.n;
      buckets.warmup = k.warmup;
      buckets.buckets = 1;
      buckets.graphs = false;
      const auto want = run(buckets, in);
      DistriFusion d = buckets;
      d.graphs = true;
      d.buckets = 8;
      for (int r = 0; r < k.n; ++r) d.warm_rank(*in.make_denoiser(r, c10::Device(c10::kCPU)), in.latents, 999, r);
      QVERIFY(models::patch_context() == nullptr);
      const auto out = run(d, in);
      const auto what = QString("n %1 xl %2 cfg %3: %4").arg(k.n).arg(k.xl).arg(k.cfg).arg(QString::fromStdString(out.stats.note));
      QVERIFY2(at::equal(out.latents, want.latents), qPrintable(what + ": differs from one bucket"));
      QVERIFY2(out.stats.note.find("into fixed buffers") != std::string::npos, qPrintable(what));
      QCOMPARE(out.stats.messages_per_step, want.stats.messages_per_step);
      QCOMPARE(out.stats.bytes_per_step, want.stats.bytes_per_step);
      for (int i = k.warmup; i + 1 < steps; ++i) QCOMPARE(static_cast<int>(out.stats.messages_per_step[static_cast<std::size_t>(i)]), 2 * k.n);
      DistriFusion::release_static_buffers();
      const auto again = run(d, in);
      QVERIFY2(again.stats.note.find("asynchronous all_gather(s) of buckets") != std::string::npos,
               qPrintable(QString::fromStdString(again.stats.note)));
      QVERIFY(at::equal(again.latents, want.latents));
    }
  }

  // all_gather_into: every rank's tensor in place in the caller's buffer, in order with the
  // other collectives; a buffer that cannot hold them is refused, naming both shapes.
  void allGatherInto() {
    const int n = 3;
    auto comms = make_in_process_group(n);
    std::atomic<int> good{0};
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        auto& c = *comms[static_cast<std::size_t>(r)];
        auto out = at::zeros({n, 2, 3}, at::kFloat);
        c.all_gather_into(at::full({2, 3}, r, at::kFloat), out);
        const auto after = c.all_gather(at::full({1}, 10 + r, at::kFloat));
        bool ok = after[2][0].item<float>() == 12;
        for (int q = 0; q < n; ++q) ok &= at::equal(out[q], at::full({2, 3}, q, at::kFloat));
        try {
          c.all_gather_into(at::ones({2, 3}), at::zeros({n - 1, 6}));
          ok = false;
        } catch (const Error& e) {
          ok &= std::string(e.what()).find("cannot hold 3 ranks' Float [2, 3]") != std::string::npos;
        }
        try {
          c.all_gather_into(at::ones({2, 3}), at::zeros({n, 6}, at::kDouble));
          ok = false;
        } catch (const Error&) {
        }
        if (ok) ++good;
      });
    for (auto& t : ts) t.join();
    QCOMPARE(good.load(), n);
  }

  // all_gather_async in-process: the gathered values, counted in bytes_sent, in order with the
  // blocking collectives; once the group is aborted, a pending gather's wait() throws Aborted
  // on every rank (as later collectives do).
  void asyncGatherAndAbort() {
    const int n = 3;
    auto comms = make_in_process_group(n);
    std::atomic<int> started{0}, aborted{0}, threw{0}, good{0};
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        auto& c = *comms[static_cast<std::size_t>(r)];
        bool ok = true;
        auto a = c.all_gather_async(at::full({4}, r, at::kFloat));
        auto b = c.all_gather_async(at::full({2}, 10 + r, at::kDouble));
        auto blocking = c.all_gather(at::full({1}, 20 + r, at::kFloat));
        const auto pa = a->wait(), pb = b->wait();
        for (int q = 0; q < n; ++q) {
          ok &= pa[static_cast<std::size_t>(q)][3].item<float>() == q;
          ok &= pb[static_cast<std::size_t>(q)][1].item<double>() == 10 + q;
          ok &= blocking[static_cast<std::size_t>(q)][0].item<float>() == 20 + q;
        }
        ok &= c.bytes_sent() == 16 + 16 + 4;
        auto pending = c.all_gather_async(at::full({1}, r, at::kFloat));
        ++started;
        if (r == 1) {
          while (started.load() < n) std::this_thread::yield();
          c.abort("device 1 failed: simulated");
          aborted = 1;
        }
        while (!aborted.load()) std::this_thread::yield();
        try {
          pending->wait();
        } catch (const Aborted& e) {
          if (std::string(e.what()).find("device 1 failed: simulated") != std::string::npos) ++threw;
        }
        try {
          c.all_gather_async(at::ones({1}));
        } catch (const Aborted&) {
          ++threw;
        }
        if (ok) ++good;
      });
    for (auto& t : ts) t.join();
    QCOMPARE(good.load(), n);
    QCOMPARE(threw.load(), 2 * n);
  }

  // A rank failing in a stale step's layer, between buckets (the others' gathers of the step in
  // flight or waited for at the next step's start): one error naming it, nobody hangs; the same
  // in the synchronous step.
  void failureBetweenBuckets() {
    for (int evaluation : {0, 2, 3})
      for (int call : {0, 5, 17}) {
        auto in = inputs(schedulers::SamplerKind::Euler, 5, 1, 5.0, unet_);
        const auto make = in.make_denoiser;
        in.make_denoiser = [make, evaluation, call](int rank, const c10::Device& dev) -> std::unique_ptr<Denoiser> {
          return std::make_unique<FailingInLayer>(make(rank, dev), rank == 2, evaluation, call);
        };
        DistriFusion d;
        d.n = 4;
        d.warmup = 1;
        d.buckets = 3;
        DIFFRACT_EXPECT_ERROR(run(d, in), "device 2", "simulated device failure in a layer");
      }
  }

  // warm(): one band, no collective (a context without a communicator would crash on one).
  void warmRunsOneIsolatedBand() {
    auto in = inputs(schedulers::SamplerKind::Euler, 2, 1, 5.0, unet_);
    auto den = in.make_denoiser(0, c10::Device(c10::kCPU));
    DistriFusion d;
    d.n = 4;
    d.warm(*den, in.latents, 999);
    QVERIFY(models::patch_context() == nullptr);
    d.warm(*den, at::zeros({1, 4, 12, 16}), 999);  // a height run() refuses: nothing
    SD3Denoiser sd3d(sd3(), {at::randn({1, 6, 24}), at::randn({1, 12})}, {}, 1.0, at::kFloat, c10::Device(c10::kCPU));
    d.warm(sd3d, at::zeros({1, 4, 8, 8}), 999);
  }

  // (5) What it refuses, naming what is wrong.
  void refusesWhatItCannotSplit() {
    auto in = inputs(schedulers::SamplerKind::Euler, 3, 1, 5.0, unet_, 10);
    DIFFRACT_EXPECT_ERROR(run(*make_strategy("distrifusion", 2), in), "latent height of 10 rows", "2 bands",
                          "1 downsampling", "multiple of 4");
    in = inputs(schedulers::SamplerKind::Euler, 3, 1, 5.0, unet_);
    DistriFusion d;
    d.n = 3;
    DIFFRACT_EXPECT_ERROR(run(d, in), "latent height of 16 rows", "3 bands", "multiple of 6");
    d.n = 16;  // one latent row each: half a row at 8 x 8
    DIFFRACT_EXPECT_ERROR(run(d, in), "latent height of 16 rows", "16 bands", "multiple of 32");
    DIFFRACT_EXPECT_ERROR(DistriFusion::band_height(64, 16, 3), "multiple of 128", "1024 px with");
    QCOMPARE(DistriFusion::band_height(128, 8, 3), std::int64_t{16});
    d.n = 1;
    DIFFRACT_EXPECT_ERROR(run(d, in), "2 or more devices", "not 1");
    d.n = 2;
    d.warmup = 0;
    DIFFRACT_EXPECT_ERROR(run(d, in), "1 or more synchronous warm-up steps");
    auto group = DeviceGroup::virtual_cpu(3);
    DIFFRACT_EXPECT_ERROR(DistriFusion{}.run(*group, in), "needs 2 device");
    LoopInputs sd3_in = in;
    sd3_in.latents = at::randn({1, 4, 8, 8});
    sd3_in.kind = schedulers::SamplerKind::FlowMatchEuler;
    sd3_in.config = schedulers::SchedulerConfig::from_json_text(
        R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})", sd3_in.kind,
        "test flow scheduler");
    auto model = sd3();
    sd3_in.make_denoiser = [model](int, const c10::Device& dev) -> std::unique_ptr<Denoiser> {
      return std::make_unique<SD3Denoiser>(model, SD3Conditioning{at::randn({1, 6, 24}), at::randn({1, 12})},
                                           SD3Conditioning{}, 1.0, at::kFloat, dev);
    };
    DIFFRACT_EXPECT_ERROR(run(DistriFusion{}, sd3_in), "not an SD / SDXL UNet", "pipefusion");
    QCOMPARE(make_strategy("distrifusion", 3)->devices(), 3);
    QCOMPARE(make_strategy("distrifusion", 3)->name(), std::string("distrifusion"));
    DIFFRACT_EXPECT_ERROR(make_strategy("distrifuse", 2), "unknown strategy", "distrifusion)");
  }

  // Cancelled in a stale step: every rank stops at the same step (none left in a layer's
  // all_gather); a rank failing mid-loop is one error naming it, and nobody hangs.
  void cancelAndFailure() {
    auto in = inputs(schedulers::SamplerKind::Euler, 6, 1, 5.0, unet_);
    DistriFusion d;
    d.n = 4;
    d.warmup = 1;
    job::CancelToken token;
    in.cancel = &token;
    int last = -1;
    in.on_step = [&](int i, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
      last = i;
      if (i == 2) token.cancel();
    };
    bool cancelled = false;
    try {
      run(d, in);
    } catch (const job::Cancelled&) {
      cancelled = true;
    }
    QVERIFY(cancelled);
    QVERIFY(last >= 2 && last < 5);
    for (int after : {0, 3}) {  // in the synchronous step, in a stale one
      auto fin = inputs(schedulers::SamplerKind::Euler, 6, 1, 5.0, unet_);
      const auto make = fin.make_denoiser;
      fin.make_denoiser = [make, after](int rank, const c10::Device& dev) -> std::unique_ptr<Denoiser> {
        return std::make_unique<Failing>(make(rank, dev), rank == 1, after);
      };
      DIFFRACT_EXPECT_ERROR(run(d, fin), "device 1", "simulated device failure");
    }
  }

  // Through the SD pipeline (make_denoiser gives UNetDenoisers): synchronous is the plain loop
  // within a level; the default runs stale and says so.
  void pipelineRunsDistriFusion() {
    for (const char* model : {"tiny-sd", "tiny-sdxl"}) {
      auto sd = pipeline::StableDiffusion::load(test::fixtures() / model, "cpu");
      job::GenerationRequest req;
      req.prompt = "a red apple";
      req.negative_prompt = "blurry";
      req.steps = 6;
      req.cfg = 5.0;
      req.seed = 3;
      req.sampler = "euler";
      job::CancelToken never;
      const auto base = sd->generate(req, {}, never);
      DistriFusion sync;
      sync.n = 2;
      sync.warmup = req.steps;
      const auto synced = sd->generate(req, {}, never, &sync);
      const auto& a = synced.images.front().rgb;
      const auto& b = base.images.front().rgb;
      int worst = 0;
      for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(int(a[i]) - int(b[i])));
      QVERIFY2(worst <= 1, qPrintable(QString("%1: synchronous distrifusion differs by %2 levels").arg(model).arg(worst)));
      const auto stale = sd->generate(req, {}, never, make_strategy("distrifusion", 2).get());
      QVERIFY(stale.metadata_json.find("4 synchronous step(s), then 2 one-step-stale") != std::string::npos);
      QVERIFY(stale.metadata_json.find("\"messages_per_step\":[") != std::string::npos);
    }
  }
};

QTEST_APPLESS_MAIN(TestDistriFusion)
#include "test_distrifusion.moc"
