#include "core/parallel/distrifusion.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>

#include "core/models/common/patch_parallel.h"
#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

void DistriFusion::validate(std::int64_t, bool) const {
  if (n < 2) throw Error("distrifusion needs 2 or more devices (one per band of rows), not " + std::to_string(n));
  if (warmup < 1)
    throw Error("distrifusion needs 1 or more synchronous warm-up steps (its stale steps use every layer's activations "
                "of the step before), not " + std::to_string(warmup));
}

std::int64_t DistriFusion::band_height(std::int64_t height, int n, int downsamplings) {
  const std::int64_t factor = std::int64_t{1} << downsamplings, unit = factor * n;
  if (n < 1 || height % unit != 0)
    throw Error("distrifusion: a latent height of " + std::to_string(height) + " rows cannot be split into " +
                std::to_string(n) + " bands for a UNet with " + std::to_string(downsamplings) +
                " downsampling(s): each band's height must divide by " + std::to_string(factor) +
                ", so that it keeps whole rows at every resolution (1 or more at the deepest, " +
                std::to_string(height) + " / " + std::to_string(factor) +
                ") and every stride-2 convolution's band starts on an even row; use a latent height that is a multiple of " +
                std::to_string(unit) + " (" + std::to_string(8 * unit) + " px with SD's 8x VAE)");
  return height / n;
}

int DistriFusion::messages_per_step(int step, int steps, int warmup, int n, int layers) {
  const bool stale = step >= warmup, last = step + 1 >= steps;
  return n * (stale && last ? 1 : layers + 1);
}

namespace {

int downsamplings(const std::vector<models::UNetLayerInfo>& layers) {
  return static_cast<int>(std::count_if(layers.begin(), layers.end(), [](const models::UNetLayerInfo& l) {
    return l.name.find(".downsamplers.") != std::string::npos;
  }));
}

[[noreturn]] void not_a_unet() {
  throw Error("distrifusion: this model is not an SD / SDXL UNet (its patch-parallel layers are the UNet's convolutions, "
              "GroupNorms and self-attention; for SD3 use pipefusion)");
}

enum class Mode { Isolated, Sync, Stale };

// One rank's band context: hooked layer call k of an evaluation is layer k. Sync: gathers every
// band's fresh contribution now (and keeps it); Stale: the other bands' from the evaluation
// before, then gathers its fresh one for the next (unless `publish` is off); Isolated: zeros
// for the other bands, no collective.
class Exchange final : public models::BandContext {
 public:
  Exchange(int rank, int size, Communicator* comm, StepTraffic* traffic)
      : BandContext(rank, size), comm_(comm), traffic_(traffic) {}

  void begin(Mode mode, bool publish, int step) {
    mode_ = mode;
    publish_ = publish;
    step_ = step;
    calls_ = 0;
  }
  int calls() const { return calls_; }
  std::int64_t buffer_bytes() const {
    std::int64_t b = 0;
    for (const auto& layer : previous_)
      for (const auto& t : layer)
        if (t.defined()) b += static_cast<std::int64_t>(t.nbytes());
    return b;
  }

  std::vector<at::Tensor> exchange(const at::Tensor& mine) override {
    const auto layer = static_cast<std::size_t>(calls_++);
    const auto own = static_cast<std::size_t>(rank_);
    if (mode_ == Mode::Isolated) {
      std::vector<at::Tensor> all(static_cast<std::size_t>(size_), at::zeros_like(mine));
      all[own] = mine;
      return all;
    }
    if (mode_ == Mode::Sync) {
      auto all = gather(mine);
      if (previous_.size() <= layer) previous_.resize(layer + 1);
      previous_[layer] = all;
      previous_[layer][own] = at::Tensor();  // never read: a band's own part is always fresh
      return all;
    }
    if (layer >= previous_.size())
      throw Error("distrifusion: hooked layer call " + std::to_string(layer) + " has no contributions from the step " +
                  "before (" + std::to_string(previous_.size()) + " calls then): the UNet's call order changed");
    auto all = previous_[layer];
    const auto& other = all[(own + 1) % all.size()];
    if (other.sizes() != mine.sizes())
      throw Error("distrifusion: hooked layer call " + std::to_string(layer) + " contributes " +
                  std::to_string(mine.numel()) + " values, " + std::to_string(other.numel()) + " the step before");
    all[own] = mine;
    if (publish_) {
      previous_[layer] = gather(mine);
      previous_[layer][own] = at::Tensor();
    }
    return all;
  }

