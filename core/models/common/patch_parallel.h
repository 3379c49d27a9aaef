#pragma once
// Patch parallelism's hook into the layers (DistriFusion, core/parallel/distrifusion.h): every
// rank runs the whole model on a horizontal band of the image's rows, and the layers that look
// beyond a row (convolutions with a kernel > 1, GroupNorm, self-attention) ask this thread's
// PatchContext for the other bands' part. No context (the default, and everywhere outside
// DistriFusion) leaves the layers as they are: one thread-local read per such layer call.
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace diffract::models {

class Conv2dImpl;
class GroupNormImpl;

class PatchContext {
 public:
  virtual ~PatchContext();
  // x [B, C, h, W], this band's rows -> this band's output rows [B, C', h / stride, W'].
  virtual at::Tensor conv2d(Conv2dImpl& conv, const at::Tensor& x) = 0;
  // x [B, C, h, ...] (this band), add undefined or [B, C] -> norm.forward(x, add, silu) of this
  // band, normalised with the whole image's per-group statistics.
  virtual at::Tensor group_norm(GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add, bool silu) = 0;
  // k, v [B, t, C] of this band's tokens -> k, v [B, T, C] of the whole image (bands in order).
  virtual std::pair<at::Tensor, at::Tensor> self_attention_kv(const at::Tensor& k, const at::Tensor& v) = 0;
  // 0 (the default): the hooked layers may exchange with peers inside the call, so a CUDA graph
  // must not be captured under this context (a replay would skip the exchanges). Otherwise the
  // context only reads and writes device buffers of fixed addresses (no collective, no host
  // synchronisation) and the value names that set of buffers: UNetGraphRunner's stage calls
  // are then graphed under it, keyed by the value, so that a graph replays only with the
  // buffers it was captured with.
  virtual std::int64_t graph_tag() const { return 0; }
  // True when the band carries its neighbours' rows itself (an overlapped band decode,
  // core/parallel/parallel_vae.h): convolutions then run as without a context (conv2d() is
  // not asked, the fused convolution paths stay on) and only GroupNorm and attention ask.
  virtual bool convolves_locally() const { return false; }
};

// This thread's context when the convolutions must ask it (one that does not convolve locally), or null.
PatchContext* patch_context_for_convolutions();

// This thread's context, or null.
PatchContext* patch_context();

// Sets this thread's context for its lifetime (null: none), then restores the previous one.
class PatchScope {
 public:
  explicit PatchScope(PatchContext* context);
  ~PatchScope();
  PatchScope(const PatchScope&) = delete;
  PatchScope& operator=(const PatchScope&) = delete;

 private:
  PatchContext* previous_;
};

// What one band contributes per layer, and how a band combines every band's contribution.
// Bands are equal: band r holds rows [r h, (r + 1) h) of every activation of height n h.
//  Convolution (kernel k = 2p + 1, padding p, stride 1 or 2): the band's first and last p rows.
at::Tensor conv_halo(const at::Tensor& x, std::int64_t p);
//  halos: every band's conv_halo (the own one unused) -> the band's output rows: the band with
//  p rows of its neighbours above and below (zeros beyond the image), convolved with padding 0
//  along H. Stride 2: an even band start and height keep the output rows aligned (out row o
//  reads in rows 2o-1 .. 2o+1, so the bottom halo goes unused).
at::Tensor band_conv2d(const Conv2dImpl& conv, const at::Tensor& x, const std::vector<at::Tensor>& halos, int rank);
//  GroupNorm's optional per-channel add: x [B, C, ...] + add [B, C] broadcast (x when undefined).
at::Tensor add_per_channel(const at::Tensor& x, const at::Tensor& add);
//  GroupNorm: x [B, C, ...] -> [2, B, G] fp32: the band's per-group mean and (biased) variance.
at::Tensor group_stats(const at::Tensor& x, std::int64_t groups);
//  x [B, C, ...] (the add already added), every band's group_stats -> normalised with the whole
//  image's statistics (equal counts per band: mean of the means; mean of the variances plus the
//  variance of the means), then the affine and the SiLU; statistics, scale and shift in fp32,
//  applied in one pass that writes x's type (no fp32 copy of x).
at::Tensor band_group_norm(const GroupNormImpl& norm, const at::Tensor& x, const std::vector<at::Tensor>& stats,
                           bool silu);
//  Bands of unequal size, statistics by moments (an overlapped band decode): x [B, C, H, W]
//  (+ add [B, C] or [1, C]) -> [B, G, 2] fp32, each (sample, group)'s mean and biased variance
//  over rows [row_begin, row_end) only.
at::Tensor group_moments(const at::Tensor& x, const at::Tensor& add, std::int64_t groups, std::int64_t row_begin,
                         std::int64_t row_end);
//  Every band's group_moments [bands, B, G, 2] and element count -> [B, G, 2] fp32: the whole
//  image's mean and 1 / sqrt(variance + eps), combined in double, bands in order.
at::Tensor combine_group_moments(const at::Tensor& moments, const std::vector<double>& counts, double eps);
//  norm.forward(x, add, silu) normalised with `stats` [B, G, 2] (mean, 1 / std) instead of x's
//  own statistics: the GroupNorm kernels' normalisation pass on CUDA, a folded scale and shift
//  in fp32 elsewhere.
at::Tensor group_norm_with_stats(const GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add,
                                 const at::Tensor& stats, bool silu);
//  Self-attention: [B, t, 2C] = k and v side by side; every band's -> k, v [B, T, C].
at::Tensor kv_pack(const at::Tensor& k, const at::Tensor& v);
std::pair<at::Tensor, at::Tensor> kv_unpack(const std::vector<at::Tensor>& packs);

// A band's context whose only question is exchange(): the layer math above, with the other
// bands' contributions from wherever the subclass keeps them (DistriFusion's communicator and
// its buffers of the step before; a test's tables).
class BandContext : public PatchContext {
 public:
  BandContext(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const { return rank_; }
  int size() const { return size_; }
  // This band's contribution to the next hooked layer call -> every band's, in band order (the
  // own entry `mine`).
  virtual std::vector<at::Tensor> exchange(const at::Tensor& mine) = 0;

  at::Tensor conv2d(Conv2dImpl& conv, const at::Tensor& x) override;
  at::Tensor group_norm(GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add, bool silu) override;
  std::pair<at::Tensor, at::Tensor> self_attention_kv(const at::Tensor& k, const at::Tensor& v) override;

 protected:
  int rank_, size_;
};

}  // namespace diffract::models
