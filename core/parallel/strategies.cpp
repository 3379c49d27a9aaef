#include "core/parallel/strategies.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/parallel/asyncdiff.h"
#include "core/parallel/distrifusion.h"
#include "core/parallel/loop_util.h"
#include "core/parallel/pipefusion.h"
#include "core/util/error.h"

namespace diffract::parallel {

Strategy::~Strategy() = default;

void Strategy::warm(Denoiser& d, const at::Tensor& x, double t) const { d.eval(x, t, Branch::Guided); }
void Strategy::warm_rank(Denoiser& d, const at::Tensor& x, double t, int) const { warm(d, x, t); }

std::string LoopStats::to_json() const {
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
  return j.dump();
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
  if (stop) throw engine::Cancelled{};
}

at::Tensor refine(Rank& k, int rank, const LoopInputs& in, const at::Tensor& out, int i, const at::Tensor& x) {
  auto next = k.sampler->step(out, i, x, k.gen);
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

namespace {

// CFG-parallel, optionally recording rel-MAE; shared by CfgParallel and HybridCfg.
LoopOutput run_cfg_parallel(const Strategy& s, DeviceGroup& g, const LoopInputs& in, std::vector<double>& curve) {
  auto ranks = prepare(s, g, in);
  std::atomic<int> evals{0};
  std::atomic<std::int64_t> bytes{0};
  at::Tensor result;
  std::vector<at::Tensor> maes;  // on rank 0's device; read once at the end, not per step
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& k = ranks[static_cast<std::size_t>(rank)];
    const auto dev = g.device(rank);
    const auto bytes0 = comm.bytes_sent();
    for (int i = 0; i < k.sampler->num_steps(); ++i) {
      gate.check(i);
      auto mine = eval_at(*k.den, *k.sampler, k.x, i, rank == 0 ? Branch::Cond : Branch::Uncond);
      ++evals;
      auto both = comm.all_gather(mine);
      const auto cond = both[0].to(dev), uncond = both[1].to(dev);
      if (rank == 0) maes.push_back(rel_mae_tensor(cond, uncond));
      k.x = refine(k, rank, in, combine_cfg(uncond, cond, k.den->guidance_scale()), i, k.x);
    }
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) result = k.x;
  });
  if (!maes.empty()) {
    const auto all = at::stack(maes).to(at::kCPU, at::kDouble).contiguous();
    curve.assign(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
  }
  return finish(s, in, g, result, in.steps, evals.load(), bytes.load());
}

}  // namespace

LoopOutput SingleDevice::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator&) {
    auto& k = ranks[0];
    for (int i = 0; i < k.sampler->num_steps(); ++i) {
      gate.check(i);
      k.x = refine(k, rank, in, eval_at(*k.den, *k.sampler, k.x, i, Branch::Guided), i, k.x);
    }
    result = k.x;
  });
  return finish(*this, in, g, result, in.steps, in.steps, 0);
}

// One branch per rank: Cond and Uncond share a shape.
void CfgParallel::warm(Denoiser& d, const at::Tensor& x, double t) const { d.eval(x, t, Branch::Cond); }
// The stages too: their first eager calls (cuDNN autotuning, allocator growth) must not happen
// while the peer waits inside NCCL, which is how the first in-loop CUDA graph captures hung.
void HybridCfg::warm(Denoiser& d, const at::Tensor& x, double t) const {
  d.eval(x, t, Branch::Cond);
  if (k < 2 || d.splits() < 1) return;
  const int s = split < 0 ? d.splits() : std::min(split, d.splits());
  auto st = d.outer_down(x, t, Branch::Cond, s);
  const auto inner = d.inner(st.h, t, Branch::Cond, s);
  d.outer_up(std::move(st), inner, Branch::Cond, s);
}

void CfgParallel::validate(std::int64_t, bool cfg) const {
  if (!cfg) throw Error("cfg-parallel needs classifier-free guidance (a CFG scale above 1)");
}

LoopOutput CfgParallel::run(DeviceGroup& g, const LoopInputs& in) const {
  std::vector<double> curve;
  auto o = run_cfg_parallel(*this, g, in, curve);
  o.stats.rel_mae = std::move(curve);
  return o;
}

