#include "core/parallel/asyncdiff.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>

#include <ATen/ATen.h>

#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

void AsyncDiff::validate(std::int64_t, bool) const {
  if (stride < 1)
    throw Error("asyncdiff: stride " + std::to_string(stride) + " (steps per round) must be 1 or more");
  if (n < 2 && stride == 1) throw Error("asyncdiff needs 2 or more devices (one per component), not " + std::to_string(n));
  if (n < 2)
    throw Error("asyncdiff stride " + std::to_string(stride) + " needs 2 or more UNet components on n + " +
                std::to_string(stride - 1) + " devices (" + std::to_string(stride + 1) + " or more devices), not " +
                std::to_string(n) + " component(s)");
  if (warmup < 1)
    throw Error("asyncdiff needs 1 or more synchronous warm-up steps to fill its pipeline, not " +
                std::to_string(warmup));
}

std::vector<int> AsyncDiff::balanced_split(const std::vector<double>& cost, int n) {
  const int layers = static_cast<int>(cost.size());
  if (n < 1) throw Error("asyncdiff: " + std::to_string(n) + " components");
  if (n > layers)
    throw Error("asyncdiff: " + std::to_string(n) + " components for a model of " + std::to_string(layers) +
                " sequential layers (at most one component per layer)");
  std::vector<double> prefix(static_cast<std::size_t>(layers) + 1, 0.0);
  for (int j = 0; j < layers; ++j) prefix[static_cast<std::size_t>(j) + 1] = prefix[static_cast<std::size_t>(j)] + cost[static_cast<std::size_t>(j)];
  const auto sum = [&](int a, int b) { return prefix[static_cast<std::size_t>(b)] - prefix[static_cast<std::size_t>(a)]; };
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][j]: the smallest largest part splitting layers [0, j) into k parts; from[k][j]: where
  // the last of them starts.
  std::vector<std::vector<double>> best(static_cast<std::size_t>(n) + 1,
                                        std::vector<double>(static_cast<std::size_t>(layers) + 1, inf));
  std::vector<std::vector<int>> from(best.size(), std::vector<int>(static_cast<std::size_t>(layers) + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= n; ++k)
    for (int j = k; j <= layers; ++j)
      for (int i = k - 1; i < j; ++i) {
        const double v = std::max(best[static_cast<std::size_t>(k) - 1][static_cast<std::size_t>(i)], sum(i, j));
        if (v < best[static_cast<std::size_t>(k)][static_cast<std::size_t>(j)]) {
          best[static_cast<std::size_t>(k)][static_cast<std::size_t>(j)] = v;
          from[static_cast<std::size_t>(k)][static_cast<std::size_t>(j)] = i;
        }
      }
  std::vector<int> bounds(static_cast<std::size_t>(n) + 1, 0);
  bounds[static_cast<std::size_t>(n)] = layers;
  for (int k = n; k >= 1; --k)
    bounds[static_cast<std::size_t>(k) - 1] = from[static_cast<std::size_t>(k)][static_cast<std::size_t>(bounds[static_cast<std::size_t>(k)])];
  return bounds;
}

int AsyncDiff::first_group(int steps, int warmup, int stride) {
  const int sync = std::min(warmup, steps);
  return std::min(steps, sync + (stride - (sync - 1) % stride) % stride);
}

namespace {

// The helpers (ranks n..n+S-2) that run in the round starting at step s: one per step of its
// group but the last.
int working_helpers(int s, int steps, int stride) { return s < steps ? std::min(stride, steps - s) - 1 : 0; }

}  // namespace

int AsyncDiff::messages_per_step(int step, int steps, int warmup, int n, int stride) {
  const int sync = std::min(warmup, steps), first = first_group(steps, warmup, stride);
  if (step < sync) return n + (step + 1 == sync ? working_helpers(first, steps, stride) : 0);
  if (step < first) return 0;
  if ((step - first) % stride != 0) return 1;
  const int next = step + stride;
  return 1 + (next < steps ? n - 1 + working_helpers(next, steps, stride) : 0);
}

void AsyncDiff::warm(Denoiser& d, const at::Tensor& x, double t) const {
  const auto layers = d.stage_layers(x.size(2), x.size(3));
  if (layers.empty() || n > static_cast<int>(layers.size())) return;
  std::vector<double> cost;
  for (const auto& l : layers) cost.push_back(l.cost);
  const auto bounds = balanced_split(cost, n);
  auto st = d.stage_input(x, t, Branch::Guided);
  for (int k = 0; k < n; ++k)
    d.run_stage(st, bounds[static_cast<std::size_t>(k)], bounds[static_cast<std::size_t>(k) + 1], t, Branch::Guided);
  d.stage_output(st, Branch::Guided);
}

