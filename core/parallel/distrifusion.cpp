#include "core/parallel/distrifusion.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <list>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>

#include "core/models/common/patch_parallel.h"
#include "core/models/unets/unet_graphs.h"
#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

void DistriFusion::validate(std::int64_t, bool) const {
  if (n < 2) throw Error("distrifusion needs 2 or more devices (one per band of rows), not " + std::to_string(n));
  if (buckets < 1)
    throw Error("distrifusion needs 1 or more buckets for its stale steps' exchange, not " + std::to_string(buckets));
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

int DistriFusion::bucket_count(int buckets, int layers) { return std::max(1, std::min(buckets, layers)); }

int DistriFusion::messages_per_step(int step, int steps, int warmup, int n, int layers, int buckets) {
  if (step < warmup) return n * (layers + 1);
  return n * (step + 1 < steps && layers > 0 ? bucket_count(buckets, layers) + 1 : 1);
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

enum class Mode { Isolated, Measure, Sync, Stale, Static };

// A rank's stale-step buffers of fixed addresses (Mode::Static): what its graphed band
// evaluation reads (every band's contributions of the step before) and writes (its own of this
// step), between which one all_gather_into runs after the evaluation. Made by warm_rank() before
// the loop, when the graph is captured, and found again by run() under the same key (device,
// rank, bands, every hooked layer call's contribution shape and type).
struct StaticBands {
  std::int64_t tag = 0;  // the contexts' graph_tag(): never reused, so a graph of freed buffers never replays
  at::Tensor send;       // [bytes] uint8
  at::Tensor gathered;   // [n, bytes] uint8
};

// The buffers of the two most recently used keys per (device, rank): a resolution the user left
// gives its memory back once two others were used.
class StaticBandsRegistry {
 public:
  static StaticBandsRegistry& get() {
    static StaticBandsRegistry r;
    return r;
  }
  std::shared_ptr<StaticBands> find(const std::string& owner, const std::string& key) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->owner == owner && it->key == key) {
        entries_.splice(entries_.begin(), entries_, it);
        return entries_.front().bands;
      }
    return nullptr;
  }
  std::shared_ptr<StaticBands> make(const std::string& owner, const std::string& key, std::int64_t bytes, int n,
                                    const at::Device& device) {
    auto b = std::make_shared<StaticBands>();
    const auto options = at::TensorOptions().dtype(at::kByte).device(device);
    b->send = at::zeros({bytes}, options);
    b->gathered = at::zeros({n, bytes}, options);
    const std::lock_guard<std::mutex> lock(mutex_);
    b->tag = ++last_tag_;
    entries_.push_front({owner, key, b});
    int kept = 0;
    entries_.remove_if([&](const Entry& e) { return e.owner == owner && ++kept > 2; });
    return b;
  }
  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    entries_.clear();
  }

 private:
  struct Entry {
    std::string owner, key;
    std::shared_ptr<StaticBands> bands;
  };
  std::mutex mutex_;
  std::list<Entry> entries_;
  std::int64_t last_tag_ = 0;
};

// One rank's band context: hooked layer call k of an evaluation is layer k. Sync: gathers every
// band's fresh contribution now (and keeps it); Stale: the other bands' from the evaluation
// before, and (unless `publish` is off) its own fresh one copied into its slot of this step's
// bucket, whose all_gather starts as soon as the bucket's last call has written (the next
// step's begin() waits for them); Static: as Stale, but every band's contributions of the step
// before are read from, and its own written to, the fixed buffers of bind_static() (one bucket),
// so that the evaluation is a CUDA graph (graph_tag()); publish_static() gathers them after the
// evaluation; Isolated: zeros for the other bands, no collective; Measure: as Isolated, keeping
// the contributions' shapes as Sync does (for bind_static()). finish() gathers eps (blocking)
// in Sync, Stale and Static.
class Exchange final : public models::BandContext {
 public:
  Exchange(int rank, int size, Communicator* comm, StepTraffic* traffic, int buckets = 1)
      : BandContext(rank, size), comm_(comm), traffic_(traffic), max_buckets_(std::max(buckets, 1)) {}

