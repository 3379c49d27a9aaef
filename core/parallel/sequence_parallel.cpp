#include "core/parallel/sequence_parallel.h"

#include <atomic>

#include <ATen/ATen.h>

#include "core/models/common/sequence_parallel.h"
#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

namespace {

// The models' exchange over a rank's communicator, counting what it moves.
class CommunicatorExchange final : public models::SequenceExchange {
 public:
  explicit CommunicatorExchange(Communicator& comm) : comm_(comm) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  std::vector<at::Tensor> all_to_all(const std::vector<at::Tensor>& chunks) override { return comm_.all_to_all(chunks); }
  std::vector<at::Tensor> all_gather(const at::Tensor& t) override { return comm_.all_gather(t); }

 private:
  Communicator& comm_;
};

}  // namespace

void SequenceParallel::validate(std::int64_t, bool) const {
  if (n < 1) throw Error("sequence-parallel needs 1 or more devices, not " + std::to_string(n));
}

void SequenceParallel::warm(Denoiser&, const at::Tensor&, double) const {}

LoopOutput SequenceParallel::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  if (!ranks.front().den->sequence_parallel())
    throw Error("sequence-parallel runs Flux and SD3 models: this model's attention cannot be split by sequence");
  std::atomic<int> evals{0};
  std::atomic<std::int64_t> bytes{0};
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& k = ranks[static_cast<std::size_t>(rank)];
    CommunicatorExchange exchange(comm);
    const auto bytes0 = comm.bytes_sent();
    for (int i = in.first_step; i < k.sampler->num_steps(); ++i) {
      gate.check(i);
      const auto input = k.sampler->scale_model_input(k.x, i);
      const auto out = k.den->eval_sequence_parallel(
          input, k.sampler->timesteps().at(static_cast<std::size_t>(i)), Branch::Guided, exchange);
      if (rank == 0) ++evals;
      k.x = refine(k, rank, in, out.to(k.x.device()), i, k.x);
    }
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) result = k.x;
  });
  return finish(*this, in, g, result, in.steps - in.first_step, evals.load(), bytes.load());
}

}  // namespace diffract::parallel
