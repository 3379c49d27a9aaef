#include "core/parallel/strategy.h"

#include <algorithm>
#include <mutex>

#include <nlohmann/json.hpp>

#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

Strategy::~Strategy() = default;

void Strategy::warm(Denoiser& d, const at::Tensor& x, double t) const { d.eval(x, t, Branch::Guided); }
void Strategy::warm_rank(Denoiser& d, const at::Tensor& x, double t, int) const { warm(d, x, t); }

nlohmann::json LoopStats::json() const {
  nlohmann::json j = {{"strategy", strategy}, {"devices", devices},     {"steps", steps},
                      {"rounds", rounds},     {"evaluations", evaluations}, {"bytes_sent", bytes_sent}};
  if (paired_rounds > 0) j["paired_rounds"] = paired_rounds;
  if (!rel_mae.empty()) j["rel_mae"] = rel_mae;
  if (tau1 >= 0) {
    j["tau1"] = tau1;
    j["tau2"] = tau2;
  }
  if (!messages_per_step.empty()) j["messages_per_step"] = messages_per_step;
  if (!bytes_per_step.empty()) j["bytes_per_step"] = bytes_per_step;
  if (!weights_per_rank.empty()) j["weights_per_rank"] = weights_per_rank;
  if (!note.empty()) j["note"] = note;
  if (cache_threshold >= 0) j["cache_threshold"] = cache_threshold;
  if (model_work >= 0) {
    j["reused_steps"] = reused_steps;
    j["model_work"] = model_work;
  }
  for (const auto& [key, ms] : {std::pair<const char*, double>{"warm_ms", warm_ms}, {"loop_ms", loop_ms},
                                {"setup_ms", setup_ms}, {"finish_ms", finish_ms}, {"before_call_ms", before_call_ms},
                                {"call_ms", call_ms}, {"after_call_ms", after_call_ms}})
    if (ms >= 0) j[key] = ms;
  if (!peak_memory_per_rank.empty()) j["peak_memory_per_rank"] = peak_memory_per_rank;
  return j;
}

namespace detail {

using schedulers::Sampler;

void check_group(const Strategy& s, const DeviceGroup& g) {
  if (g.size() != s.devices())
    throw Error("strategy " + s.name() + " needs " + std::to_string(s.devices()) + " device(s); the group has " +
                std::to_string(g.size()));
}

std::vector<Rank> prepare(const Strategy& s, DeviceGroup& g, const LoopInputs& in) {
  check_group(s, g);
  if (!in.latents.defined() || !in.make_denoiser) throw Error("strategy " + s.name() + ": no latents or denoiser given");
  std::vector<Rank> ranks(static_cast<std::size_t>(g.size()));
  for (int r = 0; r < g.size(); ++r) {
    auto& k = ranks[static_cast<std::size_t>(r)];
    k.sampler = Sampler::create(in.kind, in.config, in.steps);
    if (in.generator.defined()) {
      at::Generator source = in.generator;  // a handle to the same generator
      std::lock_guard<std::mutex> lock(source.mutex());
      k.gen = source.clone();
    }
    k.den = in.make_denoiser(r, g.device(r));
    k.x = in.latents.to(g.device(r));
    if (in.blend_mask.defined()) {
      k.mask = in.blend_mask.to(g.device(r));
      k.image_latents = in.blend_image_latents.to(g.device(r));
      k.noise = in.blend_noise.to(g.device(r));
    }
  }
  s.validate(ranks[0].den->batch(), ranks[0].den->cfg());
  return ranks;
}

void CancelGate::check(int round) {
  if (!token_) return;
  bool stop;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = decided_.find(round);
    if (it == decided_.end()) it = decided_.emplace(round, token_->cancelled()).first;
    stop = it->second;
  }
  if (stop) throw job::Cancelled{};
}

BatchSlice batch_slice(std::int64_t batch, int n, int rank) {
  const std::int64_t base = batch / n, extra = batch % n;
  return {rank * base + std::min<std::int64_t>(rank, extra), base + (rank < extra ? 1 : 0), base + (extra > 0 ? 1 : 0)};
}

std::vector<std::int64_t> share_sizes(std::int64_t batch, int n) {
  const auto last = batch_slice(batch, n, n - 1);
  if (last.widest == last.count) return {last.count};
  return {last.count, last.widest};
}

at::Tensor gather_batch(Communicator& comm, const at::Tensor& x, std::int64_t batch, int n,
                        const std::optional<c10::Device>& to) {
  const auto widest = batch_slice(batch, n, 0).widest;
  const auto count = x.size(0);
  auto all = comm.all_gather(count == widest ? x : at::cat({x, at::zeros_like(x.narrow(0, 0, widest - count))}));
  if (!to) return {};
  for (int r = 0; r < n; ++r) {
    auto& t = all[static_cast<std::size_t>(r)];
    t = t.narrow(0, 0, batch_slice(batch, n, r).count).to(*to);
  }
  return at::cat(all);
}

at::Tensor refine(Rank& k, int rank, const LoopInputs& in, const at::Tensor& out, int i, const at::Tensor& x) {
  auto next = k.sampler->step(out, i, x, k.gen);
  if (k.mask.defined()) next = schedulers::blend_outside_mask(*k.sampler, i, next, k.mask, k.image_latents, k.noise);
  if (rank == 0 && in.on_step) in.on_step(i, out, x, next);
  return next;
}

LoopOutput finish(const Strategy& s, const LoopInputs& in, DeviceGroup& g, at::Tensor latents, int rounds,
                  int evaluations, std::int64_t bytes) {
  LoopOutput o;
  o.latents = std::move(latents);
  o.stats.strategy = s.name();
  o.stats.devices = g.size();
  o.stats.steps = in.steps;
  o.stats.rounds = rounds;
  o.stats.evaluations = evaluations;
  o.stats.bytes_sent = bytes;
  return o;
}

}  // namespace detail

using namespace detail;

LoopOutput SingleDevice::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator&) {
    auto& k = ranks[0];
    for (int i = in.first_step; i < k.sampler->num_steps(); ++i) {
      gate.check(i);
      k.x = refine(k, rank, in, eval_at(*k.den, *k.sampler, k.x, i, Branch::Guided), i, k.x);
    }
    result = k.x;
  });
  return finish(*this, in, g, result, in.steps, in.steps, 0);
}


}  // namespace diffract::parallel
