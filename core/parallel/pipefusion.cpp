#include "core/parallel/pipefusion.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include <ATen/ATen.h>

#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

}  // namespace

void PipeFusion::validate(std::int64_t, bool cfg) const {
  const std::string me = name();
  if (n < 1)
    throw Error(cfg_split ? me + " needs an even number of devices, 2 or more (a pipeline per CFG branch), not " +
                                std::to_string(devices())
                          : me + " needs 1 or more devices (stages), not " + std::to_string(n));
  if (cfg_split && !cfg)
    throw Error(me + " runs the prompt and the negative prompt on two pipelines: it needs CFG (a scale above 1); "
                "without it use pipefusion");
  if (patches < 0) throw Error(me + ": patches must be 0 (one per stage) or more, not " + std::to_string(patches));
  if (patch_count() < n)
    throw Error(me + ": " + std::to_string(patch_count()) + " patches for " + std::to_string(n) +
                " stages; it needs at least one patch per stage (patches >= stages)");
  if (warmup_steps < 1)
    throw Error(me + " needs 1 or more synchronous warm-up steps to fill its K/V caches, not " +
                std::to_string(warmup_steps));
}

void PipeFusion::warm(Denoiser&, const at::Tensor&, double) const {}

void PipeFusion::check_shape(std::int64_t layers, std::int64_t latent_height, std::int64_t patch_size) const {
  if (n > layers)
    throw Error(name() + ": " + std::to_string(n) + " stages for a transformer of " + std::to_string(layers) +
                " blocks; at most one stage per block");
  const std::int64_t token_rows = latent_height / patch_size;
  if (token_rows % patch_count())
    throw Error(name() + ": the latent's " + std::to_string(token_rows) + " rows of transformer patches (" +
                std::to_string(latent_height) + " latent rows / patch size " + std::to_string(patch_size) +
                ") do not split into " + std::to_string(patch_count()) + " equal patches");
}

std::pair<int, int> PipeFusion::rank_stage(const Strategy& strategy, int rank) {
  const auto* pipefusion = dynamic_cast<const PipeFusion*>(&strategy);
  return pipefusion ? std::make_pair(pipefusion->stage_of(rank), pipefusion->n) : std::make_pair(rank, 0);
}

std::pair<int, int> PipeFusion::stage_blocks(int rank, int n, int layers) {
  return {static_cast<int>(static_cast<std::int64_t>(rank) * layers / n),
          static_cast<int>(static_cast<std::int64_t>(rank + 1) * layers / n)};
}

bool PipeFusion::uses_weight(const std::string& name, int rank, int n, int layers, int single_layers) {
  const auto [first, last] = stage_blocks(rank, n, layers + single_layers);
  for (const auto& [prefix, offset] : {std::pair<std::string, int>{"transformer_blocks.", 0},
                                      std::pair<std::string, int>{"single_transformer_blocks.", layers}})
    if (starts_with(name, prefix)) {
      const int index = offset + std::stoi(name.substr(prefix.size()));
      return index >= first && index < last;
    }
  if (starts_with(name, "pos_embed.") || starts_with(name, "x_embedder.") || starts_with(name, "context_embedder."))
    return rank == 0;
  if (starts_with(name, "norm_out.") || starts_with(name, "proj_out.")) return rank == n - 1;
  return true;  // time_text_embed: every rank
}

int PipeFusion::messages_per_step(bool synchronous, int n, int patches, bool cfg_split) {
  const int chain = n < 2 ? 0 : n;                // one pipeline, per pass
  const int pass = cfg_split ? 2 * chain + 2 : chain;  // two pipelines and the heads' swap
  return synchronous ? pass : patches * pass;
}

