#include "core/parallel/hybrid_cfg.h"

#include <algorithm>
#include <atomic>
#include <limits>

#include <ATen/ATen.h>

#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

// The stages too: their first eager calls (cuDNN autotuning, allocator growth) must not happen
// while the peer waits inside NCCL, or the ranks hang (device_group.cpp).
void HybridCfg::warm(Denoiser& d, const at::Tensor& x, double t) const {
  d.eval(x, t, Branch::Cond);
  if (k < 2 || d.splits() < 1) return;
  const int s = split < 0 ? d.splits() : std::min(split, d.splits());
  auto st = d.outer_down(x, t, Branch::Cond, s);
  const auto inner = d.inner(st.h, t, Branch::Cond, s);
  d.outer_up(std::move(st), inner, Branch::Cond, s);
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


}  // namespace diffract::parallel