  std::int64_t graph_tag() const override { return mode_ == Mode::Static ? static_->tag : 0; }

  // The key of this rank's static buffers on `device`, for the contributions the last Sync or
  // Measure evaluation made (every rank's are alike: equal bands).
  std::string static_key() const {
    std::string k = std::to_string(size_);
    for (const auto& layer : previous_) {
      const auto& t = layer[(static_cast<std::size_t>(rank_) + 1) % layer.size()];
      k += ";" + std::string(c10::toString(t.scalar_type())) + c10::str(t.sizes());
    }
    return k;
  }
  static std::string owner(const at::Device& device, int rank) { return device.str() + "#" + std::to_string(rank); }

  // Static mode's buffers for the contributions of the Sync / Measure evaluation before: made
  // (`make`) or found (else false when there are none), then filled with the other bands'
  // contributions of that evaluation, which the first Static step reads.
  bool bind_static(const at::Device& device, bool make) {
    if (previous_.empty()) return false;
    const auto key = static_key();
    static_ = StaticBandsRegistry::get().find(owner(device, rank_), key);
    if (!static_ && !make) return false;
    slots_.clear();
    buckets_.clear();
    layout(1);
    if (!static_) static_ = StaticBandsRegistry::get().make(owner(device, rank_), key, buckets_.front().bytes, size_, device);
    const auto own = static_cast<std::size_t>(rank_);
    for (std::size_t l = 0; l < previous_.size(); ++l)
      for (std::size_t r = 0; r < previous_[l].size(); ++r)
        if (r != own) slot(static_->gathered[static_cast<std::int64_t>(r)], l).copy_(previous_[l][r]);
    previous_.clear();
    return true;
  }
  // Static mode: this step's contributions (written by the evaluation) to every rank's buffer
  // of the step before, in place (the next evaluation reads them).
  void publish_static() {
    comm_->all_gather_into(static_->send, static_->gathered);
    if (traffic_) traffic_->sent(step_, static_->send);
  }

