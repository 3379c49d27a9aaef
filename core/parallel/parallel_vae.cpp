#include "core/parallel/parallel_vae.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>

#include <ATen/ATen.h>

#include "core/models/common/attention.h"
#include "core/models/common/layers.h"
#include "core/models/common/patch_parallel.h"
#include "core/models/common/resnet.h"
#include "core/parallel/communicator.h"
#include "core/parallel/device_group.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::parallel {

namespace {

// One rank's band of the decoder: the layer hooks answered synchronously through `comm`.
class VaeBand final : public models::PatchContext {
 public:
  VaeBand(Communicator& comm, std::vector<std::int64_t> band_rows)
      : comm_(comm), rank_(comm.rank()), n_(comm.size()), rows_(std::move(band_rows)) {}

  at::Tensor conv2d(models::Conv2dImpl& conv, const at::Tensor& x) override {
    const auto& o = conv.options;
    const std::int64_t p = o.padding_;
    if (o.kernel != 2 * p + 1 || o.stride_ != 1)
      throw Error("parallel VAE decode: a convolution with kernel " + std::to_string(o.kernel) + ", padding " +
                  std::to_string(p) + ", stride " + std::to_string(o.stride_) + " (only kernel 2p + 1 at stride 1)");
    const std::int64_t h = x.size(2);
    if (h < p)
      throw Error("parallel VAE decode: a band of " + std::to_string(h) + " row(s) is thinner than the convolution's " +
                  std::to_string(p) + "-row halo");
    ++convs;
    const bool up = rank_ > 0, down = rank_ + 1 < n_;
    auto rows_shape = x.sizes().vec();
    rows_shape[2] = p;
    const auto top = x.narrow(2, 0, p).contiguous(), bottom = x.narrow(2, h - p, p).contiguous();
    at::Tensor above = up ? at::empty(rows_shape, x.options()) : at::Tensor();
    at::Tensor below = down ? at::empty(rows_shape, x.options()) : at::Tensor();
    // Down the chain (own last rows to the band below), then up it (own first rows to the band
    // above). Even ranks send first and odd ranks receive first, so no two neighbours both wait
    // on a send (NCCL's point-to-point calls block until the peer's matching call).
    const bool even = rank_ % 2 == 0;
    auto send = [&](const at::Tensor& t, int dst) {
      comm_.send(t, dst);
      ++sends;
    };
    if (even) {
      if (down) send(bottom, rank_ + 1);
      if (up) comm_.recv(above, rank_ - 1);
      if (up) send(top, rank_ - 1);
      if (down) comm_.recv(below, rank_ + 1);
    } else {
      if (up) comm_.recv(above, rank_ - 1);
      if (down) send(bottom, rank_ + 1);
      if (down) comm_.recv(below, rank_ + 1);
      if (up) send(top, rank_ - 1);
    }
    const std::vector<std::int64_t> one = {1, 1};
    const auto zeros = [&] { return at::zeros(rows_shape, x.options()); };
    if (h <= 2 * p) {  // too thin to patch the edges: the band with both halos, convolved whole
      const auto padded = at::cat({up ? above : zeros(), x, down ? below : zeros()}, 2);
      return at::conv2d(padded, conv.weight, conv.bias, one, std::vector<std::int64_t>{0, p});
    }
    // The band with zero padding (right everywhere but the p rows at an edge that has a
    // neighbour), then those rows again from the halo and the 2p rows beside it.
    const std::vector<std::int64_t> pad = {p, p}, pad_w = {0, p};
    auto out = at::conv2d(x, conv.weight, conv.bias, one, pad);
    if (up)
      out.narrow(2, 0, p).copy_(at::conv2d(at::cat({above, x.narrow(2, 0, 2 * p)}, 2), conv.weight, conv.bias, one, pad_w));
    if (down)
      out.narrow(2, h - p, p)
          .copy_(at::conv2d(at::cat({x.narrow(2, h - 2 * p, 2 * p), below}, 2), conv.weight, conv.bias, one, pad_w));
    return out;
  }

