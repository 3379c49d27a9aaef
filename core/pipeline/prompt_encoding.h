#pragma once
// A prompt through a CLIP encoder as the job's prompt syntax reads it: A1111's weighted chunks of
// 75 tokens (each encoded on its own, weighted, its mean restored, the chunks concatenated along
// the sequence), or diffusers' one truncated window.
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "core/job/job.h"

namespace diffract::text {
class CLIPTokenizer;
}

namespace diffract::pipeline::detail {

// One encoder's reading of a prompt.
struct ClipPrompt {
  std::vector<at::Tensor> ids;              // per chunk [1, max_length], long, on the device
  std::vector<std::vector<float>> weights;  // per chunk, per token
  int token_count = 0;                      // the prompt's tokens (A1111's count; plain: bos..eos)
};
ClipPrompt clip_prompt(const text::CLIPTokenizer& tokenizer, const std::string& prompt, job::PromptSyntax syntax,
                       const at::Device& device, job::StageTimings& timings);

// What one chunk's encoder call gives: hidden states [1, T, C] and pooled [1, P] (may be views of
// a graph's output: they are copied before the next call).
struct ChunkEncoding {
  at::Tensor hidden, pooled;
};
// Every chunk through `encode`, A1111's emphasis on each ("Original": hidden * weight per token,
// then scaled back to the chunk's mean), concatenated along the sequence: [1, chunks * T, C]; the
// pooled output is the first chunk's.
ChunkEncoding encode_chunks(const ClipPrompt& prompt, const std::function<ChunkEncoding(const at::Tensor& ids)>& encode);

// A1111's "Original" emphasis on z [1, T, C] with one weight per token; z itself when every weight
// is 1. Where the mean before or after weighting is under 1e-3 of the mean magnitude, the
// rescale is skipped (A1111 divides by it, giving infinities).
at::Tensor apply_emphasis(const at::Tensor& z, const std::vector<float>& weights);

// hidden [B, T, C] repeated along the sequence to `tokens` (a multiple of T). Cross-attention
// over a context repeated k times equals attention over the context (each key and value appears
// k times, softmax weights divide by k), so a prompt and a negative of different chunk counts
// share one batch at the least common multiple of their lengths, exactly as if run apart.
at::Tensor repeat_tokens(const at::Tensor& hidden, int64_t tokens);
int64_t common_length(int64_t a, int64_t b);  // the least common multiple

}  // namespace diffract::pipeline::detail
