#include "core/parallel/driffusion.h"

#include <algorithm>
#include <atomic>

#include <ATen/ATen.h>

#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

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


}  // namespace diffract::parallel