 private:
  std::vector<at::Tensor> gather(const at::Tensor& mine) {
    auto all = comm_->all_gather(mine);
    if (traffic_) traffic_->sent(step_, mine);
    all[static_cast<std::size_t>(rank_)] = mine;
    return all;
  }

  Communicator* comm_;
  StepTraffic* traffic_;
  Mode mode_ = Mode::Isolated;
  bool publish_ = false;
  int step_ = 0, calls_ = 0;
  std::vector<std::vector<at::Tensor>> previous_;  // per layer call: every band's (own undefined)
};

// The guided output of `band` [B, C, h, W] under `ex`.
at::Tensor eval_band(Denoiser& d, Exchange& ex, const at::Tensor& band, double t, int layers) {
  const models::PatchScope scope(&ex);
  auto st = d.stage_input(band, t, Branch::Guided);
  d.run_stage(st, 0, layers, t, Branch::Guided);
  return d.stage_output(st, Branch::Guided).contiguous();
}

}  // namespace

void DistriFusion::warm(Denoiser& d, const at::Tensor& x, double t) const {
  const auto layers = d.stage_layers(x.size(2), x.size(3));
  if (layers.empty() || n < 2 || x.size(2) % (std::int64_t{n} << downsamplings(layers)) != 0) return;
  const auto rows = band_height(x.size(2), n, downsamplings(layers));
  Exchange ex(0, n, nullptr, nullptr);
  ex.begin(Mode::Isolated, false, 0);
  eval_band(d, ex, x.narrow(2, 0, rows).contiguous(), t, static_cast<int>(layers.size()));
}

LoopOutput DistriFusion::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  const std::int64_t height = in.latents.size(2), width = in.latents.size(3);
  const auto layers = ranks[0].den->stage_layers(height, width);
  if (layers.empty()) not_a_unet();
  const auto rows = band_height(height, n, downsamplings(layers));
  const int steps = in.steps, sync_steps = std::min(warmup, steps), layer_count = static_cast<int>(layers.size());

  StepTraffic traffic(steps);
  std::atomic<std::int64_t> bytes{0}, buffer_bytes{0};
  std::atomic<int> hooked{0};
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& me = ranks[static_cast<std::size_t>(rank)];
    const auto bytes0 = comm.bytes_sent();
    Exchange ex(rank, n, &comm, &traffic);
    for (int i = 0; i < steps; ++i) {
      gate.check(i);
      const double t = me.sampler->timesteps().at(static_cast<std::size_t>(i));
      ex.begin(i < sync_steps ? Mode::Sync : Mode::Stale, i + 1 < steps, i);
      const auto band = me.sampler->scale_model_input(me.x, i).narrow(2, rank * rows, rows).contiguous();
      const auto eps = eval_band(*me.den, ex, band, t, layer_count);
      auto all = comm.all_gather(eps);
      traffic.sent(i, eps);
      for (auto& e : all) e = e.to(eps.device());
      me.x = refine(me, rank, in, at::cat(all, 2), i, me.x);
    }
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) {
      hooked = ex.calls();
      buffer_bytes = ex.buffer_bytes();
      result = me.x;
    }
  });

  auto o = finish(*this, in, g, result, steps, steps * n, bytes.load());
  o.stats.messages_per_step = traffic.messages();
  o.stats.bytes_per_step = traffic.bytes();
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f", static_cast<double>(buffer_bytes.load()) / (1024.0 * 1024.0));
  o.stats.note = std::to_string(n) + " bands of " + std::to_string(rows) + " of " + std::to_string(height) +
                 " latent rows; " + std::to_string(sync_steps) + " synchronous step(s), then " +
                 std::to_string(steps - sync_steps) + " one-step-stale step(s); " + std::to_string(hooked.load()) +
                 " hooked layer calls per evaluation (conv halos, GroupNorm statistics, self-attention K / V), each a "
                 "blocking all_gather at the layer (not overlapped); the previous step's contributions kept: " +
                 mib + " MiB per rank";
  return o;
}

}  // namespace diffract::parallel