LoopOutput PipeFusion::run(DeviceGroup& g, const LoopInputs& in) const {
  using K = schedulers::SamplerKind;
  if (in.kind != K::FlowMatchEuler && in.kind != K::Euler && in.kind != K::DDIM)
    throw Error(name() + " steps the latents a patch at a time: it needs a sampler without history or noise "
                "(flow-euler, euler, ddim)");
  auto ranks = prepare(*this, g, in);
  auto& head_den = *ranks[0].den;
  const int layers = head_den.pipe_blocks();
  if (layers == 0)
    throw Error(name() + " splits a transformer's blocks into stages (SD3, Flux); this model has none");
  const std::int64_t height = in.latents.size(2), width = in.latents.size(3), p = head_den.pipe_token_rows();
  check_shape(layers, height, p);
  const int stages = n, m = patch_count(), steps = in.steps;
  const int sync_steps = std::min(warmup_steps, steps);
  // Without the split the tail combines the branches of a 2B batch; with it each pipeline runs
  // one branch at batch B and the heads combine.
  const bool split = cfg_split, batched_cfg = head_den.cfg() && !split;
  const std::int64_t batch = in.latents.size(0), channels = in.latents.size(1), rows = height / m;
  const int items = (steps - sync_steps) * m;
  const int ticks = items > 0 ? items + stages - 1 : 0;

  StepTraffic traffic(steps);
  const auto sent = [&traffic](int step, const at::Tensor& t) { traffic.sent(step, t); };
  std::atomic<std::int64_t> bytes{0};
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& k = ranks[static_cast<std::size_t>(rank)];
    auto& den = *k.den;
    const auto dev = g.device(rank);
    const auto opts = at::TensorOptions().device(dev).dtype(den.output_dtype());
    // This rank's pipeline (0: cond, 1: uncond with the split), its stage, and its head's rank.
    const int pipe = rank / stages, stage_index = rank % stages, base = pipe * stages;
    const Branch branch = !split ? Branch::Guided : pipe == 0 ? Branch::Cond : Branch::Uncond;
    const auto range = stage_blocks(stage_index, stages, layers);
    const auto stage = den.pipe_stage(range.first, range.second, branch, height, width);
    const bool head = stage_index == 0, tail = stage_index == stages - 1;
    const int partner = pipe == 0 ? stages : 0;  // the other pipeline's head (split only)
    const auto bytes0 = comm.bytes_sent();
    if (head) k.x = k.x.clone();  // stepped in place, a patch at a time
    const auto timestep = [&](int i) { return k.sampler->timesteps().at(static_cast<std::size_t>(i)); };
    // The head's input: latent rows [row0, row0 + count) at step i, both branches if batched.
    const auto input_rows = [&](int i, std::int64_t row0, std::int64_t count) {
      auto x = k.sampler->scale_model_input(k.x, i).narrow(2, row0, count);
      if (batched_cfg) x = at::cat({x, x});
      return x.to(opts);
    };
    const auto output = [&](const at::Tensor& raw) {
      if (!batched_cfg) return raw;
      auto parts = raw.chunk(2);
      return combine_cfg(parts[0], parts[1], den.guidance_scale());
    };
    const auto v_buffer = [&](std::int64_t count) { return at::empty({batch, channels, count, width}, opts); };
    // A head's patch output (step i) -> the guided one. With the split the heads swap their
    // branches' outputs, rank 0 sending first (the order in the header), and both combine.
    const auto guide = [&](const at::Tensor& mine, int i) {
      if (!split) return mine;
      auto other = at::empty_like(mine);
      if (pipe == 0) {
        comm.send(mine, partner);
        sent(i, mine);
        comm.recv(other, partner);
      } else {
        comm.recv(other, partner);
        comm.send(mine, partner);
        sent(i, mine);
      }
      return pipe == 0 ? combine_cfg(other, mine, den.guidance_scale()) : combine_cfg(mine, other, den.guidance_scale());
    };

    for (int i = 0; i < sync_steps; ++i) {
      gate.check(i);
      at::Tensor in_act;
      if (head) {
        in_act = input_rows(i, 0, height);
      } else {
        in_act = at::empty(stage->activation_shape(height), opts);
        comm.recv(in_act, rank - 1);
      }
      const auto out = stage->pass(in_act, 0, height, timestep(i));
      at::Tensor v;
      if (!tail) {
        comm.send(out, rank + 1);
        sent(i, out);
      } else {
        v = output(out);
        if (!head) {
          comm.send(v, base);
          sent(i, v);
        }
      }
      if (head) {
        if (!tail) {
          v = v_buffer(height);
          comm.recv(v, base + stages - 1);
        }
        k.x = refine(k, rank, in, guide(v, i), i, k.x);  // reports on rank 0 only
      }
    }

    at::Tensor incoming;        // from the previous stage, for the next tick
    at::Tensor v_step, before;  // head: the step being completed, patch by patch
    const auto busy = [&](int item) { return item >= 0 && item < items; };
    for (int tau = 0; tau < ticks; ++tau) {
      gate.check(sync_steps + tau);
      const int item = tau - stage_index;
      const int item_step = sync_steps + item / m;
      at::Tensor act, v;
      if (busy(item)) {
        const int q = item % m;
        const auto out = stage->pass(head ? input_rows(item_step, q * rows, rows) : incoming, q * rows, rows,
                                     timestep(item_step));
        if (!tail) act = out;
        else v = output(out);
      }
      // The chain: 0 sends, 1 receives then sends, ..., the last sends to 0, 0 receives (ranks
      // counted from the pipeline's head); then the heads' swap (guide).
      if (head && act.defined()) {
        comm.send(act, rank + 1);
        sent(item_step, act);
      }
      if (!head && busy(tau - (stage_index - 1))) {
        incoming = at::empty(stage->activation_shape(rows), opts);
        comm.recv(incoming, rank - 1);
      }
      if (!head && act.defined()) {
        comm.send(act, rank + 1);
        sent(item_step, act);
      }
      if (!head && v.defined()) {
        comm.send(v, base);
        sent(item_step, v);
      }
      const int done = tau - (stages - 1);
      if (head && busy(done)) {
        if (!tail) {
          v = v_buffer(rows);
          comm.recv(v, base + stages - 1);
        }
        const int i = sync_steps + done / m, q = done % m;
        v = guide(v, i);
        if (q == 0) {
          before = k.x.clone();
          v_step = at::empty(k.x.sizes(), v.options());
        }
        v_step.narrow(2, q * rows, rows).copy_(v);
        auto x_rows = k.x.narrow(2, q * rows, rows);
        x_rows.copy_(k.sampler->step(v, i, x_rows, k.gen));
        if (q == m - 1 && rank == 0 && in.on_step) in.on_step(i, v_step, before, k.x.clone());
      }
    }
    bytes += comm.bytes_sent() - bytes0;
    if (rank == 0) result = k.x;
  });

  auto o = finish(*this, in, g, result, steps, steps, bytes.load());
  o.stats.messages_per_step = traffic.messages();
  o.stats.bytes_per_step = traffic.bytes();
  // Counted in each rank's own model: a replica holding only its stage's weights has the others
  // empty, so rank 0's would undercount the other stages.
  for (int r = 0; r < devices(); ++r)
    o.stats.weights_per_rank.push_back(ranks[static_cast<std::size_t>(r)].den->pipe_weights(stage_of(r), stages));
  o.stats.note = std::string(split ? "2 pipelines (cond on ranks 0.." + std::to_string(stages - 1) +
                                          ", uncond on " + std::to_string(stages) + ".." +
                                          std::to_string(2 * stages - 1) + "), each " : "") +
                 std::to_string(stages) + " stages x " + std::to_string(m) + " patches; " +
                 std::to_string(sync_steps) + " synchronous step(s), then " + std::to_string(ticks) +
                 " pipeline ticks (each one stage on one patch)";
  return o;
}

}  // namespace diffract::parallel