  at::Tensor group_norm(models::GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add, bool silu) override {
    ++norms;
    const auto in = models::add_per_channel(x, add);
    const auto groups = norm.options.groups;
    const auto b = in.size(0);
    const auto grouped = in.reshape({b, groups, -1});
    const auto count = static_cast<double>(grouped.size(2));
    // Per group: element count, sum, sum of squared deviations from the band's own mean.
    at::Tensor sum, m2;
    if (in.scalar_type() == at::kFloat || in.scalar_type() == at::kDouble) {
      const auto [var, mean] = at::var_mean(grouped, /*dim=*/{2}, /*correction=*/0, /*keepdim=*/false);
      sum = mean.to(at::kDouble) * count;
      m2 = var.to(at::kDouble) * count;
    } else {  // half types: fp32 reductions over the activation itself, no fp32 copy of it
      const auto s = at::sum(grouped, {2}, false, at::kFloat).to(at::kDouble);
      const auto q = at::linalg_vector_norm(grouped, 2, at::IntArrayRef{2}, false, at::kFloat).to(at::kDouble).square();
      sum = s;
      m2 = (q - s * s / count).clamp_min(0);
    }
    const auto mine = at::stack({at::full_like(sum, count), sum, m2}).contiguous();  // [3, B, G] fp64
    const auto all = comm_.all_gather(mine);
    // Chan et al.'s combination, in rank order: the same numbers on every rank.
    at::Tensor total_n, total_sum;
    for (const auto& a : all) {
      const auto t = a.to(in.device());
      total_n = total_n.defined() ? total_n + t[0] : t[0].clone();
      total_sum = total_sum.defined() ? total_sum + t[1] : t[1].clone();
    }
    const auto mean = total_sum / total_n;
    at::Tensor total_m2;
    for (const auto& a : all) {
      const auto t = a.to(in.device());
      const auto term = t[2] + t[0] * (t[1] / t[0] - mean).square();
      total_m2 = total_m2.defined() ? total_m2 + term : term;
    }
    const auto stats = at::stack({mean, total_m2 / total_n}).to(at::kFloat);  // [2, B, G]: mean, variance
    return models::band_group_norm(norm, in, {stats}, silu);
  }

  std::pair<at::Tensor, at::Tensor> self_attention_kv(const at::Tensor& k, const at::Tensor& v) override {
    ++attentions;
    // Tokens per latent row at this layer, the same for every band.
    const auto t = k.size(1), mine = rows_[static_cast<std::size_t>(rank_)];
    if (t % mine != 0)
      throw Error("parallel VAE decode: attention over " + std::to_string(t) + " tokens in a band of " +
                  std::to_string(mine) + " latent rows");
    const auto per_row = t / mine;
    const auto tallest = *std::max_element(rows_.begin(), rows_.end());
    auto pack = models::kv_pack(k, v);  // [B, t, 2C]
    if (mine < tallest)  // all_gather needs one shape on every rank (NCCL)
      pack = at::constant_pad_nd(pack, {0, 0, 0, (tallest - mine) * per_row}, 0);
    auto packs = comm_.all_gather(pack.contiguous());
    for (std::size_t r = 0; r < packs.size(); ++r) packs[r] = packs[r].narrow(1, 0, rows_[r] * per_row);
    auto [all_k, all_v] = models::kv_unpack(packs);
    return {all_k.to(k.device()), all_v.to(k.device())};
  }

  std::int64_t convs = 0, sends = 0, norms = 0, attentions = 0;

 private:
  Communicator& comm_;
  int rank_, n_;
  std::vector<std::int64_t> rows_;
};

// One rank's band of an overlapped decode: the band carries the rows its convolutions need
// beyond its own, so only GroupNorm asks the other ranks (their moments over their own rows).
class OverlapBand final : public models::PatchContext {
 public:
  OverlapBand(Communicator& comm, std::vector<std::int64_t> starts) : comm_(comm), starts_(std::move(starts)) {}

  // The band now holds image rows [first, ...) at `scale` times the latent resolution.
  void at(std::int64_t scale, std::int64_t first) {
    scale_ = scale;
    first_ = first;
  }
  std::int64_t own_begin() const { return starts_[static_cast<std::size_t>(comm_.rank())] * scale_; }
  std::int64_t own_end() const { return starts_[static_cast<std::size_t>(comm_.rank()) + 1] * scale_; }

  bool convolves_locally() const override { return true; }
  at::Tensor conv2d(models::Conv2dImpl&, const at::Tensor&) override {
    throw Error("overlapped VAE decode: a band's convolution asked for its neighbours' rows");
  }
  std::pair<at::Tensor, at::Tensor> self_attention_kv(const at::Tensor&, const at::Tensor&) override {
    throw Error("overlapped VAE decode: an attention inside a band (only the mid block's, before the bands, is split)");
  }