  void begin(Mode mode, bool publish, int step) {
    // The step before's buckets: every band's contributions to this step's layers (views of
    // the gathered buffers, no copy). Waited here, before the first layer reads them.
    if (!pending_.empty()) {
      const auto own = static_cast<std::size_t>(rank_);
      previous_.assign(slots_.size(), std::vector<at::Tensor>(static_cast<std::size_t>(size_)));
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        auto parts = pending_[b]->wait();
        pending_[b].reset();
        for (std::size_t r = 0; r < parts.size(); ++r) {
          if (r == own) continue;
          for (auto l = buckets_[b].begin; l < buckets_[b].end; ++l) previous_[l][r] = slot(parts[r], l);
        }
      }
      pending_.clear();
    }
    mode_ = mode;
    publish_ = publish;
    step_ = step;
    calls_ = 0;
    if (mode == Mode::Stale) {
      layers_ = previous_.size();
      if (publish && slots_.empty()) layout(max_buckets_);
    }
    if (mode == Mode::Static) {
      if (!static_) throw Error("distrifusion: a static stale step without its buffers (bind_static)");
      layers_ = slots_.size();
    }
  }
  // Hooked layer calls of the last evaluation (a replayed graph makes none: its layout's).
  int calls() const { return mode_ == Mode::Static ? static_cast<int>(layers_) : calls_; }
  int buckets() const { return static_cast<int>(buckets_.size()); }
  // The other bands' contributions to one evaluation that a rank keeps from a step to the next.
  std::int64_t buffer_bytes() const {
    std::int64_t b = 0;
    if (!slots_.empty()) {
      for (const auto& s : slots_) b += s.bytes;
      return b * (size_ - 1);
    }
    for (const auto& layer : previous_)
      for (const auto& t : layer)
        if (t.defined()) b += static_cast<std::int64_t>(t.nbytes());
    return b;
  }

  std::vector<at::Tensor> exchange(const at::Tensor& mine) override {
    // A graph's capture runs the evaluation three times within one call (two eager warm-ups,
    // then the capture), each making the same calls: Static counts modulo the layout's calls.
    const auto layer = mode_ == Mode::Static && layers_ > 0 ? static_cast<std::size_t>(calls_++) % layers_
                                                            : static_cast<std::size_t>(calls_++);
    const auto own = static_cast<std::size_t>(rank_);
    if (mode_ == Mode::Isolated || mode_ == Mode::Measure) {
      std::vector<at::Tensor> all(static_cast<std::size_t>(size_), at::zeros_like(mine));
      all[own] = mine;
      if (mode_ == Mode::Measure) {
        if (previous_.size() <= layer) previous_.resize(layer + 1);
        previous_[layer] = all;
        previous_[layer][own] = at::Tensor();
      }
      return all;
    }
    if (mode_ == Mode::Static) {
      const auto& s = slots_[layer];
      if (mine.sizes() != at::IntArrayRef(s.shape) || mine.scalar_type() != s.dtype)
        throw Error("distrifusion: hooked layer call " + std::to_string(layer) + " contributes " +
                    c10::toString(mine.scalar_type()) + c10::str(mine.sizes()) + ", its static slot holds " +
                    c10::toString(s.dtype) + c10::str(at::IntArrayRef(s.shape)));
      std::vector<at::Tensor> all(static_cast<std::size_t>(size_));
      for (std::size_t r = 0; r < all.size(); ++r)
        all[r] = r == own ? mine : slot(static_->gathered[static_cast<std::int64_t>(r)], layer);
      slot(static_->send, layer).copy_(mine);
      return all;
    }
    if (mode_ == Mode::Sync) {
      auto all = gather(mine);
      if (previous_.size() <= layer) previous_.resize(layer + 1);
      previous_[layer] = all;
      previous_[layer][own] = at::Tensor();  // never read: a band's own part is always fresh
      return all;
    }
    if (layer >= layers_)
      throw Error("distrifusion: hooked layer call " + std::to_string(layer) + " has no contributions from the step " +
                  "before (" + std::to_string(layers_) + " calls then): the UNet's call order changed");
    auto all = std::move(previous_[layer]);  // read once: released as the step goes (a bucket's
    previous_[layer].clear();                // gathered buffer is freed once its layers are past)
    const auto& other = all[(own + 1) % all.size()];
    if (other.sizes() != mine.sizes() || other.scalar_type() != mine.scalar_type())
      throw Error("distrifusion: hooked layer call " + std::to_string(layer) + " contributes " +
                  std::to_string(mine.numel()) + " values of " + c10::toString(mine.scalar_type()) + ", " +
                  std::to_string(other.numel()) + " of " + c10::toString(other.scalar_type()) + " the step before");
    all[own] = mine;
    if (publish_) {
      const auto b = bucket_of_[layer];
      slot(pack(b, mine.device()), layer).copy_(mine);
      if (layer + 1 == buckets_[b].end) {  // the bucket is complete: on its way while the step goes on
        auto packed = std::move(packs_[b]);
        packs_[b] = at::Tensor();
        if (pending_.empty()) pending_.resize(buckets_.size());
        pending_[b] = comm_->all_gather_async(packed);
        if (traffic_) traffic_->sent(step_, packed);
      }
    }
    return all;
  }

  // The end of an evaluation: every band's eps [B, C, h, W], in band order (one blocking
  // all_gather: the sampler needs it now).
  std::vector<at::Tensor> finish(const at::Tensor& eps) {
    if (mode_ == Mode::Stale && static_cast<std::size_t>(calls_) != layers_)
      throw Error("distrifusion: " + std::to_string(calls_) + " hooked layer calls in a stale step, " +
                  std::to_string(layers_) + " in the step before: the UNet's call order changed");
    if (mode_ == Mode::Static && calls_ % static_cast<int>(layers_) != 0)  // a replay makes none
      throw Error("distrifusion: " + std::to_string(calls_) + " hooked layer calls in a static stale step, " +
                  std::to_string(layers_) + " laid out: the UNet's call order changed");
    return gather(eps);
  }

 private:
  struct Slot {
    std::vector<std::int64_t> shape;
    at::ScalarType dtype;
    std::int64_t offset, bytes;  // within its bucket
  };
  struct Bucket {
    std::size_t begin, end;  // hooked layer calls [begin, end)
    std::int64_t used, bytes;  // slots' bytes; padded to the largest element size
  };

  std::vector<at::Tensor> gather(const at::Tensor& mine) {
    auto all = comm_->all_gather(mine);
    if (traffic_) traffic_->sent(step_, mine);
    all[static_cast<std::size_t>(rank_)] = mine;
    return all;
  }

  // Layer call l's slot in a bucket's bytes, as a tensor of its shape and type.
  at::Tensor slot(const at::Tensor& bytes, std::size_t l) const {
    const auto& s = slots_[l];
    return bytes.narrow(0, s.offset, s.bytes).view(s.dtype).view(s.shape);
  }

  // The buckets, laid out once from the synchronous steps' shapes (every rank's alike: equal
  // bands): min(K, L) runs of consecutive hooked layer calls of about equal bytes (bucket b
  // ends at the first call where the running total reaches (b + 1) / K of the whole, leaving at
  // least one call to every later bucket). In a bucket, slots in order of element size, largest
  // first, and its total rounded up to the largest, so that every slot is aligned for its type
  // in each rank's part of the gathered buffer.
  void layout(int max_buckets) {
    const auto other = (static_cast<std::size_t>(rank_) + 1) % static_cast<std::size_t>(size_);
    std::int64_t total = 0;
    for (const auto& layer : previous_) {
      slots_.push_back({layer[other].sizes().vec(), layer[other].scalar_type(), 0, static_cast<std::int64_t>(layer[other].nbytes())});
      total += slots_.back().bytes;
    }
    const auto count = slots_.size();
    if (count == 0) return;
    const auto k = std::min(static_cast<std::size_t>(max_buckets), count);
    bucket_of_.assign(count, 0);
    std::size_t begin = 0;
    std::int64_t running = 0;
    for (std::size_t b = 0; b < k; ++b) {
      const std::size_t last_end = count - (k - 1 - b);
      std::size_t end = begin;
      do {
        running += slots_[end++].bytes;
      } while (end < last_end && (b + 1 == k || running * static_cast<std::int64_t>(k) < total * static_cast<std::int64_t>(b + 1)));
      std::vector<std::size_t> order;
      for (auto l = begin; l < end; ++l) order.push_back(l);
      const auto size_of = [&](std::size_t l) { return c10::elementSize(slots_[l].dtype); };
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t c) { return size_of(a) > size_of(c); });
      std::int64_t offset = 0;
      for (auto l : order) {
        slots_[l].offset = offset;
        offset += slots_[l].bytes;
      }
      const auto align = static_cast<std::int64_t>(size_of(order.front()));
      buckets_.push_back({begin, end, offset, (offset + align - 1) / align * align});
      begin = end;
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      for (auto l = buckets_[b].begin; l < buckets_[b].end; ++l) bucket_of_[l] = b;
    packs_.assign(buckets_.size(), at::Tensor());
  }

  // Bucket b's buffer of this step, while it fills.
  const at::Tensor& pack(std::size_t b, const at::Device& device) {
    auto& p = packs_[b];
    if (!p.defined()) {
      const auto& k = buckets_[b];
      p = at::empty({k.bytes}, at::TensorOptions().dtype(at::kByte).device(device));
      if (k.bytes > k.used) p.narrow(0, k.used, k.bytes - k.used).zero_();  // the padding
    }
    return p;
  }

  Communicator* comm_;
  StepTraffic* traffic_;
  int max_buckets_;
  Mode mode_ = Mode::Isolated;
  bool publish_ = false;
  int step_ = 0, calls_ = 0;
  std::size_t layers_ = 0;  // hooked layer calls of the step before (a stale step's)
  std::vector<std::vector<at::Tensor>> previous_;  // per layer call: every band's (own undefined)
  std::vector<Slot> slots_;  // per layer call
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;  // per layer call
  std::vector<at::Tensor> packs_;  // per bucket: this stale step's, while it fills
  std::vector<std::unique_ptr<PendingGather>> pending_;  // per bucket: this step's gathers in flight
  std::shared_ptr<StaticBands> static_;  // Static mode's buffers
};