HybridWindow hybrid_cfg_window(const std::vector<double>& r, int L, double eps, int tau_cap, int k) {
  if (L < 2) throw Error("hybrid CFG: the slope window L must be 2 or more, not " + std::to_string(L));
  if (tau_cap < 0 || k < 0) throw Error("hybrid CFG: tau_cap and k must be 0 or more");
  HybridWindow w;
  w.slopes.assign(r.size(), std::numeric_limits<double>::quiet_NaN());
  w.tau1 = -1;
  // Least-squares slope over x = 0..L-1: sum((x - xm) * y) / sum((x - xm)^2).
  const double xm = (L - 1) / 2.0;
  double sxx = 0;
  for (int x = 0; x < L; ++x) sxx += (x - xm) * (x - xm);
  for (std::size_t t = static_cast<std::size_t>(L - 1); t < r.size(); ++t) {
    double sxy = 0;
    for (int x = 0; x < L; ++x) sxy += (x - xm) * r[t + 1 - static_cast<std::size_t>(L) + static_cast<std::size_t>(x)];
    w.slopes[t] = sxy / sxx;
    if (w.tau1 < 0 && w.slopes[t] >= 0 && w.slopes[t] < eps) w.tau1 = static_cast<int>(t);
  }
  if (w.tau1 < 0 || w.tau1 > tau_cap) w.tau1 = tau_cap;
  w.tau2 = w.tau1 + k;
  return w;
}

void HybridCfg::validate(std::int64_t, bool cfg) const {
  if (!cfg) throw Error("hybrid-cfg needs classifier-free guidance (a CFG scale above 1)");
  if (L < 2) throw Error("hybrid-cfg: the slope window L must be 2 or more, not " + std::to_string(L));
  if (!(eps > 0)) throw Error("hybrid-cfg: the slope threshold eps must be above 0");
  if (tau_cap < 0) throw Error("hybrid-cfg: tau_cap must be 0 or more, not " + std::to_string(tau_cap));
  if (k < 0) throw Error("hybrid-cfg: the window length k must be 0 or more, not " + std::to_string(k));
  if (split == 0 || split < -1)
    throw Error("hybrid-cfg: the split must be a down block index of 1 or more (or -1 for the last), not " +
                std::to_string(split));
}