  at::Tensor group_norm(models::GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add, bool silu) override {
    ++norms;
    const auto groups = norm.options.groups;
    const auto mine = models::group_moments(x, add, groups, own_begin() - first_, own_end() - first_);
    auto sizes = mine.sizes().vec();
    sizes.insert(sizes.begin(), comm_.size());
    const auto all = at::empty(sizes, mine.options());
    comm_.all_gather_into(mine, all);
    std::vector<double> counts;
    const double per_row = static_cast<double>(x.size(1) / groups * x.size(3));
    for (int r = 0; r < comm_.size(); ++r)
      counts.push_back(per_row * static_cast<double>((starts_[static_cast<std::size_t>(r) + 1] - starts_[static_cast<std::size_t>(r)]) * scale_));
    return models::group_norm_with_stats(norm, x, add, models::combine_group_moments(all, counts, norm.options.eps_),
                                         silu);
  }

  std::int64_t norms = 0;

 private:
  Communicator& comm_;
  std::vector<std::int64_t> starts_;  // latent row where each rank's band starts; the last entry: the row count
  std::int64_t scale_ = 1, first_ = 0;
};

// The halo (kernel 2p + 1, stride 1) a convolution adds to what its input must hold.
std::int64_t conv_halo_rows(const models::Conv2d& conv) {
  const auto& o = conv->options;
  if (o.kernel != 2 * o.padding_ + 1 || o.stride_ != 1)
    throw Error("overlapped VAE decode: a convolution with kernel " + std::to_string(o.kernel) + ", padding " +
                std::to_string(o.padding_) + ", stride " + std::to_string(o.stride_) + " (only kernel 2p + 1 at stride 1)");
  return o.padding_;
}

std::int64_t resnet_halo_rows(const torch::nn::Module& m) {
  const auto& r = *m.as<models::ResnetBlock2D>();
  return conv_halo_rows(r.conv1) + conv_halo_rows(r.conv2);
}

// On rank 0: its `part` and ranks 1 .. extents.size() - 1's, received in order and
// concatenated along `dim` (rank r's part is extents[r] long there, like `part` otherwise); the
// other ranks send theirs and get an undefined tensor.
at::Tensor concat_on_first(Communicator& comm, const at::Tensor& part, const std::vector<std::int64_t>& extents,
                           std::int64_t dim) {
  if (comm.rank() != 0) {
    comm.send(part.contiguous(), 0);
    return {};
  }
  std::vector<at::Tensor> parts{part};
  for (std::size_t r = 1; r < extents.size(); ++r) {
    auto shape = part.sizes().vec();
    shape[static_cast<std::size_t>(dim)] = extents[r];
    parts.push_back(at::empty(shape, part.options()));
    comm.recv(parts.back(), static_cast<int>(r));
  }
  return at::cat(parts, dim);
}

models::AutoencoderKL replica_for(const std::vector<models::AutoencoderKL>& replicas, int rank) {
  return replicas.size() == 1 ? replicas.front() : replicas[static_cast<std::size_t>(rank)];
}

void check_inputs(const std::string& what, const std::vector<models::AutoencoderKL>& replicas, int n, const at::Tensor& z) {
  if (replicas.size() != 1 && replicas.size() != static_cast<std::size_t>(n))
    throw Error(what + ": " + std::to_string(replicas.size()) + " VAE replicas for a group of " + std::to_string(n) +
                " (one per rank, or one shared)");
  if (z.dim() != 4) throw Error(what + ": expects latents [B, C, h, w]");
}

// Each band's rows in the decoded image.
std::vector<std::int64_t> band_image_rows(const ParallelDecodeStats& s, const models::AutoencoderKLImpl& vae) {
  std::vector<std::int64_t> rows;
  for (const auto b : s.band_rows) rows.push_back(b * vae.config.downscale_factor());
  return rows;
}

// What both band decodes do first: the inputs checked, `s` reset for `ranks` bands of z's latent
// rows; with fewer rows than ranks (a band needs one) or a single rank, the one-device decode
// (logged for a group), returned; otherwise nothing and s.band_rows filled. A shared replica
// that upcasts makes its fp32 copy here, once, not on n threads.
std::optional<at::Tensor> start_band_decode(const std::string& what, int ranks,
                                            const std::vector<models::AutoencoderKL>& replicas, const at::Tensor& z,
                                            ParallelDecodeStats& s) {
  check_inputs(what, replicas, ranks, z);
  s = ParallelDecodeStats{};
  s.ranks = ranks;
  const auto rows = z.size(2);
  if (ranks < 2 || rows < ranks) {
    if (ranks >= 2)
      log::get("parallel").info(log::str(what, ": ", rows, " latent row(s) for ", ranks,
                                         " devices (a band needs one); decoding on one device"));
    s.ranks = 1;
    s.band_rows = {rows};
    return replica_for(replicas, 0)->decode(z);
  }
  s.parallel = true;
  s.band_rows = vae_band_rows(rows, ranks);
  if (replicas.size() == 1) replica_for(replicas, 0)->decode_modules();
  return std::nullopt;
}

}  // namespace

