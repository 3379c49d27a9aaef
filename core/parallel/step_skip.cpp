#include "core/parallel/step_skip.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

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


}  // namespace diffract::parallel