void AsyncDiff::warm_rank(Denoiser& d, const at::Tensor& x, double t, int rank) const {
  const auto layers = d.stage_layers(x.size(2), x.size(3));
  if (layers.empty() || n > static_cast<int>(layers.size())) return;
  if (rank < 0 || rank >= devices()) return warm(d, x, t);
  const int component = std::min(rank, n - 1);  // stride's extra ranks run the last component
  std::vector<double> cost;
  for (const auto& l : layers) cost.push_back(l.cost);
  const auto bounds = balanced_split(cost, n);
  const int begin = bounds[static_cast<std::size_t>(component)], end = bounds[static_cast<std::size_t>(component) + 1];
  models::UNetStageState st;
  if (component == 0) {
    st = d.stage_input(x, t, Branch::Guided);
  } else {
    // What run() unpacks from its peer's message: h and the skips, in the output dtype.
    const auto options = x.options().dtype(d.output_dtype());
    const auto shapes = d.stage_shapes(begin, x.size(2), x.size(3), Branch::Guided);
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      auto z = at::zeros(shapes[i], options);
      if (i == 0) st.h = z;
      else st.skips.push_back(z);
    }
  }
  d.run_stage(st, begin, end, t, Branch::Guided);
  if (component == n - 1) d.stage_output(st, Branch::Guided);
}

namespace {

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// h then the skips, flattened into one tensor (one message).
at::Tensor pack(const models::UNetStageState& s) {
  std::vector<at::Tensor> parts;
  parts.reserve(s.skips.size() + 1);
  parts.push_back(s.h.contiguous().view(-1));
  for (const auto& k : s.skips) parts.push_back(k.contiguous().view(-1));
  return at::cat(parts);
}

models::UNetStageState unpack(const at::Tensor& flat, const std::vector<std::vector<std::int64_t>>& shapes) {
  models::UNetStageState s;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const auto count = numel_of(shapes[i]);
    auto t = flat.narrow(0, offset, count).view(shapes[i]);
    offset += count;
    if (i == 0) s.h = t;
    else s.skips.push_back(t);
  }
  return s;
}

}  // namespace

