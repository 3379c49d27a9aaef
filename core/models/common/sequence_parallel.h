#pragma once
// Sequence parallelism, Ulysses flavour (DeepSpeed-Ulysses, arXiv 2309.14509; xDiT's USP), inside a
// transformer's attention: every rank holds the whole model and a share of the image tokens, and
// around each attention an all-to-all trades tokens for heads, so each rank attends over every
// token for its share of the heads. The text tokens, few beside the image's, are kept whole on
// every rank (computed on each: xDiT's "front" joint strategy). How ranks talk is the parallel
// layer's business (parallel::SequenceParallel adapts its Communicator to SequenceExchange).
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace diffract::models {

class SequenceExchange {
 public:
  virtual ~SequenceExchange();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // chunks[d] goes to rank d (size() of them, equal shapes on every rank for each d); returns the
  // chunk each rank sent to this one, by rank.
  virtual std::vector<at::Tensor> all_to_all(const std::vector<at::Tensor>& chunks) = 0;
  // Every rank's tensor (equal shapes), by rank.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& t) = 0;
};

// Rank `exchange->rank()`'s share of a joint sequence: `text_tokens` first (every rank's alike),
// then image tokens [image_begin, image_begin + image_tokens) of image_total.
struct SequenceShard {
  SequenceExchange* exchange = nullptr;
  int64_t text_tokens = 0;
  int64_t image_begin = 0, image_tokens = 0, image_total = 0;
  // Image tokens split evenly (`total` a multiple of the ranks, as the all-to-all needs).
  static SequenceShard even(SequenceExchange& exchange, int64_t text_tokens, int64_t image_total);
};

// Attention over the whole sequence from this rank's share: q, k, v [B, S + n, H, d] (text then
// this rank's n image tokens, rope applied; H a multiple of the ranks) -> [B, S + n, H * d], what
// multi_head_attention over the whole sequence gives on these rows, up to rounding. Two
// all-to-alls (q, k, v in; the image output back) and one all-gather (the text output).
at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SequenceShard& shard);

}  // namespace diffract::models