std::vector<std::int64_t> vae_band_rows(std::int64_t rows, int ranks) {
  if (ranks < 1) throw Error("parallel VAE decode: a group needs at least one rank");
  std::vector<std::int64_t> out(static_cast<std::size_t>(ranks), rows / ranks);
  for (std::int64_t r = 0; r < rows % ranks; ++r) ++out[static_cast<std::size_t>(r)];
  return out;
}

OverlapPlan overlap_plan(models::VAEDecoderImpl& decoder) {
  // Backwards from the image, whose rows need nothing beyond themselves: each convolution
  // widens what its input must hold by its padding, a nearest 2x upsample halves it (rounded up).
  OverlapPlan plan;
  std::int64_t need = conv_halo_rows(decoder.conv_out);
  plan.out = need;
  const auto blocks = static_cast<std::int64_t>(decoder.up_blocks->size());
  plan.up_in.assign(static_cast<std::size_t>(blocks), 0);
  for (std::int64_t b = blocks - 1; b >= 0; --b) {
    auto block = decoder.up_blocks[static_cast<std::size_t>(b)]->as<models::UpDecoderBlock2D>();
    if (block->upsamplers) {
      need += conv_halo_rows(block->upsamplers[0]->as<models::Upsample2D>()->conv);
      need = (need + 1) / 2;
    }
    for (const auto& r : *block->resnets) need += resnet_halo_rows(*r);
    plan.up_in[static_cast<std::size_t>(b)] = need;
  }
  need += resnet_halo_rows(*decoder.mid_block->resnets[1]);
  plan.mid = need;
  return plan;
}

at::Tensor decode_overlapped(DeviceGroup& group, const std::vector<models::AutoencoderKL>& replicas, const at::Tensor& z,
                             ParallelDecodeStats* stats, const OverlapPlan* plan_override) {
  const int n = group.size();
  ParallelDecodeStats local;
  ParallelDecodeStats& s = stats ? *stats : local;
  auto one = start_band_decode("overlapped VAE decode", n, replicas, z, s);
  s.overlapped = true;
  if (one) return *one;
  models::AutoencoderKL vae = replicas.front();
  const auto rows = z.size(2);
  std::vector<std::int64_t> starts(static_cast<std::size_t>(n) + 1, 0);
  for (int r = 0; r < n; ++r) starts[r + 1] = starts[r] + s.band_rows[r];
  const auto plan = plan_override ? *plan_override : overlap_plan(*vae->decoder);
  s.overlap_rows = plan.mid;

  const auto image_rows = band_image_rows(s, *vae);
  at::Tensor image;
  std::vector<std::int64_t> bytes(static_cast<std::size_t>(n));
  group.run([&](int rank, Communicator& comm) {
    const auto bytes_before = comm.bytes_sent();
    auto m = replica_for(replicas, rank)->decode_modules();
    auto& dec = *m.decoder;
    const auto device = m.decoder->conv_in->weight.device();
    const auto own_begin = starts[rank], own_end = starts[rank + 1];
    // Every rank runs the decoder up to the mid block's attention on the whole latent image
    // (a few ms at latent resolution), so that the attention's keys and values are at hand.
    auto h = z.to(device, m.dtype);
    if (m.post_quant_conv) h = m.post_quant_conv->forward(h);
    h = dec.mid_block->resnets[0]->as<models::ResnetBlock2D>()->forward(dec.conv_in->forward(h));
    std::int64_t first = std::max<std::int64_t>(0, own_begin - plan.mid);
    const std::int64_t last = std::min(rows, own_end + plan.mid);
    h = dec.mid_block->attentions ? dec.mid_block->attentions[0]->as<models::Attention>()->forward_rows(h, first, last)
                                  : h.narrow(2, first, last - first);
    OverlapBand band(comm, starts);
    {
      const models::PatchScope scope(&band);
      std::int64_t scale = 1;
      // Keeps the band's own rows and `halo` more on each side that has a neighbour.
      const auto crop = [&](std::int64_t halo) {
        const auto b = std::max<std::int64_t>(0, own_begin * scale - halo);
        const auto e = std::min(rows * scale, own_end * scale + halo);
        if (b != first || e != first + h.size(2)) h = h.narrow(2, b - first, e - b).contiguous();
        first = b;
        band.at(scale, first);
      };
      band.at(scale, first);
      h = dec.mid_block->resnets[1]->as<models::ResnetBlock2D>()->forward(h);
      for (std::size_t b = 0; b < dec.up_blocks->size(); ++b) {
        crop(plan.up_in[b]);
        auto block = dec.up_blocks[b]->as<models::UpDecoderBlock2D>();
        h = block->forward(h);
        if (block->upsamplers) scale *= 2, first *= 2;
      }
      crop(plan.out);
      h = dec.conv_out->forward(dec.conv_norm_out->forward(h, {}, /*silu=*/true));
      crop(0);
    }
    auto all = concat_on_first(comm, h, image_rows, 2);
    if (rank == 0) {
      image = all;
      s.norms = band.norms;
    }
    bytes[rank] = comm.bytes_sent() - bytes_before;
  });
  s.image_messages = n - 1;
  s.bytes_sent = bytes;
  return image;
}

