#include "core/models/common/sequence_parallel.h"

#include <string>

#include <ATen/ATen.h>

#include "core/models/common/attention.h"
#include "core/util/error.h"

namespace diffract::models {

SequenceExchange::~SequenceExchange() = default;

SequenceShard SequenceShard::even(SequenceExchange& exchange, int64_t text_tokens, int64_t image_total) {
  const int p = exchange.size();
  if (p < 1 || image_total % p != 0)
    throw Error("sequence parallelism: " + std::to_string(image_total) + " image tokens do not split evenly over " +
                std::to_string(p) + " devices");
  SequenceShard s;
  s.exchange = &exchange;
  s.text_tokens = text_tokens;
  s.image_total = image_total;
  s.image_tokens = image_total / p;
  s.image_begin = exchange.rank() * s.image_tokens;
  return s;
}

at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SequenceShard& shard) {
  auto& ex = *shard.exchange;
  const int p = ex.size(), r = ex.rank();
  const int64_t b = q.size(0), h = q.size(2), d = q.size(3), s = shard.text_tokens, n = shard.image_tokens;
  TORCH_CHECK(q.size(1) == s + n, "ulysses_attention: ", q.size(1), " rows for ", s, " text and ", n, " image tokens");
  if (h % p != 0)
    throw Error("sequence parallelism: " + std::to_string(h) + " attention heads do not split over " + std::to_string(p) +
                " devices");
  const int64_t hp = h / p;
  // Image rows: [B, n, H, d] -> heads [r*hp, (r+1)*hp) of all N tokens; text: this rank's heads.
  const auto gather_heads = [&](const at::Tensor& t) {
    const auto image = t.narrow(1, s, n);
    std::vector<at::Tensor> chunks;
    for (int j = 0; j < p; ++j) chunks.push_back(image.narrow(2, j * hp, hp).contiguous());
    auto parts = ex.all_to_all(chunks);  // rank i's tokens of my heads
    for (auto& part : parts) part = part.to(t.device());
    return at::cat({t.narrow(1, 0, s).narrow(2, r * hp, hp), at::cat(parts, 1)}, 1);
  };
  const auto qh = gather_heads(q), kh = gather_heads(k), vh = gather_heads(v);
  const int64_t t = s + n * p;
  auto out = multi_head_attention(qh.reshape({b, t, hp * d}), kh.reshape({b, t, hp * d}), vh.reshape({b, t, hp * d}), hp)
                 .view({b, t, hp, d});
  // Text: every rank's heads, in head order.
  auto text_parts = ex.all_gather(out.narrow(1, 0, s).contiguous());
  for (auto& part : text_parts) part = part.to(q.device());
  // Image: rank j's tokens of my heads go back to rank j; I get my tokens of every head group.
  std::vector<at::Tensor> chunks;
  for (int j = 0; j < p; ++j) chunks.push_back(out.narrow(1, s + j * n, n).contiguous());
  auto image_parts = ex.all_to_all(chunks);
  for (auto& part : image_parts) part = part.to(q.device());
  return at::cat({at::cat(text_parts, 2), at::cat(image_parts, 2)}, 1).reshape({b, s + n, h * d});
}

}  // namespace diffract::models