// The guided output of `band` [B, C, h, W] under `ex`.
at::Tensor eval_band(Denoiser& d, Exchange& ex, const at::Tensor& band, double t, int layers) {
  const models::PatchScope scope(&ex);
  auto st = d.stage_input(band, t, Branch::Guided);
  d.run_stage(st, 0, layers, t, Branch::Guided);
  return d.stage_output(st, Branch::Guided).contiguous();
}

}  // namespace

void DistriFusion::warm(Denoiser& d, const at::Tensor& x, double t) const { warm_band(d, x, t, 0, false); }

void DistriFusion::warm_rank(Denoiser& d, const at::Tensor& x, double t, int rank) const {
  warm_band(d, x, t, rank, static_stale_steps(x.device()));
}

void DistriFusion::warm_band(Denoiser& d, const at::Tensor& x, double t, int rank, bool capture) const {
  const auto layers = d.stage_layers(x.size(2), x.size(3));
  if (layers.empty() || n < 2 || rank < 0 || rank >= n || x.size(2) % (std::int64_t{n} << downsamplings(layers)) != 0)
    return;
  const auto rows = band_height(x.size(2), n, downsamplings(layers));
  const auto band = x.narrow(2, rank * rows, rows).contiguous();
  const int count = static_cast<int>(layers.size());
  Exchange ex(rank, n, nullptr, nullptr);
  ex.begin(Mode::Measure, false, 0);
  eval_band(d, ex, band, t, count);
  if (!capture) return;
  ex.bind_static(x.device(), /*make=*/true);
  ex.begin(Mode::Static, false, 0);
  eval_band(d, ex, band, t, count);  // on a GPU, the capture of the stale step's graph
}