LoopOutput HybridCfg::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  const int splits = ranks[0].den->splits();
  const int s = split < 0 ? splits : split;
  // k < 2 has no stale step, so no split is needed.
  if (k >= 2 && (splits < 1 || s > splits))
    throw Error(splits < 1 ? "hybrid-cfg: this model cannot be split into layer stages (only a UNet can); use k 0 or 1"
                           : "hybrid-cfg: split " + std::to_string(s) + " is past this UNet's last split point " +
                                 std::to_string(splits));
  const int steps = in.steps;
  const int k_run = k;
  std::atomic<int> evals{0};
  std::atomic<std::int64_t> bytes{0};
  at::Tensor result;
  std::vector<at::Tensor> maes(static_cast<std::size_t>(steps));  // rank 0's; undefined for stale steps
  int tau1 = -1;                                                   // rank 0 writes, read after the run
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& me = ranks[static_cast<std::size_t>(rank)];
    const auto dev = g.device(rank);
    const auto bytes0 = comm.bytes_sent();
    const Branch mine_branch = rank == 0 ? Branch::Cond : Branch::Uncond;
    std::vector<double> curve;  // known values until the rule fires; each rank decides alike
    int t1 = -1;
    auto stale = [&](int i) { return t1 >= 0 && i >= t1 + 2 && i <= t1 + k_run && i < steps; };
    at::Tensor h_prev, inner_prev;  // rank 1: the peer's h; rank 0: the peer's inner output
    for (int i = 0; i < steps; ++i) {
      gate.check(i);
      const double t = me.sampler->timesteps().at(static_cast<std::size_t>(i));
      at::Tensor out;
      if (!stale(i)) {
        const bool fill = stale(i + 1);
        at::Tensor mine;
        at::Tensor h, inner_out;
        if (fill) {
          auto st = me.den->outer_down(me.sampler->scale_model_input(me.x, i), t, mine_branch, s);
          h = st.h;
          inner_out = me.den->inner(h, t, mine_branch, s);
          mine = me.den->outer_up(std::move(st), inner_out, mine_branch, s);
        } else {
          mine = eval_at(*me.den, *me.sampler, me.x, i, mine_branch);
        }
        ++evals;
        auto both = comm.all_gather(mine);
        const auto cond = both[0].to(dev), uncond = both[1].to(dev);
        const auto mae = rel_mae_tensor(cond, uncond);
        if (rank == 0) maes[static_cast<std::size_t>(i)] = mae;
        if (t1 < 0) {
          // Both ranks hold the same gathered bytes and run the same kernels, so they agree on
          // tau1 without another collective; this read-back ends when the rule fires.
          curve.push_back(mae.item<double>());
          const auto w = hybrid_cfg_window(curve, L, eps, tau_cap, k);
          if (w.tau1 <= i) t1 = w.tau1;
        }
        if (fill) {
          if (rank == 0) {
            comm.send(h, 1);
            inner_prev = at::empty_like(inner_out);
            comm.recv(inner_prev, 1);
          } else {
            h_prev = at::empty_like(h);
            comm.recv(h_prev, 0);
            comm.send(inner_out, 0);
          }
        }
        out = combine_cfg(uncond, cond, me.den->guidance_scale());
      } else if (rank == 0) {
        auto st = me.den->outer_down(me.sampler->scale_model_input(me.x, i), t, Branch::Cond, s);
        if (stale(i + 1)) comm.send(st.h, 1);
        out = me.den->outer_up(std::move(st), inner_prev, Branch::Cond, s);
        ++evals;
        comm.send(out, 1);
        if (stale(i + 1)) comm.recv(inner_prev, 1);
      } else {
        // The inner stage only feeds step i+1; rank 1 runs it while rank 0 runs the outer one.
        at::Tensor inner_out;
        if (stale(i + 1)) {
          inner_out = me.den->inner(h_prev, t, Branch::Uncond, s);
          comm.recv(h_prev, 0);
        }
        out = at::empty(me.x.sizes(), me.x.options().dtype(me.den->output_dtype()));
        comm.recv(out, 0);
        if (stale(i + 1)) comm.send(inner_out, 0);
      }
      me.x = refine(me, rank, in, out, i, me.x);
    }
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) {
      result = me.x;
      tau1 = t1;
    }
  });
  std::vector<double> curve(static_cast<std::size_t>(steps), std::numeric_limits<double>::quiet_NaN());
  std::vector<at::Tensor> known;
  std::vector<std::size_t> where;
  for (std::size_t i = 0; i < maes.size(); ++i)
    if (maes[i].defined()) {
      known.push_back(maes[i]);
      where.push_back(i);
    }
  if (!known.empty()) {
    const auto all = at::stack(known).to(at::kCPU, at::kDouble).contiguous();
    for (std::size_t j = 0; j < where.size(); ++j) curve[where[j]] = all.data_ptr<double>()[j];
  }
  auto o = finish(*this, in, g, result, steps, evals.load(), bytes.load());
  int stale_steps = 0;
  if (tau1 >= 0) stale_steps = std::max(0, std::min(tau1 + k_run, steps - 1) - (tau1 + 2) + 1);
  // Where the rule did not fire inside the loop, tau1 / tau2 are the ones it would pick later.
  const auto w = tau1 >= 0 ? HybridWindow{tau1, tau1 + k, {}} : hybrid_cfg_window(curve, L, eps, tau_cap, k);
  o.stats.rel_mae = std::move(curve);
  o.stats.tau1 = w.tau1;
  o.stats.tau2 = w.tau2;
  o.stats.note = stale_steps > 0
                     ? "steps " + std::to_string(tau1 + 2) + ".." + std::to_string(tau1 + 1 + stale_steps) +
                           " ran layer-split one-step-stale (split " + std::to_string(s) + ", step " +
                           std::to_string(tau1 + 1) + " filled the pipeline); the others CFG-parallel"
                     : "every step ran CFG-parallel (the stale window fell outside the loop or k < 2)";
  return o;
}

std::string DRiffusion::name() const {
  return std::string(cfg_split ? "cfg-" : "") + (mode == Mode::Aggressive ? "driffusion-aggressive" : "driffusion");
}

