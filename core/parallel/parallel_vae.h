#pragma once
// The AutoencoderKL decoder split over a device group (xDiT's DistVAE): each rank decodes a
// horizontal band of the latent rows, and the decoder's layers that look beyond a row are made
// exact through models::PatchContext (core/models/common/patch_parallel.h), synchronously:
//  - a 3x3 convolution (padding 1) gets its neighbours' boundary row (one row from the band
//    above, one from the band below: a send and a recv per neighbour, nothing else);
//  - a GroupNorm gets every band's per-group element count, sum and sum of squared deviations
//    (fp64, [3, B, G]) through one all_gather of those small statistics, combined in rank order
//    (so every rank normalises with the same numbers), then normalises (+ SiLU) its band;
//  - the mid block's self-attention all_gathers the keys and values (padded to the tallest
//    band, as NCCL needs equal shapes) so each band's queries attend over the whole image;
//  - the nearest 2x upsample and the 1x1 convolutions are local;
//  - the image bands are sent to rank 0, which concatenates them.
// The result equals AutoencoderKL::decode on one device up to rounding (different convolution
// shapes, sums in another order).
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/models/autoencoders/autoencoder_kl.h"

namespace diffract::parallel {

class DeviceGroup;

// What one decode_parallel() or decode_overlapped() did, for tests and logs.
struct ParallelDecodeStats {
  bool parallel = false;               // false: too few rows, decoded on one device
  bool overlapped = false;             // decode_overlapped (no halo exchanges)
  std::int64_t overlap_rows = 0;       // decode_overlapped: latent rows each band adds per neighbour
  int ranks = 0;
  std::vector<std::int64_t> band_rows;  // latent rows per rank
  // Hooked layer calls per rank (the same on every rank) and the messages they sent in all.
  std::int64_t convs = 0;              // 3x3 convolutions: halo exchanges
  std::int64_t halo_messages = 0;      // sends over all ranks: 2 (ranks - 1) per convolution
  std::int64_t norms = 0;              // GroupNorms: one all_gather of [3, B, G] fp64 each
  std::int64_t attentions = 0;         // self-attentions: one all_gather of K and V each
  std::int64_t image_messages = 0;     // image bands sent to rank 0: ranks - 1
  std::vector<std::int64_t> bytes_sent;  // per rank, from its communicator, during the decode
};

// Latent rows split as evenly as possible over `ranks` (the first rows % ranks bands one taller).
std::vector<std::int64_t> vae_band_rows(std::int64_t rows, int ranks);

// Decodes unscaled latents z [B, C, h, w] (on any device) with the decoder split over `group`:
// replicas[r] is rank r's AutoencoderKL on group.device(r), or a single replica shared by every
// rank (CPU virtual devices: inference only reads it). Returns what replicas[0]->decode(z) returns
// (its dtype), on group.device(0). With fewer latent rows than ranks (a band needs one row) it
// logs that and decodes on rank 0's replica alone; a group of one does the same silently.
at::Tensor decode_parallel(DeviceGroup& group, const std::vector<models::AutoencoderKL>& replicas, const at::Tensor& z,
                           ParallelDecodeStats* stats = nullptr);

// The row-band decode without halo exchanges: each rank decodes its band of latent rows plus
// the rows beside it that its convolutions reach (overlap_plan), so no convolution waits for a
// neighbour. Every rank first runs post_quant_conv, conv_in and the mid block's first ResNet on
// the whole latent image (cheap at latent resolution), then the mid block's attention for its
// band's queries only (Attention::forward_rows, against every latent's keys and values); from
// there on it holds a band, cut back before each up block to the rows still needed. GroupNorm
// is the one layer that asks the other ranks: each rank's moments over its own rows, gathered
// ([ranks, B, G, 2] fp32, one all_gather_into per GroupNorm: 25 for the SDXL VAE) and combined in
// double in rank order (models::combine_group_moments), so every rank normalises with the whole
// image's statistics. Then the image bands go to rank 0. Exact up to rounding: equals
// AutoencoderKL::decode on one device. Arguments, result and the one-device fallback as for
// decode_parallel(); the band's device is its replica's. `plan` replaces overlap_plan()'s (tests
// show that a band one row short of it is wrong).
struct OverlapPlan;
at::Tensor decode_overlapped(DeviceGroup& group, const std::vector<models::AutoencoderKL>& replicas, const at::Tensor& z,
                             ParallelDecodeStats* stats = nullptr, const OverlapPlan* plan = nullptr);

// The rows a band of decode_overlapped() holds beyond its own on each side with a neighbour,
// from the decoder's convolutions (each adds its padding; a nearest 2x upsample halves what its
// input needs, rounded up): `mid` latent rows after the mid block's attention, `up_in[b]` rows
// (at that block's resolution) before up block b, `out` image rows before conv_norm_out. The SDXL
// VAE: 15; 13, 12, 10, 7; 1. Throws diffract::Error for a convolution that is not kernel 2p + 1 at
// stride 1.
struct OverlapPlan {
  std::int64_t mid = 0;
  std::vector<std::int64_t> up_in;
  std::int64_t out = 0;
};
OverlapPlan overlap_plan(models::VAEDecoderImpl& decoder);

// Decodes unscaled latents z [B, C, h, w] with the batch split over `group`: rank r decodes its
// share of the images (vae_band_rows(B, n) of them, in order; ranks beyond B idle) on its replica
// and sends them to rank 0, which concatenates them. No layer talks to another rank, so each
// image is what that replica decodes alone at that batch size. `replicas` as for
// decode_parallel(). Returns the images on group.device(0) in replicas[0]'s dtype; the number of
// ranks that decoded goes to `ranks`.
at::Tensor decode_batch_parallel(DeviceGroup& group, const std::vector<models::AutoencoderKL>& replicas,
                                 const at::Tensor& z, int* ranks = nullptr);

// Whether a multi-device job of 2 or more images decodes them split over its devices
// (decode_batch_parallel): yes unless the environment sets DIFFRACT_BATCH_VAE=0.
bool batch_vae_enabled();

// How the pipelines split the final decode of a `pixels`-pixel image over a multi-device job's
// group: "overlap" (decode_overlapped), "exchange" (decode_parallel) or "" (on the first device
// alone). DIFFRACT_PARALLEL_VAE=0 never splits, =1 or =overlap overlaps, =exchange exchanges;
// unset: "exchange" for images of 3 megapixels or more, else "". decode_parallel's halo
// exchanges stop every device (33 halo exchanges, 30 GroupNorm gathers): measured slower than one
// GPU at 1024² on 2, faster at 2048² on 4 (docs/benchmarks.md). decode_overlapped is unmeasured on GPUs.
std::string parallel_vae_mode(std::int64_t pixels);

}  // namespace diffract::parallel
