#pragma once
// DistriFusion (arXiv 2402.19481, "displaced patch parallelism") for the SD / SDXL UNet: a
// model-level strategy (DESIGN.md, level 3).
#include <cstdint>
#include <string>

#include "core/parallel/strategy.h"

namespace diffract::parallel {

// The latent cut into n horizontal bands of equal height, one per rank; every rank runs the
// whole UNet on its band, and the layers that see beyond a row take the other bands' part
// through the patch hook (core/models/common/patch_parallel.h).
//  Bands: rank r owns latent rows [r H/n, (r + 1) H/n). H must divide by n 2^D (D: the UNet's
//   downsamplings), so that at every resolution a band has whole rows (1 or more at the
//   deepest) and every stride-2 convolution's band starts on an even row with an even height.
//  Layers and what travels (layer identity = the call's index within one evaluation, the UNet's
//   call order being fixed; each band's contribution per hooked layer call):
//   - convolutions with a kernel > 1 (3x3, stride 1 or 2, padding 1; conv_in, the ResNets',
//     the downsamplers', the upsamplers' on their upsampled input, conv_out): the band's first
//     and last row ([2B, C, 2, W] with CFG); a band convolves its rows with its neighbours'
//     adjacent row above and below (zeros at the image's top and bottom).
//   - GroupNorm (the ResNets', the transformers', conv_norm_out): per group mean and variance
//     of the band in fp32 ([2, 2B, G]); the image's statistics combine every band's (mean of
//     the means, mean of the variances plus the variance of the means: never negative, unlike
//     the reference's E[x^2] - E[x]^2 over stale means, which it patches with the band's own).
//   - self-attention (the transformer blocks' attn1): this band's K and V side by side
//     ([2B, t, 2C]); queries stay local. K / V rather than the attention input (half the
//     bytes) so that no rank recomputes the other bands' K / V projections: per-rank compute
//     stays 1/n of the model, as the reference does.
//   - eps: every step the bands' guided eps ([B, C, H/n, W]) are gathered and every rank runs
//     the sampler on the whole latent (replicas in lock-step, as the other strategies).
//  Warm-up: the first `warmup` steps (>= 1; default 4, the reference implementation's
//   DistriConfig.warmup_steps) are synchronous: every hooked layer gathers the other bands'
//   fresh values before it computes, which is one device's evaluation up to fp32 rounding
//   (GroupNorm's statistics are combined from the bands', and the convolutions / attention
//   run on band shapes).
//  Stale steps t >= warmup: each hooked layer uses its own band fresh and the other bands'
//   contributions from step t-1 (halo rows, GroupNorm statistics, K / V). Its fresh
//   contribution is consumed only at step t+1, so the layer never waits for a collective: the
//   rank copies it into its slot of one of K buckets (flat byte buffers: `buckets` runs of
//   consecutive hooked layer calls of about equal bytes, min(buckets, L) of them; in a bucket,
//   slots grouped by element size, largest first, so that every slot stays aligned; laid out
//   once from the synchronous steps' shapes, alike on every rank since the bands are equal). As
//   soon as a bucket's last call has written, the bucket's all_gather starts asynchronously
//   (Communicator::all_gather_async: on NCCL it runs on the communication stream while the
//   compute stream goes on with the rest of the UNet) and the next step waits for all of them
//   at its start, before its first hooked layer reads them. Every band's contributions for
//   step t+1 are views of the gathered buffers (no copy). eps is gathered at the end of the
//   step (blocking: the sampler needs it). A stale last step publishes nothing (no later step
//   would read it): eps alone. Everything else (the band's own activations, the timestep, the
//   text conditioning) is fresh.
//  Buckets: equal bytes rather than equal call counts, since K / V dominate (SDXL 1024^2 with
//   CFG: ~870 MB per rank per step) and what stays exposed is the last bucket, whose gather
//   starts only after the UNet's last hooked call (conv_out), plus eps. The default 8 leaves
//   ~1/8 of the transfer exposed with ~110 MB messages, large enough for NCCL's bandwidth;
//   buckets = 1 is the former single packed gather (without eps, which has its own). On NCCL
//   one communicator runs its collectives in order, so eps's gather waits for the buckets
//   still in flight: the overlap is within the step (the buckets but the last hide behind the
//   rest of the UNet), not across steps. In-process (virtual devices) a gather completes at its
//   call: the values, and so the latents, are the same for every bucket count.
//  Communication: synchronous steps gather at each hooked layer (blocking: the layer needs the
//   fresh values); stale steps' layers never wait for a collective (above).
//  Messages per step (LoopStats::messages_per_step counts one per rank per collective, bytes
//   what each rank contributes, bucket padding included): n (L + 1) in a synchronous step, with
//   L hooked layer calls per evaluation; n (min(buckets, L) + 1) in a stale step (one per bucket,
//   plus eps; graphed, as one bucket: 2n); n in a stale last step (eps alone).
//  Memory: every rank keeps the previous step's contributions of every band for every hooked
//   layer: the whole image's K / V of every self-attention layer dominate. A stale step reads
//   them layer by layer and drops each once read, so a bucket's gathered buffer of the step
//   before is freed once the step is past its layers, while this step's buckets fill and their
//   gathered buffers arrive: about one step's worth of gathered buffers at any time, plus the
//   bucket filling.
//  CFG: both branches as one batch of 2B on every rank, combined on the band before the gather.
//  Speed: each rank runs 1/n of the pixels of every layer; self-attention's T^2 term falls by n
//   too. Synchronous steps run eagerly, through the denoiser's stage API; stale steps too
//   unless graphed (below).
//  Graphed stale steps (`graphs`, the default): warm_rank() lays out, per rank, one buffer of
//   fixed addresses for its contributions and one for every band's of the step before, and
//   evaluates its band once through them, which on a GPU captures the band's stale step as a
//   CUDA graph (UNetGraphRunner's stage graph under a context with a graph_tag(); eager, a
//   stale step is bound by launching the ~2,000 kernels of the UNet and its hooks). A stale step
//   then replays the graph and gathers the whole step's contributions at once after it, in
//   place (Communicator::all_gather_into: one message per rank instead of the buckets; the
//   exchange no longer overlaps the compute), then eps. Every rank takes this path only when
//   warm_rank() left the buffers for every rank (else the buckets above); on the CPU it runs
//   eagerly, same values. The buffers of a rank's two most recent shapes are kept between jobs.
struct DistriFusion final : Strategy {
  int n = 2;       // bands (devices)
  int warmup = 4;  // synchronous steps first (>= 1)
  int buckets = 8; // asynchronous all_gathers per stale step (>= 1; clamped to the hooked layer calls)
  bool graphs = true;  // graphed stale steps when warm_rank() prepared them (DIFFRACT_STAGE_GRAPHS=0: off on GPUs)

