// The AutoencoderKL decoder split over a device group in row bands (core/parallel/parallel_vae.h),
// on CPU virtual devices: exact against the one-device decode, the messages its design says, the
// fallback, and through the SD pipeline's multi-device jobs; and a batch split over the devices
// image by image.
#include <algorithm>
#include <cstdlib>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/common/attention.h"
#include "core/models/common/layers.h"
#include "core/parallel/device_group.h"
#include "core/parallel/parallel_vae.h"
#include "core/parallel/strategies.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
using namespace diffract::parallel;

namespace {

// A tiny random VAE: 3 blocks (two 2x upsamples), mid-block attention, random norm affines.
models::AutoencoderKL tiny_vae() {
  models::AutoencoderKLConfig c;
  c.block_out_channels = {8, 16, 16};
  c.up_block_types = std::vector<std::string>(3, "UpDecoderBlock2D");
  c.down_block_types = std::vector<std::string>(3, "DownEncoderBlock2D");
  c.layers_per_block = 1;
  c.norm_num_groups = 4;
  models::AutoencoderKL vae(c);
  vae->eval();
  models::init_random(*vae, 5);
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  for (auto& p : vae->named_parameters()) {
    const auto& name = p.key();
    if (name.find("norm") != std::string::npos) {
      auto noise = at::randn(p.value().sizes(), gen) * 0.2;
      p.value().add_(noise);  // weight 1 + noise, bias 0 + noise
    }
  }
  return vae;
}

// The tiny VAE without its mid-block attention.
models::AutoencoderKL tiny_vae_without_attention() {
  auto c = tiny_vae()->config;
  c.mid_block_add_attention = false;
  models::AutoencoderKL plain(c);
  plain->eval();
  models::init_random(*plain, 6);
  return plain;
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / b.to(at::kDouble).abs().max().item<double>();
}

at::Tensor latents(int64_t b, int64_t h, int64_t w) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  return at::randn({b, 4, h, w}, gen);
}

// The decoder's 3x3 convolutions in call order: (input channels, width in latent widths).
std::vector<std::pair<int64_t, int64_t>> decoder_convs(const models::AutoencoderKLConfig& c) {
  const std::vector<int64_t> ch(c.block_out_channels.rbegin(), c.block_out_channels.rend());
  std::vector<std::pair<int64_t, int64_t>> out{{c.latent_channels, 1}};
  for (int i = 0; i < 4; ++i) out.push_back({ch[0], 1});  // mid block: 2 resnets
  int64_t s = 1;
  for (std::size_t i = 0; i < ch.size(); ++i) {
    const auto in = i == 0 ? ch[0] : ch[i - 1];
    for (int64_t l = 0; l < c.layers_per_block + 1; ++l) {
      out.push_back({l == 0 ? in : ch[i], s});
      out.push_back({ch[i], s});
    }
    if (i + 1 < ch.size()) {
      s *= 2;
      out.push_back({ch[i], s});  // the upsampler's conv, after the nearest 2x
    }
  }
  out.push_back({ch.back(), s});  // conv_out
  return out;
}

int64_t count_norms(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& child : m.modules(/*include_self=*/false))
    if (dynamic_cast<models::GroupNormImpl*>(child.get())) ++n;
  return n;
}

// A 2-step tiny-SDXL request of `batch` images at width x height, CFG 5, no previews.
job::GenerationRequest tiny_request(int width, int height, int batch, std::uint64_t seed) {
  job::GenerationRequest req;
  req.prompt = "a red apple";
  req.negative_prompt = "blurry";
  req.width = width;
  req.height = height;
  req.steps = 2;
  req.cfg = 5.0;
  req.seed = seed;
  req.batch = batch;
  req.sampler = "euler";
  req.preview_every = 0;
  return req;
}

// The largest difference in 8-bit levels between two results' images, image by image.
int worst_levels(const job::GenerationResult& one, const job::GenerationResult& two) {
  if (one.images.size() != two.images.size()) return 256;
  int worst = 0;
  for (std::size_t k = 0; k < one.images.size(); ++k) {
    const auto& a = one.images[k].rgb;
    const auto& b = two.images[k].rgb;
    if (a.size() != b.size()) return 256;
    for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(int(a[i]) - int(b[i])));
  }
  return worst;
}

}  // namespace

class TestParallelVae : public QObject {
  Q_OBJECT

