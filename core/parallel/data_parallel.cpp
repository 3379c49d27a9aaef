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

void DataParallel::warm(Denoiser& d, const at::Tensor& x, double t) const {
  for (const auto rows : share_sizes(x.size(0), n)) d.rows(0, rows)->eval(x.narrow(0, 0, rows), t, Branch::Guided);
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
    const auto [begin, count, widest] = batch_slice(batch, n, rank);
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
    auto all = gather_batch(comm, x, batch, n, rank == 0 ? std::optional(g.device(0)) : std::nullopt);
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) result = all;
  });
  return finish(*this, in, g, result, in.steps - in.first_step, evals.load(), bytes.load());
}


}  // namespace diffract::parallel