std::string parallel_vae_mode(std::int64_t pixels) {
  const std::string set = options::value(options::Id::ParallelVae);
  if (set == "0") return "";
  if (set == "1" || set == "overlap") return "overlap";
  if (set == "exchange") return "exchange";
  if (!set.empty())
    log::get("parallel").warn("DIFFRACT_PARALLEL_VAE=" + set + " is none of 0, 1, overlap, exchange: using the default");
  return pixels >= 3'000'000 ? "exchange" : "";
}

bool batch_vae_enabled() {
  return options::flag(options::Id::BatchVae);
}

at::Tensor decode_batch_parallel(DeviceGroup& group, const std::vector<models::AutoencoderKL>& replicas,
                                 const at::Tensor& z, int* ranks) {
  const int n = group.size();
  check_inputs("batch-split VAE decode", replicas, n, z);
  const int used = static_cast<int>(std::min<std::int64_t>(n, z.size(0)));
  if (ranks) *ranks = used;
  if (used < 2) return replica_for(replicas, 0)->decode(z);
  const auto counts = vae_band_rows(z.size(0), used);
  std::vector<std::int64_t> starts(static_cast<std::size_t>(used), 0);
  for (int r = 1; r < used; ++r) starts[r] = starts[r - 1] + counts[r - 1];
  // A shared replica that upcasts makes its fp32 copy on first use: once, here, not on n threads.
  if (replicas.size() == 1) replica_for(replicas, 0)->decode_modules();
  at::Tensor image;
  group.run([&](int rank, Communicator& comm) {
    if (rank >= used) return;
    auto out = replica_for(replicas, rank)->decode(z.narrow(0, starts[rank], counts[rank]).to(group.device(rank)));
    auto all = concat_on_first(comm, out, counts, 0);
    if (rank == 0) image = all;
  });
  return image;
}

at::Tensor decode_parallel(DeviceGroup& group, const std::vector<models::AutoencoderKL>& replicas, const at::Tensor& z,
                           ParallelDecodeStats* stats) {
  const int n = group.size();
  ParallelDecodeStats local;
  ParallelDecodeStats& s = stats ? *stats : local;
  if (auto one = start_band_decode("parallel VAE decode", n, replicas, z, s)) return *one;
  models::AutoencoderKL vae = replicas.front();
  std::vector<std::int64_t> starts(static_cast<std::size_t>(n), 0);
  for (int r = 1; r < n; ++r) starts[r] = starts[r - 1] + s.band_rows[r - 1];

  const auto image_rows = band_image_rows(s, *vae);
  at::Tensor image;
  std::vector<std::int64_t> sends(static_cast<std::size_t>(n)), bytes(static_cast<std::size_t>(n));
  group.run([&](int rank, Communicator& comm) {
    const auto bytes_before = comm.bytes_sent();
    VaeBand band(comm, s.band_rows);
    at::Tensor out;
    {
      const models::PatchScope scope(&band);
      out = replica_for(replicas, rank)->decode(z.narrow(2, starts[rank], s.band_rows[rank]).to(group.device(rank)));
    }
    auto all = concat_on_first(comm, out, image_rows, 2);
    if (rank == 0) image = all;
    sends[rank] = band.sends;
    bytes[rank] = comm.bytes_sent() - bytes_before;
    if (rank == 0) {
      s.convs = band.convs;
      s.norms = band.norms;
      s.attentions = band.attentions;
    }
  });
  for (int r = 0; r < n; ++r) s.halo_messages += sends[r];
  s.image_messages = n - 1;
  s.bytes_sent = bytes;
  return image;
}

}  // namespace diffract::parallel
