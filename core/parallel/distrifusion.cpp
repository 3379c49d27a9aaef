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

int DistriFusion::messages_per_step(int step, int, int warmup, int n, int layers) {
  return n * (step >= warmup ? 1 : layers + 1);
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
// before, and (unless `publish` is off) its own fresh one copied into its slot of this step's
// pack, which finish() gathers with eps in one all_gather; Isolated: zeros for the other bands,
// no collective.
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
    if (other.sizes() != mine.sizes() || other.scalar_type() != mine.scalar_type())
      throw Error("distrifusion: hooked layer call " + std::to_string(layer) + " contributes " +
                  std::to_string(mine.numel()) + " values of " + c10::toString(mine.scalar_type()) + ", " +
                  std::to_string(other.numel()) + " of " + c10::toString(other.scalar_type()) + " the step before");
    all[own] = mine;
    if (publish_) slot(pack(mine.device()), layer).copy_(mine);  // sent at the end of the step
    return all;
  }

  // The end of an evaluation: every band's eps [B, C, h, W], in band order. In a publishing
  // stale step, eps goes into the pack and the pack is the step's one collective: every band's
  // contributions of this step become the other bands' values of the next (views of the
  // gathered buffer). Otherwise eps alone.
  std::vector<at::Tensor> finish(const at::Tensor& eps) {
    const auto own = static_cast<std::size_t>(rank_);
    if (mode_ != Mode::Stale || !publish_) {
      eps_shape_ = eps.sizes().vec();
      eps_dtype_ = eps.scalar_type();
      return gather(eps);
    }
    const auto layers = slots_.empty() ? previous_.size() : slots_.size() - 1;
    if (static_cast<std::size_t>(calls_) != layers)
      throw Error("distrifusion: " + std::to_string(calls_) + " hooked layer calls in a stale step, " +
                  std::to_string(layers) + " in the step before: the UNet's call order changed");
    if (eps.sizes() != at::IntArrayRef(eps_shape_) || eps.scalar_type() != eps_dtype_)
      throw Error("distrifusion: the band's eps changed shape or type since the synchronous steps");
    auto packed = pack(eps.device());
    slot(packed, layers).copy_(eps);
    pack_ = at::Tensor();
    previous_.clear();  // read by this step's layers only: freed before the gathered buffer arrives
    auto parts = comm_->all_gather(packed);
    if (traffic_) traffic_->sent(step_, packed);
    packed = at::Tensor();
    previous_.assign(layers, std::vector<at::Tensor>(static_cast<std::size_t>(size_)));
    std::vector<at::Tensor> all(static_cast<std::size_t>(size_));
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (r == own) continue;
      for (std::size_t l = 0; l < layers; ++l) previous_[l][r] = slot(parts[r], l);
      all[r] = slot(parts[r], layers);
    }
    all[own] = eps;
    return all;
  }

 private:
  struct Slot {
    std::vector<std::int64_t> shape;
    at::ScalarType dtype;
    std::int64_t offset, bytes;
  };

  std::vector<at::Tensor> gather(const at::Tensor& mine) {
    auto all = comm_->all_gather(mine);
    if (traffic_) traffic_->sent(step_, mine);
    all[static_cast<std::size_t>(rank_)] = mine;
    return all;
  }

  // Slot i of a pack (layer i's contribution; the last: eps), as a tensor of its shape and type.
  at::Tensor slot(const at::Tensor& bytes, std::size_t i) const {
    const auto& s = slots_[i];
    return bytes.narrow(0, s.offset, s.bytes).view(s.dtype).view(s.shape);
  }

  // This step's pack, a flat byte buffer: every hooked layer call's contribution then eps, laid
  // out on first use from the synchronous steps' shapes (every rank's alike: equal bands).
  // Slots in order of element size, largest first, and the total rounded up to the largest, so
  // that every slot is aligned for its type in each rank's part of the gathered buffer.
  const at::Tensor& pack(const at::Device& device) {
    if (slots_.empty()) {
      const auto other = (static_cast<std::size_t>(rank_) + 1) % static_cast<std::size_t>(size_);
      for (const auto& layer : previous_)
        slots_.push_back({layer[other].sizes().vec(), layer[other].scalar_type(), 0, static_cast<std::int64_t>(layer[other].nbytes())});
      std::int64_t numel = 1;
      for (auto d : eps_shape_) numel *= d;
      slots_.push_back({eps_shape_, eps_dtype_, 0, numel * static_cast<std::int64_t>(c10::elementSize(eps_dtype_))});
      std::vector<std::size_t> order(slots_.size());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      const auto size_of = [&](std::size_t i) { return c10::elementSize(slots_[i].dtype); };
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return size_of(a) > size_of(b); });
      std::int64_t offset = 0;
      for (auto i : order) {
        slots_[i].offset = offset;
        offset += slots_[i].bytes;
      }
      const auto align = static_cast<std::int64_t>(size_of(order.front()));
      used_bytes_ = offset;
      pack_bytes_ = (offset + align - 1) / align * align;
    }
    if (!pack_.defined()) {
      pack_ = at::empty({pack_bytes_}, at::TensorOptions().dtype(at::kByte).device(device));
      if (pack_bytes_ > used_bytes_) pack_.narrow(0, used_bytes_, pack_bytes_ - used_bytes_).zero_();  // the padding
    }
    return pack_;
  }

  Communicator* comm_;
  StepTraffic* traffic_;
  Mode mode_ = Mode::Isolated;
  bool publish_ = false;
  int step_ = 0, calls_ = 0;
  std::vector<std::vector<at::Tensor>> previous_;  // per layer call: every band's (own undefined)
  std::vector<std::int64_t> eps_shape_;
  at::ScalarType eps_dtype_ = at::kFloat;
  std::vector<Slot> slots_;  // per layer call, then eps
  std::int64_t used_bytes_ = 0, pack_bytes_ = 0;
  at::Tensor pack_;  // this stale step's, while it fills
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
      auto all = ex.finish(eps);
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
                 " hooked layer calls per evaluation (conv halos, GroupNorm statistics, self-attention K / V): an "
                 "all_gather at each in a synchronous step, one packed all_gather of them all with eps at the end of a "
                 "stale step; the previous step's contributions kept: " +
                 mib + " MiB per rank";
  return o;
}

}  // namespace diffract::parallel