void DRiffusion::validate(std::int64_t, bool cfg) const {
  if (n < 1)
    throw Error(name() + " needs " + (cfg_split ? "an even number of devices, 2 or more" : "1 or more devices") +
                ", not " + std::to_string(devices()));
  if (cfg_split && !cfg)
    throw Error(name() + " splits the prompt and the negative prompt over two devices: it needs CFG (a scale above 1)");
}

void DRiffusion::warm(Denoiser& d, const at::Tensor& x, double t) const {
  if (cfg_split) {
    d.eval(x, t, Branch::Cond);  // one branch: the shape every rank evaluates
    return;
  }
  Strategy::warm(d, x, t);
  if (pair_branches && n >= 2 && d.cfg()) d.eval(x, t, Branch::Cond);  // the paired rounds' shape
}

std::vector<int> DRiffusion::round_points(Mode mode, int steps, int n) {
  std::vector<int> points;
  for (int i = 0; i < steps;) {
    if (mode == Mode::Conservative) {
      points.push_back(1);
      const int drafts = std::min(n, steps - 1 - i);
      if (drafts > 0) points.push_back(drafts);
      i += drafts + 1;
    } else {
      const int drafts = i > 0 ? std::min(n - 1, steps - 1 - i) : 0;
      points.push_back(drafts + 1);
      i += drafts + 1;
    }
  }
  return points;
}

int DRiffusion::expected_rounds(Mode mode, int steps, int n) {
  if (steps <= 0) return 0;
  if (mode == Mode::Aggressive) return 1 + (steps - 1 + n - 1) / n;
  const int r = steps % (n + 1);
  return 2 * (steps / (n + 1)) + (r == 0 ? 0 : r == 1 ? 1 : 2);
}

LoopOutput DRiffusion::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  std::atomic<int> evals{0};
  std::atomic<std::int64_t> bytes{0};
  int rounds = 0, paired = 0;
  at::Tensor result;
  const Mode m = mode;
  const int devices = n;  // drafts per round
  const bool split = cfg_split;
  const bool pair_idle = !cfg_split && pair_branches && ranks.front().den->cfg();
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& k = ranks[static_cast<std::size_t>(rank)];
    auto& s = *k.sampler;
    const auto dev = g.device(rank);
    const int total = s.num_steps();
    const auto bytes0 = comm.bytes_sent();
    int my_rounds = 0;
    // Evaluates points[r] (state at step first + r) on rank r; every rank gets all outputs.
    // Idle ranks contribute zeros: NCCL needs a tensor of the same shape from every rank.
    // Paired (cfg_split, or a round with half as many points as ranks or fewer) the point is
    // rank / 2, its branch the rank's parity, and the pairs are combined after the exchange.
    auto round = [&](const std::vector<at::Tensor>& points, int first) {
      gate.check(my_rounds++);
      const int p = static_cast<int>(points.size());
      const bool pairs = split || (pair_idle && 2 * p <= devices);
      at::Tensor mine;
      const int point = pairs ? rank / 2 : rank;
      if (point < p) {
        const auto branch = !pairs ? Branch::Guided : rank % 2 == 0 ? Branch::Cond : Branch::Uncond;
        mine = eval_at(*k.den, s, points[static_cast<std::size_t>(point)], first + point, branch);
        if (!pairs || rank % 2 == 0) ++evals;
      } else {
        mine = at::zeros(k.x.sizes(), k.x.options().dtype(k.den->output_dtype()));
      }
      auto all = comm.all_gather(mine);
      if (rank == 0) {
        ++rounds;
        if (pairs && !split) ++paired;
      }
      std::vector<at::Tensor> outs;
      for (std::size_t r = 0; r < points.size(); ++r)
        outs.push_back(pairs ? combine_cfg(all[2 * r + 1].to(dev), all[2 * r].to(dev), k.den->guidance_scale())
                             : all[r].to(dev));
      return outs;
    };
    at::Tensor stale;  // aggressive: the previous round's last output
    int i = 0;
    while (i < total) {
      const auto anchor = k.x;
      if (m == Mode::Conservative) {
        const auto eps_i = round({anchor}, i)[0];
        k.x = refine(k, rank, in, eps_i, i, anchor);
        const int drafts = std::min(devices, total - 1 - i);
        if (drafts > 0) {
          std::vector<at::Tensor> points{k.x};  // draft for i+1: the refined state itself
          for (int d = 2; d <= drafts; ++d) points.push_back(s.jump(eps_i, i, i + d, anchor, k.gen));
          const auto outs = round(points, i + 1);
          for (int d = 1; d <= drafts; ++d) k.x = refine(k, rank, in, outs[static_cast<std::size_t>(d - 1)], i + d, k.x);
        }
        i += drafts + 1;
      } else {
        const int drafts = stale.defined() ? std::min(devices - 1, total - 1 - i) : 0;
        std::vector<at::Tensor> points{anchor};
        for (int d = 1; d <= drafts; ++d) points.push_back(s.jump(stale, i, i + d, anchor, k.gen));
        const auto outs = round(points, i);
        for (int d = 0; d <= drafts; ++d) k.x = refine(k, rank, in, outs[static_cast<std::size_t>(d)], i + d, k.x);
        stale = outs.back();
        i += drafts + 1;
      }
    }
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) result = k.x;
  });
  auto o = finish(*this, in, g, result, rounds, evals.load(), bytes.load());
  o.stats.paired_rounds = paired;
  return o;
}

