#pragma once
// A CLIP text encoder replayed from CUDA graphs. At 77 tokens and batch 1 the encoders are a few
// hundred small kernels each (OpenCLIP-bigG: 32 layers) whose launches, not their arithmetic,
// set the time; one graph per encoder and shape takes that away. Eager on the CPU and with
// DIFFRACT_CUDA_GRAPHS=0.
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace diffract {
class GraphedFunction;
}
namespace diffract::models {
struct CLIPTextOutput;
struct CLIPTextConfig;
}  // namespace diffract::models

namespace diffract::pipeline::detail {

// What the pipelines take from a CLIP encoder.
struct CLIPEncoding {
  at::Tensor penultimate;        // [B, T, C]: the second-to-last layer's output (SDXL, SD3)
  at::Tensor last_hidden_state;  // [B, T, C]: after the final layer norm (SD 1.x / 2.x)
  at::Tensor pooled;             // [B, P]: text_embeds when the encoder projects, else pooled [B, C]
};

class CLIPGraph {
 public:
  // `forward(ids)`: the encoder's forward with hidden states; `config()`: its configuration
  // (read per call, so the encoder may be assigned after this object is made); `projected`:
  // whether pooled is the projection's text_embeds.
  CLIPGraph(std::function<models::CLIPTextOutput(const at::Tensor& ids)> forward,
            std::function<const models::CLIPTextConfig&()> config, bool projected);
  ~CLIPGraph();
  // ids [B, T] (long, on the encoder's device) -> the encoding: views of one tensor of its own.
  CLIPEncoding operator()(const at::Tensor& ids);
  void clear();

 private:
  std::function<models::CLIPTextOutput(const at::Tensor&)> forward_;
  std::function<const models::CLIPTextConfig&()> config_;
  bool projected_;
  std::unique_ptr<GraphedFunction> graph_;
};

}  // namespace diffract::pipeline::detail
