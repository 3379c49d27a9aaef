#include "core/parallel/cfg_parallel.h"

#include <atomic>

#include <ATen/ATen.h>

#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

namespace {

// CFG-parallel, recording rel-MAE per step.
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
    for (int i = in.first_step; i < k.sampler->num_steps(); ++i) {
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
  return finish(s, in, g, result, in.steps - in.first_step, evals.load(), bytes.load());
}

}  // namespace

// One branch per rank: Cond and Uncond share a shape.
void CfgParallel::warm(Denoiser& d, const at::Tensor& x, double t) const { d.eval(x, t, Branch::Cond); }

void CfgParallel::validate(std::int64_t, bool cfg) const {
  if (!cfg) throw Error("cfg-parallel needs classifier-free guidance (a CFG scale above 1)");
}

LoopOutput CfgParallel::run(DeviceGroup& g, const LoopInputs& in) const {
  std::vector<double> curve;
  auto o = run_cfg_parallel(*this, g, in, curve);
  o.stats.rel_mae = std::move(curve);
  return o;
}


}  // namespace diffract::parallel
