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

// What one decode_parallel() did, for tests and logs.
struct ParallelDecodeStats {
  bool parallel = false;               // false: too few rows, decoded on one device
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

// Whether the pipelines split the final decode of a `pixels`-pixel image over a multi-device
// job's group: DIFFRACT_PARALLEL_VAE=1 always, =0 never; unset, for images of 3 megapixels or more.
// Its exchanges stop every device (33 halo exchanges, 30 GroupNorm gathers): at 1024² on 2 H200s
// it was slower than one GPU (41.2 against 37.6 ms), at 2048² on 4 it was 3 times faster (74.8
// against 223.7 ms; docs/benchmarks.md).
bool parallel_vae_wanted(std::int64_t pixels);

}  // namespace diffract::parallel