 private slots:
  void bandRows() {
    QVERIFY(vae_band_rows(13, 4) == (std::vector<int64_t>{4, 3, 3, 3}));
    QVERIFY(vae_band_rows(9, 2) == (std::vector<int64_t>{5, 4}));
    QVERIFY(vae_band_rows(6, 3) == (std::vector<int64_t>{2, 2, 2}));
  }

  // When and how the pipelines split a decode in bands: large images with exchanges unless told otherwise.
  void bandsForLargeImages() {
    unsetenv("DIFFRACT_PARALLEL_VAE");
    QCOMPARE(parallel_vae_mode(1024 * 1024), std::string());
    QCOMPARE(parallel_vae_mode(2048 * 2048), std::string("exchange"));
    setenv("DIFFRACT_PARALLEL_VAE", "1", 1);
    QCOMPARE(parallel_vae_mode(64 * 64), std::string("overlap"));
    setenv("DIFFRACT_PARALLEL_VAE", "overlap", 1);
    QCOMPARE(parallel_vae_mode(2048 * 2048), std::string("overlap"));
    setenv("DIFFRACT_PARALLEL_VAE", "exchange", 1);
    QCOMPARE(parallel_vae_mode(64 * 64), std::string("exchange"));
    setenv("DIFFRACT_PARALLEL_VAE", "0", 1);
    QCOMPARE(parallel_vae_mode(2048 * 2048), std::string());
    setenv("DIFFRACT_PARALLEL_VAE", "bands", 1);  // unknown: the default, with a warning
    QCOMPARE(parallel_vae_mode(2048 * 2048), std::string("exchange"));
    unsetenv("DIFFRACT_PARALLEL_VAE");
  }

  // The rows a band carries beyond its own, from the decoder's convolutions: SDXL's VAE and the
  // tiny one (3 blocks of 2 ResNets, two upsamples).
  void overlapPlan() {
    models::AutoencoderKL sdxl(models::AutoencoderKLConfig::sdxl());
    const auto p = overlap_plan(*sdxl->decoder);
    QCOMPARE(p.mid, int64_t(15));
    QVERIFY(p.up_in == (std::vector<int64_t>{13, 12, 10, 7}));
    QCOMPARE(p.out, int64_t(1));
    auto vae = tiny_vae();
    const auto t = overlap_plan(*vae->decoder);
    QCOMPARE(t.mid, int64_t(10));
    QVERIFY(t.up_in == (std::vector<int64_t>{8, 7, 5}));
    QCOMPARE(t.out, int64_t(1));
  }