void DataParallel::validate(std::int64_t batch, bool) const {
  if (n < 1) throw Error("data-parallel needs 1 or more devices, not " + std::to_string(n));
  if (batch < n)
    throw Error("data-parallel on " + std::to_string(n) + " devices needs a batch of at least " + std::to_string(n) +
                ", not " + std::to_string(batch));
}

// The slices are batch / n rows, and one more on the first batch % n ranks.
void DataParallel::warm(Denoiser& d, const at::Tensor& x, double t) const {
  const std::int64_t batch = x.size(0), base = batch / n;
  d.rows(0, base)->eval(x.narrow(0, 0, base), t, Branch::Guided);
  if (batch % n) d.rows(0, base + 1)->eval(x.narrow(0, 0, base + 1), t, Branch::Guided);
}

LoopOutput DataParallel::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  const std::int64_t batch = in.latents.size(0);
  std::atomic<int> evals{0};
  std::atomic<std::int64_t> bytes{0};
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& k = ranks[static_cast<std::size_t>(rank)];
    const auto bytes0 = comm.bytes_sent();
    const std::int64_t base = batch / n, extra = batch % n;
    const std::int64_t begin = rank * base + std::min<std::int64_t>(rank, extra);
    const std::int64_t count = base + (rank < extra ? 1 : 0);
    auto den = k.den->rows(begin, count);
    auto x = k.x.narrow(0, begin, count).contiguous();
    for (int i = 0; i < k.sampler->num_steps(); ++i) {
      gate.check(i);
      auto out = eval_at(*den, *k.sampler, x, i, Branch::Guided);
      ++evals;
      auto next = k.sampler->step(out, i, x, k.gen);
      // on_step reports rank 0's slice (the first images of the batch).
      if (rank == 0 && in.on_step) in.on_step(i, out, x, next);
      x = next;
    }
    // Slices differ by a row when n does not divide the batch; NCCL gathers equal shapes, so
    // every rank sends a slice padded to the largest.
    const std::int64_t widest = base + (extra > 0 ? 1 : 0);
    auto padded = count == widest ? x : at::cat({x, at::zeros_like(x.narrow(0, 0, widest - count))});
    auto all = comm.all_gather(padded);
    for (int r = 0; r < n; ++r) all[static_cast<std::size_t>(r)] = all[static_cast<std::size_t>(r)].narrow(0, 0, base + (r < extra ? 1 : 0));
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) {
      for (auto& t : all) t = t.to(g.device(0));
      result = at::cat(all);
    }
  });
  return finish(*this, in, g, result, in.steps, evals.load(), bytes.load());
}

void StepSkipping::validate(std::int64_t, bool) const {
  if (skip < 1) throw Error("step skipping needs a skip of 1 or more, not " + std::to_string(skip));
}