void DistriFusion::release_static_buffers() { StaticBandsRegistry::get().clear(); }

bool DistriFusion::static_stale_steps(const at::Device& device) const {
  return graphs && (!device.is_cuda() || models::stage_graphs_from_env());
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
  std::atomic<int> hooked{0}, bucket_count{0};
  std::atomic<bool> graphed{false};
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& me = ranks[static_cast<std::size_t>(rank)];
    const auto bytes0 = comm.bytes_sent();
    Exchange ex(rank, n, &comm, &traffic, buckets);
    bool fixed = false;  // the stale steps in Mode::Static
    for (int i = 0; i < steps; ++i) {
      gate.check(i);
      const double t = me.sampler->timesteps().at(static_cast<std::size_t>(i));
      if (i == sync_steps && static_stale_steps(g.device(rank))) {
        // Every rank decides alike, from what warm_rank() left for every rank, so that all make
        // the same collectives.
        const auto key = ex.static_key();
        bool all = true;
        for (int r = 0; r < n; ++r)
          all = all && StaticBandsRegistry::get().find(Exchange::owner(g.device(r), r), key) != nullptr;
        fixed = all && ex.bind_static(g.device(rank), /*make=*/false);
      }
      const bool publish = i + 1 < steps;
      ex.begin(i < sync_steps ? Mode::Sync : fixed ? Mode::Static : Mode::Stale, publish, i);
      const auto band = me.sampler->scale_model_input(me.x, i).narrow(2, rank * rows, rows).contiguous();
      const auto eps = eval_band(*me.den, ex, band, t, layer_count);
      if (fixed && i >= sync_steps && publish) ex.publish_static();
      auto all = ex.finish(eps);
      for (auto& e : all) e = e.to(eps.device());
      me.x = refine(me, rank, in, at::cat(all, 2), i, me.x);
    }
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) {
      graphed = fixed;
      hooked = ex.calls();
      bucket_count = ex.buckets();
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
                 "all_gather at each in a synchronous step; in a stale step (but the last) " +
                 (graphed.load() ? std::string("one all_gather of all of them into fixed buffers after the evaluation "
                                               "(a CUDA graph on GPUs), then eps's")
                                 : (bucket_count.load() > 0 ? std::to_string(bucket_count.load()) : std::string("no")) +
                                       " asynchronous all_gather(s) of buckets of them (of " + std::to_string(buckets) +
                                       " asked), each started as its bucket fills and waited at the next step's start, "
                                       "then eps's") +
                 "; the previous step's contributions kept: " + mib + " MiB per rank";
  return o;
}

}  // namespace diffract::parallel