  // Spatial self-attention for some rows: forward()'s rows, whatever the range.
  void attentionRows() {
    auto vae = tiny_vae();
    auto attn = vae->decoder->mid_block->attentions[0]->as<models::Attention>();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
    const auto x = at::randn({2, 16, 7, 5}, gen);
    at::NoGradGuard no_grad;
    const auto full = attn->forward(x);
    for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 7}, {0, 3}, {2, 6}, {6, 7}}) {
      const auto rows = attn->forward_rows(x, b, e);
      QVERIFY(rows.sizes() == full.narrow(2, b, e - b).sizes());
      QVERIFY2(max_rel(rows, full.narrow(2, b, e - b)) < 1e-5, qPrintable(QString("rows %1..%2").arg(b).arg(e)));
    }
    DIFFRACT_EXPECT_ERROR(attn->forward_rows(x, 3, 3), "Attention.forward_rows", "rows [3, 3)");
    DIFFRACT_EXPECT_ERROR(attn->forward_rows(x, 0, 8), "rows [0, 8) of an input 7 rows high");
    DIFFRACT_EXPECT_ERROR(attn->forward_rows(x.flatten(2).transpose(1, 2), 0, 1), "spatial self-attention only");
  }

  // Wide-head attention (the VAE's 512-wide head on CUDA) is SDPA's attention, in one chunk of
  // queries or many.
  void wideHeadAttentionIsAttention() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
    const auto q = at::randn({3, 37, 24}, gen), k = at::randn({3, 29, 24}, gen) * 2, v = at::randn({3, 29, 24}, gen);
    const auto ref = at::scaled_dot_product_attention(q, k, v);
    for (int64_t bytes : {int64_t(1) << 30, int64_t(3 * 29 * 4 * 5), int64_t(1)}) {  // one chunk, 5 rows, 1 row
      const auto out = models::wide_head_attention(q, k, v, bytes);
      QVERIFY(out.sizes() == ref.sizes());
      QVERIFY2(max_rel(out, ref) < 1e-5, qPrintable(QString("chunks of %1 bytes: %2").arg(bytes).arg(max_rel(out, ref))));
    }
  }

  // Overlapped bands (no halo exchange) give the one-device decode for 2, 3 and 4 ranks, bands
  // wider or narrower than their halo, uneven rows, one replica per rank, and without the
  // mid-block attention; a plan one row short anywhere does not, so the comparison can fail.
  void overlapMatchesOneDevice() {
    auto vae = tiny_vae();
    for (int64_t h : {40, 13}) {
      const auto z = latents(2, h, 6);
      const auto ref = vae->decode(z);
      for (int n : {2, 3, 4}) {
        auto group = DeviceGroup::virtual_cpu(n);
        ParallelDecodeStats s;
        const auto out = decode_overlapped(*group, {vae}, z, &s);
        QVERIFY(s.parallel && s.overlapped);
        QCOMPARE(s.ranks, n);
        QCOMPARE(s.overlap_rows, int64_t(10));
        QCOMPARE(s.convs, int64_t(0));
        QCOMPARE(s.halo_messages, int64_t(0));
        QVERIFY(out.sizes() == ref.sizes());
        const double d = max_rel(out, ref);
        qInfo("%lld rows, %d overlapped bands: max relative difference %.3g", static_cast<long long>(h), n, d);
        QVERIFY2(d < 1e-5, qPrintable(QString("%1 bands differ by %2").arg(n).arg(d)));
      }
    }
    const auto z = latents(1, 40, 6);
    const auto ref = vae->decode(z);
    auto three = DeviceGroup::virtual_cpu(3);
    std::vector<models::AutoencoderKL> replicas{vae, tiny_vae(), tiny_vae()};
    QVERIFY(max_rel(decode_overlapped(*three, replicas, z), ref) < 1e-5);
    const auto plan = overlap_plan(*vae->decoder);
    const auto short_by_one = [&](int where) {
      auto p = plan;
      if (where == 0) --p.mid;
      else if (where <= 3) --p.up_in[static_cast<std::size_t>(where - 1)];
      else --p.out;
      return max_rel(decode_overlapped(*three, {vae}, z, nullptr, &p), ref);
    };
    for (int where = 0; where <= 4; ++where)
      QVERIFY2(short_by_one(where) > 1e-5, qPrintable(QString("a plan short at stage %1 still matched").arg(where)));
    auto plain = tiny_vae_without_attention();
    const auto z4 = latents(1, 4, 5);
    auto four = DeviceGroup::virtual_cpu(4);
    QVERIFY(max_rel(decode_overlapped(*four, {plain}, z4), plain->decode(z4)) < 1e-5);
    // Fewer rows than ranks: one device.
    ParallelDecodeStats s;
    QVERIFY(at::equal(decode_overlapped(*four, {vae}, z.narrow(2, 0, 3), &s), vae->decode(z.narrow(2, 0, 3))));
    QVERIFY(!s.parallel);
    DIFFRACT_EXPECT_ERROR(decode_overlapped(*four, {vae, vae}, z), "overlapped VAE decode", "replicas");
  }

  // Per overlapped decode: one small all_gather per GroupNorm from the mid block's second ResNet
  // on (each rank's [B, G, 2] fp32 moments), the image bands to rank 0, nothing else.
  void overlapMessagesMatchTheDesign() {
    auto vae = tiny_vae();
    const auto& c = vae->config;
    const int64_t b = 2, h = 40, w = 6, f = c.downscale_factor();
    const auto z = latents(b, h, w);
    auto& dec = *vae->decoder;
    int64_t norms = count_norms(*dec.mid_block->resnets[1]) + count_norms(*dec.up_blocks) + 1;  // + conv_norm_out
    for (int n : {2, 4}) {
      auto group = DeviceGroup::virtual_cpu(n);
      ParallelDecodeStats s;
      decode_overlapped(*group, {vae}, z, &s);
      QCOMPARE(s.norms, norms);
      QCOMPARE(s.image_messages, int64_t(n - 1));
      const auto rows = vae_band_rows(h, n);
      for (int r = 0; r < n; ++r) {
        int64_t expected = norms * b * c.norm_num_groups * 2 * 4;
        if (r > 0) expected += b * c.out_channels * rows[r] * f * w * f * 4;
        QCOMPARE(s.bytes_sent[static_cast<std::size_t>(r)], expected);
      }
    }
  }

  // 2, 3 and 4 bands of 13 latent rows (uneven) give the one-device decode; each band decoded on
  // its own (no exchange) does not, so the comparison can fail.
  void matchesOneDevice() {
    auto vae = tiny_vae();
    QVERIFY(!vae->decoder->mid_block->attentions.is_empty());
    const auto z = latents(2, 13, 6);
    const auto ref = vae->decode(z);
    for (int n : {2, 3, 4}) {
      auto group = DeviceGroup::virtual_cpu(n);
      ParallelDecodeStats s;
      const auto out = decode_parallel(*group, {vae}, z, &s);
      QVERIFY(s.parallel);
      QCOMPARE(s.ranks, n);
      QVERIFY(out.sizes() == ref.sizes());
      const double d = max_rel(out, ref);
      qInfo("%d bands: max relative difference %.3g", n, d);
      QVERIFY2(d < 1e-5, qPrintable(QString("%1 bands differ by %2").arg(n).arg(d)));
      // Independent bands: what the exchanges are for.
      std::vector<at::Tensor> parts;
      int64_t start = 0;
      for (auto rows : vae_band_rows(13, n)) {
        parts.push_back(vae->decode(z.narrow(2, start, rows)));
        start += rows;
      }
      QVERIFY(max_rel(at::cat(parts, 2), ref) > 1e-3);
    }
    // One replica per rank (as on GPUs) gives the same.
    auto group = DeviceGroup::virtual_cpu(3);
    std::vector<models::AutoencoderKL> replicas{vae, tiny_vae(), tiny_vae()};
    QVERIFY(max_rel(decode_parallel(*group, replicas, z), ref) < 1e-5);
    // Without the attention, and a band of a single latent row.
    auto plain = tiny_vae_without_attention();
    const auto z4 = latents(1, 4, 5);
    auto four = DeviceGroup::virtual_cpu(4);
    QVERIFY(max_rel(decode_parallel(*four, {plain}, z4), plain->decode(z4)) < 1e-5);
  }

  // Per decode: one halo exchange per 3x3 convolution (a send to each neighbour), one small
  // all_gather per GroupNorm, one K/V all_gather for the attention, the image bands to rank 0;
  // the bytes each rank sent are exactly those.
  void messagesMatchTheDesign() {
    auto vae = tiny_vae();
    const auto& c = vae->config;
    const int64_t b = 2, h = 13, w = 6, f = c.downscale_factor();
    const auto z = latents(b, h, w);
    const auto convs = decoder_convs(c);
    const auto norms = count_norms(*vae->decoder);
    const int64_t groups = c.norm_num_groups, ch0 = c.block_out_channels.back();
    for (int n : {2, 3, 4}) {
      auto group = DeviceGroup::virtual_cpu(n);
      ParallelDecodeStats s;
      decode_parallel(*group, {vae}, z, &s);
      QCOMPARE(s.convs, static_cast<int64_t>(convs.size()));
      QCOMPARE(s.halo_messages, 2 * (n - 1) * s.convs);
      QCOMPARE(s.norms, norms);
      QCOMPARE(s.attentions, int64_t(1));
      QCOMPARE(s.image_messages, int64_t(n - 1));
      const auto rows = vae_band_rows(h, n);
      const auto tallest = *std::max_element(rows.begin(), rows.end());
      for (int r = 0; r < n; ++r) {
        const int64_t neighbours = (r > 0) + (r + 1 < n);
        int64_t expected = 0;
        for (const auto& [cin, scale] : convs) expected += neighbours * b * cin * w * scale * 4;  // one fp32 row each
        expected += norms * 3 * b * groups * 8;                                                  // count, sum, M2 (fp64)
        expected += b * tallest * w * 2 * ch0 * 4;                                               // K and V, padded
        if (r > 0) expected += b * c.out_channels * rows[r] * f * w * f * 4;                     // the image band
        QCOMPARE(s.bytes_sent[static_cast<std::size_t>(r)], expected);
      }
    }
  }

  // Fewer latent rows than ranks: the one-device decode, said so in the stats; bad replica counts
  // are errors.
  void fallsBack() {
    auto vae = tiny_vae();
    const auto z = latents(1, 3, 4);
    auto group = DeviceGroup::virtual_cpu(4);
    ParallelDecodeStats s;
    const auto out = decode_parallel(*group, {vae}, z, &s);
    QVERIFY(!s.parallel);
    QCOMPARE(s.ranks, 1);
    QVERIFY(at::equal(out, vae->decode(z)));
    DIFFRACT_EXPECT_ERROR(decode_parallel(*group, {vae, vae}, z), "replicas", "one per rank");
  }

  // A batch split over the ranks image by image: the one-device decode of each image, in order,
  // however the batch divides (5 over 3: 2, 2, 1; 2 over 4: two ranks idle; 1: one rank).
  void batchSplitMatchesOneDevice() {
    auto vae = tiny_vae();
    const auto z = latents(5, 6, 5);
    const auto ref = vae->decode(z);
    auto three = DeviceGroup::virtual_cpu(3);
    int ranks = 0;
    const auto out = decode_batch_parallel(*three, {vae, tiny_vae(), tiny_vae()}, z, &ranks);
    QCOMPARE(ranks, 3);
    QVERIFY(out.sizes() == ref.sizes());
    QVERIFY2(max_rel(out, ref) < 1e-5, qPrintable(QString("differs by %1").arg(max_rel(out, ref))));
    // Each image against its own single decode: the order survives.
    for (int64_t i = 0; i < 5; ++i) QVERIFY(max_rel(out[i], vae->decode(z.narrow(0, i, 1))[0]) < 1e-5);
    auto four = DeviceGroup::virtual_cpu(4);
    QVERIFY(max_rel(decode_batch_parallel(*four, {vae}, z.narrow(0, 0, 2), &ranks), ref.narrow(0, 0, 2)) < 1e-5);
    QCOMPARE(ranks, 2);
    QVERIFY(at::equal(decode_batch_parallel(*four, {vae}, z.narrow(0, 3, 1), &ranks), vae->decode(z.narrow(0, 3, 1))));
    QCOMPARE(ranks, 1);
    DIFFRACT_EXPECT_ERROR(decode_batch_parallel(*four, {vae, vae}, z), "replicas", "one per rank");
    DIFFRACT_EXPECT_ERROR(decode_batch_parallel(*four, {vae}, z[0]), "batch-split VAE decode", "expects latents [B, C, h, w]");
  }

  // A data-parallel job of 3 images on 2 virtual devices decodes them on both ranks (metadata
  // says so) and gives the images of the one-device decode (DIFFRACT_BATCH_VAE=0).
  void pipelineBatchJob() {
    auto sd = pipeline::StableDiffusion::random(job::ModelFamily::SDXL, /*tiny=*/true, "cpu");
    const auto req = tiny_request(64, 64, 3, 4);
    job::CancelToken never;
    const auto strategy = make_strategy("data-parallel", 2);
    setenv("DIFFRACT_BATCH_VAE", "0", 1);
    const auto one = sd->generate(req, {}, never, strategy.get());
    unsetenv("DIFFRACT_BATCH_VAE");
    const auto two = sd->generate(req, {}, never, strategy.get());
    QCOMPARE(nlohmann::json::parse(one.metadata_json)["vae_decode_devices"].get<int>(), 1);
    QCOMPARE(nlohmann::json::parse(two.metadata_json)["vae_decode_devices"].get<int>(), 2);
    QCOMPARE(two.images.size(), std::size_t{3});
    const int worst = worst_levels(one, two);
    QVERIFY2(worst <= 1, qPrintable(QString("batch-split decode differs by %1 levels").arg(worst)));
  }

  // A cfg-parallel job on 2 virtual devices decodes on both (metadata says so) and gives the
  // image of the one-device decode (DIFFRACT_PARALLEL_VAE=0), with either split.
  void pipelineJob() {
    auto sd = pipeline::StableDiffusion::random(job::ModelFamily::SDXL, /*tiny=*/true, "cpu");
    const auto req = tiny_request(64, 72, 1, 3);  // 9 latent rows: bands of 5 and 4
    job::CancelToken never;
    const auto strategy = make_strategy("cfg-parallel", 2);
    setenv("DIFFRACT_PARALLEL_VAE", "0", 1);
    const auto one = sd->generate(req, {}, never, strategy.get());
    QCOMPARE(nlohmann::json::parse(one.metadata_json)["vae_decode_devices"].get<int>(), 1);
    for (const char* mode : {"exchange", "overlap"}) {
      setenv("DIFFRACT_PARALLEL_VAE", mode, 1);
      const auto two = sd->generate(req, {}, never, strategy.get());
      QCOMPARE(nlohmann::json::parse(two.metadata_json)["vae_decode_devices"].get<int>(), 2);
      QVERIFY(one.latents == two.latents);
      const int worst = worst_levels(one, two);
      QVERIFY2(worst <= 1, qPrintable(QString("%1 decode differs by %2 levels").arg(mode).arg(worst)));
      QVERIFY(two.timings.vae_decode_ms > 0);
    }
    unsetenv("DIFFRACT_PARALLEL_VAE");
  }
};

QTEST_APPLESS_MAIN(TestParallelVae)
#include "test_parallel_vae.moc"