LoopOutput StepSkipping::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  int rounds = 0;
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator&) {
    auto& k = ranks[0];
    const int total = k.sampler->num_steps();
    for (int i = 0; i < total; i += skip) {
      gate.check(i);
      auto out = eval_at(*k.den, *k.sampler, k.x, i, Branch::Guided);
      ++rounds;
      const int j = std::min(i + skip, total);
      if (j == i + 1) {
        k.x = refine(k, rank, in, out, i, k.x);
      } else {
        auto next = k.sampler->jump(out, i, j, k.x, k.gen);
        if (in.on_step) in.on_step(i, out, k.x, next);
        k.x = next;
      }
    }
    result = k.x;
  });
  return finish(*this, in, g, result, rounds, rounds, 0);
}

std::unique_ptr<Strategy> make_strategy(const std::string& name, int n, int patches) {
  if (name == "pipefusion" || name == "cfg-pipefusion") {
    auto s = std::make_unique<PipeFusion>();
    s->cfg_split = name == "cfg-pipefusion";
    if (s->cfg_split && (n < 2 || n % 2 != 0))
      throw Error("cfg-pipefusion runs one pipeline for the prompt and one for the negative prompt, each over half "
                  "the devices: it needs an even number of devices, 2 or more, not " + std::to_string(n));
    s->n = s->cfg_split ? n / 2 : n;
    s->patches = patches;
    return s;
  }
  if (name == "asyncdiff") {
    auto s = std::make_unique<AsyncDiff>();
    s->n = n;
    return s;
  }
  if (name.rfind("asyncdiff-stride", 0) == 0) {
    const std::string digits = name.substr(std::string("asyncdiff-stride").size());
    if (digits.empty() || digits.size() > 3 || digits.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(digits) < 1)
      throw Error("strategy '" + name + "': the stride after asyncdiff-stride must be a whole number 1 or more");
    auto s = std::make_unique<AsyncDiff>();
    s->stride = std::stoi(digits);
    s->n = n - (s->stride - 1);  // the last component also runs on stride - 1 more devices
    if (s->n < 2)
      throw Error(name + " runs 2 or more UNet components on components + " + std::to_string(s->stride - 1) +
                  " devices: it needs " + std::to_string(s->stride + 1) + " or more devices, not " + std::to_string(n));
    return s;
  }
  if (name == "distrifusion") {
    auto s = std::make_unique<DistriFusion>();
    s->n = n;
    return s;
  }
  if (name == "single") return std::make_unique<SingleDevice>();
  if (name == "cfg-parallel") return std::make_unique<CfgParallel>();
  if (name == "hybrid-cfg") return std::make_unique<HybridCfg>();
  if (name == "driffusion" || name == "driffusion-aggressive" || name == "cfg-driffusion" ||
      name == "cfg-driffusion-aggressive") {
    auto s = std::make_unique<DRiffusion>();
    s->cfg_split = name.rfind("cfg-", 0) == 0;
    if (s->cfg_split && (n < 2 || n % 2 != 0))
      throw Error(name + " runs each draft's prompt and negative prompt on a pair of devices: it needs an even "
                  "number of devices, 2 or more, not " + std::to_string(n));
    s->n = s->cfg_split ? n / 2 : n;
    s->mode = name.find("aggressive") == std::string::npos ? DRiffusion::Mode::Conservative
                                                           : DRiffusion::Mode::Aggressive;
    const char* pairs = std::getenv("DIFFRACT_DRIFFUSION_PAIRS");  // =0: idle devices stay idle (A/B)
    s->pair_branches = !(pairs && std::string(pairs) == "0");
    return s;
  }
  if (name == "data-parallel") {
    auto s = std::make_unique<DataParallel>();
    s->n = n;
    return s;
  }
  if (name == "step-skip") {
    auto s = std::make_unique<StepSkipping>();
    s->skip = n;
    return s;
  }
  throw Error("unknown strategy '" + name +
              "' (single, cfg-parallel, hybrid-cfg, driffusion, driffusion-aggressive, cfg-driffusion, "
              "cfg-driffusion-aggressive, data-parallel, step-skip, pipefusion, cfg-pipefusion, asyncdiff, asyncdiff-stride2, "
              "distrifusion)");
}

}  // namespace diffract::parallel
