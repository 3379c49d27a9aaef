#include "core/models/unets/unet_graphs.h"

#include <cstdlib>
#include <list>
#include <string>
#include <tuple>

#include <ATen/ATen.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "core/models/common/patch_parallel.h"
#include "core/util/options.h"

namespace diffract::models {

namespace {
// The shapes, and the job's precision, which picks the layers' GEMMs when the graph is captured.
using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, int, bool, std::size_t, bool>;

Key key_of(const at::Tensor& x, const UNetConditioning& c) {
  return {x.size(0), x.size(1), x.size(2), x.size(3), c.encoder_hidden_states.size(1),
          static_cast<int>(x.scalar_type()), c.text_embeds.defined(), c.down_residuals.size(),
          options::value(options::Id::Precision) == "fp8"};
}
}  // namespace

struct UNetGraphRunner::Cache {
  CaptureStats last_capture;
#ifdef DIFFRACT_HAS_CUDA
  struct Entry {
    Key key;
    at::Tensor x, t, out;
    UNetConditioning cond;
    std::unique_ptr<at::cuda::CUDAGraph> graph;
  };
  std::list<Entry> entries;  // most recently used first
#endif
};

bool stage_graphs_from_env() {
  return options::flag(options::Id::StageGraphs);
}

UNetGraphRunner::UNetGraphRunner(UNet2DConditionModel unet, UNetGraphOptions options)
    : unet_(std::move(unet)), options_(options), cache_(std::make_unique<Cache>()), stages_(options.max_stage_graphs) {
  if (options_.channels_last) {
    options_.channels_last = false;
    set_channels_last(true);
  }
}

void UNetGraphRunner::set_channels_last(bool on) {
  if (on == options_.channels_last) return;
  clear();
  set_memory_format(*unet_, on ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  options_.channels_last = on;
}

UNetGraphRunner::~UNetGraphRunner() { clear(); }

int UNetGraphRunner::graphs() const {
#ifdef DIFFRACT_HAS_CUDA
  return static_cast<int>(cache_->entries.size());
#else
  return 0;
#endif
}

CaptureStats UNetGraphRunner::last_capture() const { return cache_->last_capture; }

int UNetGraphRunner::stage_graphs() const { return stages_.graphs(); }

void UNetGraphRunner::set_stage_graphs(bool on) {
  if (!on) stages_.clear();
  options_.stage_graphs = on;
}

void UNetGraphRunner::clear() {
  stages_.clear();
#ifdef DIFFRACT_HAS_CUDA
  if (cache_->entries.empty()) return;
  // A replay may still be running on the device when its pool is handed back.
  const auto device = cache_->entries.front().x.device();
  c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
  cache_->entries.clear();
#endif
}

at::Tensor UNetGraphRunner::forward(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond) {
#ifdef DIFFRACT_HAS_CUDA
  // A patch-parallel band (DistriFusion) exchanges with its peers inside the layers: never captured.
  if (options_.enabled && options_.max_graphs > 0 && sample.is_cuda() && !patch_context()) {
    auto& entries = cache_->entries;
    const Key key = key_of(sample, cond);
    auto it = std::find_if(entries.begin(), entries.end(), [&](const Cache::Entry& e) { return e.key == key; });
    if (it == entries.end()) {
      const auto index = sample.device().index();
      c10::cuda::CUDAGuard device_guard(sample.device());
      if (static_cast<int>(entries.size()) >= options_.max_graphs) {
        c10::cuda::getCurrentCUDAStream(index).synchronize();
        entries.pop_back();
      }
      // Static buffers are made on the caller's stream, where the replays will read them.
      Cache::Entry e;
      e.key = key;
      e.x = sample.clone(options_.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
      e.t = timesteps.to(at::kFloat).clone();
      e.cond.encoder_hidden_states = cond.encoder_hidden_states.clone();
      if (cond.text_embeds.defined()) e.cond.text_embeds = cond.text_embeds.clone();
      if (cond.time_ids.defined()) e.cond.time_ids = cond.time_ids.clone();
      for (const auto& r : cond.down_residuals) e.cond.down_residuals.push_back(r.clone());
      if (cond.mid_residual.defined()) e.cond.mid_residual = cond.mid_residual.clone();
      e.graph = capture_warmed_up(index, [&] { e.out = unet_->forward(e.x, e.t, e.cond); }, cache_->last_capture);
      entries.push_front(std::move(e));
      it = entries.begin();
    } else if (it != entries.begin()) {
      entries.splice(entries.begin(), entries, it);
      it = entries.begin();
    }
    it->x.copy_(sample);
    it->t.copy_(timesteps);
    it->cond.encoder_hidden_states.copy_(cond.encoder_hidden_states);
    if (cond.text_embeds.defined()) it->cond.text_embeds.copy_(cond.text_embeds);
    if (cond.time_ids.defined()) it->cond.time_ids.copy_(cond.time_ids);
    for (size_t i = 0; i < cond.down_residuals.size(); ++i) it->cond.down_residuals[i].copy_(cond.down_residuals[i]);
    if (cond.mid_residual.defined()) it->cond.mid_residual.copy_(cond.mid_residual);
    it->graph->replay();
    return it->out.clone(at::MemoryFormat::Contiguous);
  }
#endif
  if (options_.channels_last)
    return unet_->forward(sample.contiguous(at::MemoryFormat::ChannelsLast), timesteps, cond).contiguous();
  return unet_->forward(sample, timesteps, cond);
}

// --- The stage calls -------------------------------------------------------------------------

namespace {

// Which stage call a graph runs (the first element of its GraphCache tag).
enum StageCall : std::int64_t { RangeWithTemb = 1, RangeAtTimestep, OuterDown, Inner, OuterUp };

// The conditioning's defined tensors, appended to a graph's inputs.
void push_cond(std::vector<at::Tensor>& in, const UNetConditioning& c) {
  in.push_back(c.encoder_hidden_states);
  if (c.text_embeds.defined()) in.push_back(c.text_embeds);
  if (c.time_ids.defined()) in.push_back(c.time_ids);
}

// The conditioning from a graph's inputs [at, ...), as push_cond laid it out for `like`.
UNetConditioning pop_cond(const std::vector<at::Tensor>& in, std::size_t at, const UNetConditioning& like) {
  UNetConditioning c;
  c.encoder_hidden_states = in.at(at++);
  if (like.text_embeds.defined()) c.text_embeds = in.at(at++);
  if (like.time_ids.defined()) c.time_ids = in.at(at++);
  return c;
}

std::vector<std::int64_t> tag_of(StageCall call, std::int64_t a, std::int64_t b, std::size_t skips,
                                 const UNetConditioning& c, bool channels_last) {
  const auto* patch = patch_context();
  return {call, a, b, static_cast<std::int64_t>(skips), c.text_embeds.defined() ? 1 : 0, c.time_ids.defined() ? 1 : 0,
          channels_last ? 1 : 0, patch ? patch->graph_tag() : 0};
}

at::Tensor expand_rows(const at::Tensor& timesteps, std::int64_t rows) {
  return timesteps.dim() == 0 ? timesteps.expand({rows}) : timesteps;
}

}  // namespace

bool UNetGraphRunner::stage_graphed(const at::Tensor& x) const {
  const auto* patch = patch_context();
  return options_.enabled && options_.stage_graphs && options_.max_stage_graphs > 0 && x.defined() && x.is_cuda() &&
         (!patch || patch->graph_tag() != 0);
}

at::MemoryFormat UNetGraphRunner::layout() const {
  return options_.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

void UNetGraphRunner::forward_range(UNetStageState& state, int begin, int end, const UNetConditioning& cond) {
  // An empty or invalid range: nothing to graph (the model throws for an invalid one).
  if (!stage_graphed(state.h) || !state.temb.defined() || begin >= end || begin < 0 || end > unet_->layer_count()) {
    unet_->forward_range(state, begin, end, cond);
    return;
  }
  if (stages_.max_graphs() != options_.max_stage_graphs) stages_.set_max_graphs(options_.max_stage_graphs);
  const auto skips = state.skips.size();
  std::vector<at::Tensor> in = {state.h, state.temb};
  in.insert(in.end(), state.skips.begin(), state.skips.end());
  push_cond(in, cond);
  auto out = stages_.run(
      tag_of(RangeWithTemb, begin, end, skips, cond, options_.channels_last), in,
      [&](const std::vector<at::Tensor>& x) {
        UNetStageState s;
        s.h = x[0];
        s.temb = x[1];
        s.skips.assign(x.begin() + 2, x.begin() + 2 + static_cast<std::ptrdiff_t>(skips));
        unet_->forward_range(s, begin, end, pop_cond(x, 2 + skips, cond));
        std::vector<at::Tensor> r = {s.h};
        r.insert(r.end(), s.skips.begin(), s.skips.end());
        return r;
      },
      layout());
  state.h = out[0];
  state.skips.assign(out.begin() + 1, out.end());
}

void UNetGraphRunner::forward_range(UNetStageState& state, int begin, int end, const at::Tensor& timesteps,
                                    const UNetConditioning& cond) {
  if (!stage_graphed(state.h) || begin >= end || begin < 0 || end > unet_->layer_count()) {
    state.temb = unet_->embed_time(expand_rows(timesteps, state.h.size(0)), cond, state.h.scalar_type());
    unet_->forward_range(state, begin, end, cond);
    return;
  }
  if (stages_.max_graphs() != options_.max_stage_graphs) stages_.set_max_graphs(options_.max_stage_graphs);
  const auto skips = state.skips.size();
  std::vector<at::Tensor> in = {state.h, timesteps};
  in.insert(in.end(), state.skips.begin(), state.skips.end());
  push_cond(in, cond);
  auto out = stages_.run(
      tag_of(RangeAtTimestep, begin, end, skips, cond, options_.channels_last), in,
      [&](const std::vector<at::Tensor>& x) {
        const auto c = pop_cond(x, 2 + skips, cond);
        UNetStageState s;
        s.h = x[0];
        s.temb = unet_->embed_time(expand_rows(x[1], x[0].size(0)), c, x[0].scalar_type());
        s.skips.assign(x.begin() + 2, x.begin() + 2 + static_cast<std::ptrdiff_t>(skips));
        unet_->forward_range(s, begin, end, c);
        std::vector<at::Tensor> r = {s.temb, s.h};
        r.insert(r.end(), s.skips.begin(), s.skips.end());
        return r;
      },
      layout());
  state.temb = out[0];
  state.h = out[1];
  state.skips.assign(out.begin() + 2, out.end());
}

UNetOuterState UNetGraphRunner::forward_outer_down(const at::Tensor& sample, const at::Tensor& timesteps,
                                                   const UNetConditioning& cond, int split) {
  if (!stage_graphed(sample) || split < 1 || split >= static_cast<int>(unet_->down_blocks->size()))
    return unet_->forward_outer_down(sample, timesteps, cond, split);
  if (stages_.max_graphs() != options_.max_stage_graphs) stages_.set_max_graphs(options_.max_stage_graphs);
  std::vector<at::Tensor> in = {sample, timesteps};
  push_cond(in, cond);
  auto out = stages_.run(
      tag_of(OuterDown, split, 0, 0, cond, options_.channels_last), in,
      [&](const std::vector<at::Tensor>& x) {
        auto s = unet_->forward_outer_down(x[0], x[1], pop_cond(x, 2, cond), split);
        std::vector<at::Tensor> r = {s.temb, s.h};
        r.insert(r.end(), s.skips.begin(), s.skips.end());
        return r;
      },
      layout());
  UNetOuterState s;
  s.temb = out[0];
  s.h = out[1];
  s.skips.assign(out.begin() + 2, out.end());
  return s;
}

at::Tensor UNetGraphRunner::forward_inner(const at::Tensor& h, const at::Tensor& timesteps, const UNetConditioning& cond,
                                          int split) {
  if (!stage_graphed(h) || split < 1 || split >= static_cast<int>(unet_->down_blocks->size()))
    return unet_->forward_inner(h, timesteps, cond, split);
  if (stages_.max_graphs() != options_.max_stage_graphs) stages_.set_max_graphs(options_.max_stage_graphs);
  std::vector<at::Tensor> in = {h, timesteps};
  push_cond(in, cond);
  return stages_
      .run(
          tag_of(Inner, split, 0, 0, cond, options_.channels_last), in,
          [&](const std::vector<at::Tensor>& x) {
            return std::vector<at::Tensor>{unet_->forward_inner(x[0], x[1], pop_cond(x, 2, cond), split)};
          },
          layout())
      .front();
}

at::Tensor UNetGraphRunner::forward_outer_up(UNetOuterState state, const at::Tensor& inner, const UNetConditioning& cond,
                                             int split) {
  if (!stage_graphed(inner) || !state.temb.defined() || split < 1 || split >= static_cast<int>(unet_->down_blocks->size()))
    return unet_->forward_outer_up(std::move(state), inner, cond, split);
  if (stages_.max_graphs() != options_.max_stage_graphs) stages_.set_max_graphs(options_.max_stage_graphs);
  const auto skips = state.skips.size();
  std::vector<at::Tensor> in = {inner, state.temb};
  in.insert(in.end(), state.skips.begin(), state.skips.end());
  push_cond(in, cond);
  return stages_
      .run(
          tag_of(OuterUp, split, 0, skips, cond, options_.channels_last), in,
          [&](const std::vector<at::Tensor>& x) {
            UNetOuterState s;
            s.temb = x[1];
            s.skips.assign(x.begin() + 2, x.begin() + 2 + static_cast<std::ptrdiff_t>(skips));
            return std::vector<at::Tensor>{
                unet_->forward_outer_up(std::move(s), x[0], pop_cond(x, 2 + skips, cond), split)};
          },
          layout())
      .front();
}

}  // namespace diffract::models