  std::string name() const override { return "distrifusion"; }
  int devices() const override { return n; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  // One guided evaluation of band 0's shape with no exchange (the other bands' contributions
  // zeros), so that a GPU rank's first eager calls on the band shapes (cuDNN autotuning,
  // allocator growth) never happen while a peer waits in NCCL. Nothing for a denoiser that is
  // not a UNet or a height run() refuses.
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
  // warm() on rank `rank`'s band, then, with `graphs`, the graphed stale step's buffers and capture.
  void warm_rank(Denoiser& d, const at::Tensor& x, double timestep, int rank) const override;

  // The band height in latent rows for a latent of `height` rows over n bands of a UNet with
  // `downsamplings` stride-2 stages; throws diffract::Error naming the sizes when it cannot split.
  static std::int64_t band_height(std::int64_t height, int n, int downsamplings);
  // The buckets a stale step exchanges for `buckets` asked and `layers` hooked layer calls.
  static int bucket_count(int buckets, int layers);
  // The all_gather contributions step `step` of `steps` makes (the design above) with `layers`
  // hooked layer calls per evaluation and `buckets` asked.
  static int messages_per_step(int step, int steps, int warmup, int n, int layers, int buckets);
  // Frees every rank's graphed stale-step buffers (later jobs take the buckets until warm_rank()
  // runs again); a graph captured with them is never replayed after.
  static void release_static_buffers();

 private:
  // Whether stale steps on `device` may take the graphed path (`graphs`, and stage graphs on for a GPU).
  bool static_stale_steps(const at::Device& device) const;
  // One isolated evaluation of rank `rank`'s band (no exchange), then with `capture` the graphed
  // stale step's buffers and capture (warm() is rank 0 without, warm_rank() the rank's own with).
  void warm_band(Denoiser& d, const at::Tensor& x, double timestep, int rank, bool capture) const;
};

}  // namespace diffract::parallel
