#include "core/pipeline/clip_graph.h"

#include <cstdlib>
#include <string>

#include <ATen/ATen.h>

#include "core/models/text_encoders/clip_text.h"
#include "core/util/graphed_function.h"
#include "core/util/options.h"

namespace diffract::pipeline::detail {

namespace {
// One flat tensor per batch holding the three outputs, so one graph output serves them all.
at::Tensor pack(const models::CLIPTextOutput& o, bool projected) {
  const auto& pooled = projected ? o.text_embeds : o.pooled;
  const auto penultimate = o.hidden_states.at(o.hidden_states.size() - 2);
  return at::cat({penultimate.reshape(-1), o.last_hidden_state.reshape(-1), pooled.reshape(-1)});
}
}  // namespace

CLIPGraph::CLIPGraph(std::function<models::CLIPTextOutput(const at::Tensor&)> forward,
                     std::function<const models::CLIPTextConfig&()> config, bool projected)
    : forward_(std::move(forward)), config_(std::move(config)), projected_(projected) {
  graph_ = std::make_unique<GraphedFunction>(
      [this](const at::Tensor& ids) { return pack(forward_(ids), projected_); }, 2);
  if (!options::flag(options::Id::CudaGraphs)) graph_->set_enabled(false);
}

CLIPGraph::~CLIPGraph() = default;

void CLIPGraph::clear() { graph_->clear(); }

CLIPEncoding CLIPGraph::operator()(const at::Tensor& ids) {
  const auto& c = config_();
  const int64_t b = ids.size(0), t = ids.size(1), width = c.hidden_size;
  const int64_t p = projected_ ? c.projection_dim : c.hidden_size;
  const auto flat = (*graph_)(ids);
  const int64_t hidden = b * t * width;
  CLIPEncoding e;
  e.penultimate = flat.narrow(0, 0, hidden).view({b, t, width});
  e.last_hidden_state = flat.narrow(0, hidden, hidden).view({b, t, width});
  e.pooled = flat.narrow(0, 2 * hidden, b * p).view({b, p});
  return e;
}

}  // namespace diffract::pipeline::detail
