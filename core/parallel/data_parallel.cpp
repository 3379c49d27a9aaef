#include "core/parallel/data_parallel.h"

#include <algorithm>
#include <atomic>

#include <ATen/ATen.h>

#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

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
    // This rank's rows of an inpainting job's blend.
    const auto rows = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, begin, count) : t; };
    const auto mask = rows(k.mask), image_latents = rows(k.image_latents), noise = rows(k.noise);
    const int steps = k.sampler->num_steps();
    for (int i = in.first_step; i < steps; ++i) {
      gate.check(i);
      auto out = eval_at(*den, *k.sampler, x, i, Branch::Guided);
      ++evals;
      auto next = k.sampler->step(out, i, x, k.gen);
      if (mask.defined()) next = schedulers::blend_outside_mask(*k.sampler, i, next, mask, image_latents, noise);
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
  return finish(*this, in, g, result, in.steps - in.first_step, evals.load(), bytes.load());
}


}  // namespace diffract::parallel
