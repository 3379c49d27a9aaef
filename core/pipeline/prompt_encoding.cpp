#include "core/pipeline/prompt_encoding.h"

#include <cmath>
#include <numeric>

#include <ATen/ATen.h>

#include "core/pipeline/pipeline_util.h"
#include "core/text/clip_tokenizer.h"
#include "core/text/prompt_syntax.h"
#include "core/util/error.h"

namespace diffract::pipeline::detail {

ClipPrompt clip_prompt(const text::CLIPTokenizer& tokenizer, const std::string& prompt, job::PromptSyntax syntax,
                       const at::Device& device, job::StageTimings& timings) {
  ClipPrompt out;
  if (syntax == job::PromptSyntax::Plain) {
    out.ids.push_back(clip_token_ids(tokenizer, prompt, device, timings));
    out.weights.emplace_back(static_cast<std::size_t>(tokenizer.max_length()), 1.0f);
    out.token_count = static_cast<int>(tokenizer.tokenize(prompt).length);
    return out;
  }
  if (tokenizer.max_length() != 77)
    throw Error("A1111 prompt syntax needs a 77-token CLIP tokenizer; this one takes " +
                std::to_string(tokenizer.max_length()) + " (use --prompt-syntax plain)");
  const auto t0 = Clock::now();
  const auto chunked = text::chunk_prompt(tokenizer, text::parse_prompt_attention(prompt));
  timings.tokenize_ms += ms_since(t0);
  for (const auto& c : chunked.chunks) {
    out.ids.push_back(at::tensor(at::ArrayRef<int>(c.ids), at::kLong).unsqueeze(0).to(device));
    out.weights.push_back(c.weights);
  }
  out.token_count = chunked.token_count;
  return out;
}

at::Tensor apply_emphasis(const at::Tensor& z, const std::vector<float>& weights) {
  bool weighted = false;
  for (const float w : weights) weighted = weighted || w != 1.0f;
  if (!weighted) return z;
  // In fp32 whatever the encoder ran in: the means of a bf16 tensor lose the digits the ratio needs.
  const auto zf = z.to(at::kFloat);
  const auto m = at::tensor(at::ArrayRef<float>(weights), zf.options()).view({1, -1, 1});
  const auto original_mean = zf.mean();
  auto out = zf * m;
  const auto new_mean = out.mean();
  // A mean near zero next to the values' size (an encoder ending in a layer norm without bias)
  // makes A1111's ratio meaningless or infinite: the weights then apply without the rescale.
  const double scale = 1e-3 * zf.abs().mean().item<double>();
  if (std::abs(original_mean.item<double>()) > scale && std::abs(new_mean.item<double>()) > scale)
    out = out * (original_mean / new_mean);
  return out.to(z.scalar_type());
}

ChunkEncoding encode_chunks(const ClipPrompt& prompt, const std::function<ChunkEncoding(const at::Tensor& ids)>& encode) {
  std::vector<at::Tensor> parts;
  ChunkEncoding out;
  for (std::size_t k = 0; k < prompt.ids.size(); ++k) {
    auto e = encode(prompt.ids[k]);
    parts.push_back(apply_emphasis(e.hidden, prompt.weights[k]).clone());
    if (k == 0 && e.pooled.defined()) out.pooled = e.pooled.clone();
  }
  out.hidden = parts.size() == 1 ? parts.front() : at::cat(parts, 1);
  return out;
}

int64_t common_length(int64_t a, int64_t b) { return std::lcm(a, b); }

at::Tensor repeat_tokens(const at::Tensor& hidden, int64_t tokens) {
  const auto t = hidden.size(1);
  if (tokens == t) return hidden;
  if (tokens % t != 0)
    throw Error("internal: " + std::to_string(t) + " prompt tokens do not repeat to " + std::to_string(tokens));
  return hidden.repeat({1, tokens / t, 1});
}

}  // namespace diffract::pipeline::detail