LoopOutput AsyncDiff::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  auto& d0 = *ranks[0].den;
  const std::int64_t height = in.latents.size(2), width = in.latents.size(3);
  const auto layers = d0.stage_layers(height, width);
  if (layers.empty())
    throw Error("asyncdiff: this model cannot be split into sequential stages (only an SD / SDXL UNet can; for SD3 "
                "use pipefusion)");
  std::vector<double> cost;
  for (const auto& l : layers) cost.push_back(l.cost);
  const auto bounds = balanced_split(cost, n);
  const int steps = in.steps, sync_steps = std::min(warmup, steps);
  const Branch branch = Branch::Guided;
  // The state each rank k > 0 receives: the one before its first layer.
  std::vector<std::vector<std::vector<std::int64_t>>> shapes(static_cast<std::size_t>(n));
  std::vector<std::int64_t> state_numel(static_cast<std::size_t>(n), 0);
  for (int k = 1; k < n; ++k) {
    shapes[static_cast<std::size_t>(k)] = d0.stage_shapes(bounds[static_cast<std::size_t>(k)], height, width, branch);
    for (const auto& s : shapes[static_cast<std::size_t>(k)]) state_numel[static_cast<std::size_t>(k)] += numel_of(s);
  }

  // Producer skips: how many of its input's skips component k (k > 0) passes on untouched (the
  // bottom of its output's stack, below the ones it pushes): the least depth the skip stack
  // reaches inside it.
  std::vector<std::size_t> carried(static_cast<std::size_t>(n), 0);
  for (int k = 1; k < n; ++k) {
    std::size_t least = std::numeric_limits<std::size_t>::max();
    for (int j = bounds[static_cast<std::size_t>(k)]; j <= bounds[static_cast<std::size_t>(k) + 1]; ++j)
      least = std::min(least, d0.stage_shapes(j, height, width, branch).size() - 1);
    carried[static_cast<std::size_t>(k)] = least;
  }

  StepTraffic traffic(steps);
  const auto sent = [&traffic](int step, const at::Tensor& t) { traffic.sent(step, t); };
  std::atomic<std::int64_t> bytes{0};
  at::Tensor result;
  CancelGate gate(in.cancel);
  const int first = first_group(steps, warmup, stride);
  if (stride > 1) {
    g.run([&](int rank, Communicator& comm) {
      auto& me = ranks[static_cast<std::size_t>(rank)];
      auto& den = *me.den;
      const auto dev = g.device(rank);
      const int comp = std::min(rank, n - 1), helper = rank >= n ? rank - n : -1;
      const auto uc = static_cast<std::size_t>(comp);
      const bool head = rank == 0, tail = comp == n - 1;
      const int begin = bounds[uc], end = bounds[uc + 1];
      const int source = helper >= 0 ? n - 2 : rank - 1;
      const auto bytes0 = comm.bytes_sent();
      const auto state_buffer = [&] {
        return at::empty({state_numel[uc]}, at::TensorOptions().device(dev).dtype(den.output_dtype()));
      };
      const auto works = [&](int s) { return helper < 0 ? s < steps : helper < working_helpers(s, steps, stride); };
      // A non-last rank's state goes to the next rank; rank n-2's also to the helpers of the round at step s.
      const auto send_state = [&](const models::UNetStageState& st, int step, int s) {
        const auto out = pack(st);
        comm.send(out, rank + 1);
        sent(step, out);
        if (rank != n - 2) return;
        for (int j = 0; j < working_helpers(s, steps, stride); ++j) {
          comm.send(out, n + j);
          sent(step, out);
        }
      };
      const auto timestep = [&](int i) { return me.sampler->timesteps().at(static_cast<std::size_t>(i)); };
      at::Tensor input, last_eps;
      for (int i = 0; i < steps; ++i) {
        gate.check(i);
        if (i < sync_steps) {
          const bool last_sync = i + 1 == sync_steps;
          if (helper >= 0) {
            if (last_sync && works(first)) {
              input = state_buffer();
              comm.recv(input, source);
            }
            continue;
          }
          const double t = timestep(i);
          models::UNetStageState st;
          if (head) {
            st = den.stage_input(me.sampler->scale_model_input(me.x, i), t, branch);
          } else {
            input = state_buffer();
            comm.recv(input, rank - 1);
            st = unpack(input, shapes[uc]);
          }
          den.run_stage(st, begin, end, t, branch);
          if (!tail) {
            send_state(st, i, last_sync ? first : steps);
          } else {
            const auto eps = den.stage_output(st, branch).contiguous();
            comm.send(eps, 0);
            sent(i, eps);
          }
          if (head) {
            last_eps = at::empty(me.x.sizes(), me.x.options().dtype(den.output_dtype()));
            comm.recv(last_eps, n - 1);
            me.x = refine(me, rank, in, last_eps, i, me.x);
          }
          continue;
        }
        if (i < first) {  // between the warm-up and the first group: the last warm-up eps again
          if (head) me.x = refine(me, rank, in, last_eps, i, me.x);
          continue;
        }
        if ((i - first) % stride != 0 || !works(i)) continue;
        const int last = std::min(i + stride - 1, steps - 1), next = i + stride;
        const int at = helper >= 0 ? i + helper : last;
        const double t = timestep(at);
        models::UNetStageState st;
        if (head) st = den.stage_input(me.sampler->scale_model_input(me.x, i), t, branch);
        else st = unpack(input, shapes[uc]);
        den.run_stage(st, begin, end, t, branch);
        if (head) {
          if (next < steps) send_state(st, i, next);
          std::vector<at::Tensor> eps;
          for (int q = i; q <= last; ++q) {
            eps.push_back(at::empty(me.x.sizes(), me.x.options().dtype(den.output_dtype())));
            comm.recv(eps.back(), q < last ? n + (q - i) : n - 1);
          }
          for (int q = i; q <= last; ++q) me.x = refine(me, rank, in, eps[static_cast<std::size_t>(q - i)], q, me.x);
          continue;
        }
        if (works(next)) {
          input = state_buffer();
          comm.recv(input, source);
          if (!lineage_skips && !tail) {
            const auto fresh = unpack(input, shapes[uc]);
            for (std::size_t q = 0; q < carried[uc]; ++q) st.skips[q] = fresh.skips[q];
          }
        }
        if (!tail) {
          if (next < steps) send_state(st, i, next);
        } else {
          const auto eps = den.stage_output(st, branch).contiguous();
          comm.send(eps, 0);
          sent(at, eps);
        }
      }
      bytes += comm.bytes_sent() - bytes0;
      if (head) result = me.x;
    });
  } else {
    g.run([&](int rank, Communicator& comm) {
      auto& me = ranks[static_cast<std::size_t>(rank)];
      auto& den = *me.den;
      const auto dev = g.device(rank);
      const bool head = rank == 0, tail = rank == n - 1;
      const int begin = bounds[static_cast<std::size_t>(rank)], end = bounds[static_cast<std::size_t>(rank) + 1];
      const auto bytes0 = comm.bytes_sent();
      const auto state_buffer = [&] {
        return at::empty({state_numel[static_cast<std::size_t>(rank)]}, at::TensorOptions().device(dev).dtype(den.output_dtype()));
      };
      at::Tensor input;  // rank > 0: the last state received from rank - 1 (packed)
      for (int i = 0; i < steps; ++i) {
        gate.check(i);
        const double t = me.sampler->timesteps().at(static_cast<std::size_t>(i));
        const bool stale = i >= sync_steps;
        const bool feed = !stale || i + 1 < steps;  // whether this step's states have a consumer
        models::UNetStageState st;
        if (head) {
          st = den.stage_input(me.sampler->scale_model_input(me.x, i), t, branch);
        } else {
          if (!stale) {
            input = state_buffer();
            comm.recv(input, rank - 1);
          }
          st = unpack(input, shapes[static_cast<std::size_t>(rank)]);
        }
        den.run_stage(st, begin, end, t, branch);
        if (head) {
          const auto out = pack(st);
          if (feed) {
            comm.send(out, 1);
            sent(i, out);
          }
          auto eps = at::empty(me.x.sizes(), me.x.options().dtype(den.output_dtype()));
          comm.recv(eps, n - 1);
          me.x = refine(me, rank, in, eps, i, me.x);
          continue;
        }
        // A stale step's input for step i + 1 comes now, after this step's work.
        if (stale && feed) {
          input = state_buffer();
          comm.recv(input, rank - 1);
          // The skips this component carried came with its input from step i - 1; the state just
          // received holds the same ones as their producers made them at step i (refreshed
          // likewise by rank - 1 before it sent), which is what rank + 1 gets.
          if (!lineage_skips && !tail) {
            const auto fresh = unpack(input, shapes[static_cast<std::size_t>(rank)]);
            for (std::size_t q = 0; q < carried[static_cast<std::size_t>(rank)]; ++q) st.skips[q] = fresh.skips[q];
          }
        }
        if (!tail) {
          if (feed) {
            const auto out = pack(st);
            comm.send(out, rank + 1);
            sent(i, out);
          }
        } else {
          const auto eps = den.stage_output(st, branch).contiguous();
          comm.send(eps, 0);
          sent(i, eps);
        }
      }
      bytes += comm.bytes_sent() - bytes0;
      if (head) result = me.x;
    });
  }

  const int groups = (steps - first + stride - 1) / stride;
  auto o = finish(*this, in, g, result, sync_steps + groups, steps - (first - sync_steps), bytes.load());
  o.stats.messages_per_step = traffic.messages();
  o.stats.bytes_per_step = traffic.bytes();
  double total = 0;
  for (double v : cost) total += v;
  total = std::max(total, 1.0);
  std::string split;
  for (int k = 0; k < n; ++k) {
    std::int64_t weights = 0;
    double c = 0;
    for (int j = bounds[static_cast<std::size_t>(k)]; j < bounds[static_cast<std::size_t>(k) + 1]; ++j) {
      weights += layers[static_cast<std::size_t>(j)].parameters;
      c += layers[static_cast<std::size_t>(j)].cost;
    }
    o.stats.weights_per_rank.push_back(weights);
    split += (k ? ", " : "") + std::string("rank ") + std::to_string(k) + ": layers " +
             std::to_string(bounds[static_cast<std::size_t>(k)]) + ".." +
             std::to_string(bounds[static_cast<std::size_t>(k) + 1] - 1) + " (" +
             layers[static_cast<std::size_t>(bounds[static_cast<std::size_t>(k)])].name + " .. " +
             layers[static_cast<std::size_t>(bounds[static_cast<std::size_t>(k) + 1] - 1)].name + ", " +
             std::to_string(static_cast<int>(100.0 * c / total + 0.5)) + "% of the estimated cost)";
  }
  const std::string skips =
      lineage_skips ? std::string("as that state carried them") : std::string("from their producers");
  if (stride == 1)
    o.stats.note = std::to_string(n) + " sequential components of " + std::to_string(layers.size()) + " UNet layers [" +
                   split + "]; " + std::to_string(sync_steps) + " synchronous step(s), then " +
                   std::to_string(steps - sync_steps) +
                   " one-step-stale step(s) (each component on the previous one's state from the step before, the "
                   "skips " + skips + "), stride 1";
  else
    o.stats.note = std::to_string(n) + " sequential components of " + std::to_string(layers.size()) + " UNet layers [" +
                   split + "], the last also on " + std::to_string(stride - 1) + " helper device(s); " +
                   std::to_string(sync_steps) + " synchronous step(s), " + std::to_string(first - sync_steps) +
                   " step(s) reusing the last warm-up eps, then " + std::to_string(groups) + " one-round-stale round(s) of up to " +
                   std::to_string(stride) + " steps (each component on the previous one's state from the round before, the "
                   "skips " + skips + "; the last component once per step of the round), stride " + std::to_string(stride);
  return o;
}

}  // namespace diffract::parallel
