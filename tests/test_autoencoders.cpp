#include <fstream>
#include <functional>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/io/weights.h"
#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/autoencoders/taesd.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

// fp32 on CPU against diffusers' fp32 on CPU: the same operations, possibly in another order
// (convolution algorithms, attention kernel), so rounding differences only. Measured maxima
// (logged by each comparison) are noted beside each bound; the bounds leave room for other
// CPUs' kernels while staying far below what any wrong layer would give.
constexpr double kKLAtol = 1e-4;     // tiny KL VAEs, values up to ~7: measured 7.5e-6 (decode), 0 elsewhere
constexpr double kTinyAtol = 1e-5;   // tiny AutoencoderTiny configs, latents up to ~0.1, images ~1: measured 0
constexpr double kTaef2Atol = 2e-4;  // TAEF2 on a 512x512 photograph, latents up to ~4.6: measured 0
// The TAEF2 encode -> decode round trip of astronaut.png measures 31.19 dB PSNR in the Python
// reference and here alike. A model missing the decoder's mid-block GroupNorm branch scores
// 20.8 dB and a flat grey image 9.8 dB, so 30 dB keeps about 1 dB of slack for numerical drift
// while any real architecture or weight-mapping error falls far below it.
constexpr double kTaef2MinPsnr = 30.0;

fs::path vae_dir() { return test::fixtures() / "vae"; }

io::StateDict cases(const char* file) { return io::load_state_dict(vae_dir() / file); }

// A copy of the fixture folder `src` whose config.json went through `edit`.
fs::path edited_copy(const fs::path& src, const fs::path& dst, const std::function<void(nlohmann::json&)>& edit) {
  fs::create_directories(dst);
  std::ifstream in(src / "config.json");
  auto j = nlohmann::json::parse(in);
  edit(j);
  std::ofstream(dst / "config.json") << j.dump(1);
  fs::copy_file(src / "diffusion_pytorch_model.safetensors", dst / "diffusion_pytorch_model.safetensors",
                fs::copy_options::overwrite_existing);
  return dst;
}

double psnr(const at::Tensor& image, const at::Tensor& reference) {
  // Both in [-1, 1]; PSNR over [0, 1] pixel values, the image clamped as it would be saved.
  const auto mse = ((image.clamp(-1, 1) - reference) / 2).pow(2).mean().item<double>();
  return 10.0 * std::log10(1.0 / mse);
}

// Compares and logs the difference, so the measured figures quoted above can be re-read.
#define COMPARE_LOGGED(what, a, b, atol)                                                            \
  do {                                                                                              \
    const at::Tensor _x = (a), _y = (b);                                                            \
    qInfo("%s: max |diff| %g (max |value| %g)", std::string(what).c_str(), test::max_abs_diff(_x, _y), \
          _y.abs().max().item<double>());                                                           \
    DIFFRACT_COMPARE_TENSORS(_x, _y, atol);                                                         \
  } while (0)

void check_kl(const std::string& name, models::AutoencoderKL& vae, const io::StateDict& e) {
  at::NoGradGuard no_grad;
  const auto dist = vae->encode(e.at(name + ".images"));
  COMPARE_LOGGED(name + ".mean", dist.mean, e.at(name + ".mean"), kKLAtol);
  COMPARE_LOGGED(name + ".logvar", dist.logvar, e.at(name + ".logvar"), kKLAtol);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  COMPARE_LOGGED(name + ".sample", dist.sample(gen), e.at(name + ".sample"), kKLAtol);
  QVERIFY(at::equal(dist.mode(), dist.mean));
  COMPARE_LOGGED(name + ".decoded_mean", vae->decode(e.at(name + ".mean")), e.at(name + ".decoded_mean"), kKLAtol);
  COMPARE_LOGGED(name + ".decoded_z", vae->decode(e.at(name + ".z")), e.at(name + ".decoded_z"), kKLAtol);
}

}  // namespace

class TestAutoencoders : public QObject {
  Q_OBJECT
 private slots:
  void initTestCase() { at::manual_seed(0); }

  // --- AutoencoderKL ---------------------------------------------------------------------------

  void klSdLayoutMatchesDiffusers() {
    auto vae = models::load_autoencoder_kl(vae_dir() / "kl-sd");
    QCOMPARE(vae->config.scaling_factor, 0.13025);
    QVERIFY(!vae->config.shift_factor);
    QVERIFY(vae->config.force_upcast);
    QVERIFY(!vae->quant_conv.is_empty() && !vae->post_quant_conv.is_empty());
    QVERIFY(!vae->decoder->mid_block->attentions.is_empty());
    QCOMPARE(vae->config.downscale_factor(), int64_t(8));
    check_kl("sd", vae, cases("kl_cases.safetensors"));
  }

  void klFluxLayoutMatchesDiffusers() {
    auto vae = models::load_autoencoder_kl(vae_dir() / "kl-flux");
    QCOMPARE(vae->config.latent_channels, int64_t(16));
    QVERIFY(vae->config.shift_factor && *vae->config.shift_factor == 0.0609);
    QVERIFY(vae->quant_conv.is_empty() && vae->post_quant_conv.is_empty());
    QVERIFY(vae->encoder->mid_block->attentions.is_empty());
    check_kl("flux", vae, cases("kl_cases.safetensors"));
  }

  void klScalesLatents() {
    auto vae = models::load_autoencoder_kl(vae_dir() / "kl-flux");
    const auto z = at::randn({1, 16, 4, 4});
    DIFFRACT_COMPARE_TENSORS(vae->scale_latents(z), (z - 0.0609) * 1.5305, 1e-6);
    DIFFRACT_COMPARE_TENSORS(vae->unscale_latents(vae->scale_latents(z)), z, 1e-5);
    vae->config = models::AutoencoderKLConfig::sdxl();  // shift null: scaling only
    DIFFRACT_COMPARE_TENSORS(vae->scale_latents(z), z * 0.13025, 1e-6);
  }

  // Tiles whose decodes disagree by a constant (as per-tile GroupNorm statistics make them):
  // hard-cut tiles leave a step of that size where they meet; cross-faded ones spread it over
  // the overlap, so no step in the image is larger than a ramp's share of it.
  void tiledDecodeCrossFadesTileDifferences() {
    const auto z = at::upsample_bilinear2d(at::randn({1, 3, 4, 4}), {40, 40}, false) * 0.05;  // smooth, small steps
    int calls = 0;
    auto offset_decode = [&calls](const at::Tensor& t) {
      return at::upsample_nearest2d(t, {t.size(2) * 8, t.size(3) * 8}) + 0.5 * (calls++ % 2);  // tiles differ by 0.5
    };
    auto max_step = [](const at::Tensor& x) {
      const auto dx = (x.narrow(3, 1, x.size(3) - 1) - x.narrow(3, 0, x.size(3) - 1)).abs().max();
      const auto dy = (x.narrow(2, 1, x.size(2) - 1) - x.narrow(2, 0, x.size(2) - 1)).abs().max();
      return std::max(dx.item<double>(), dy.item<double>());
    };
    const auto hard = models::decode_in_tiles(z, 16, 0, 8, offset_decode);
    calls = 0;
    const auto blended = models::decode_in_tiles(z, 16, 8, 8, offset_decode);
    QCOMPARE(blended.sizes(), (at::IntArrayRef{1, 3, 320, 320}));
    qInfo("largest step between neighbouring pixels: hard-cut %g, cross-faded %g", max_step(hard), max_step(blended));
    QVERIFY(max_step(hard) > 0.45);       // the 0.5 disagreement shows
    QVERIFY(max_step(blended) < 0.05);    // spread over a 64-pixel ramp: ~0.5 / 65 plus the content's own steps
    DIFFRACT_EXPECT_ERROR(models::decode_in_tiles(z, 16, 16, 8, offset_decode), "overlap in [0, tile)");
  }

  void klTiledDecode() {
    auto vae = models::load_autoencoder_kl(vae_dir() / "kl-sd");
    const auto z = at::upsample_bilinear2d(at::randn({1, 4, 6, 6}), {40, 40}, false);
    const auto full = vae->decode(z);
    const auto tiled = vae->decode_tiled(z, 16, 8);
    QCOMPARE(tiled.sizes(), full.sizes());
    QVERIFY(at::isfinite(tiled).all().item<bool>());
    // Within one tile it is plain decode().
    const auto small = z.narrow(2, 0, 16).narrow(3, 0, 16);
    DIFFRACT_COMPARE_TENSORS(vae->decode_tiled(small, 16, 8), vae->decode(small), 0.0);
  }

  void klHalfPrecisionDecodesInFp32() {
    at::NoGradGuard no_grad;
    const auto e = cases("kl_cases.safetensors");
    auto vae = models::load_autoencoder_kl(vae_dir() / "kl-sd");
    QVERIFY(!vae->upcasts());
    vae->to(at::kHalf);
    QVERIFY(vae->upcasts());  // fp16 and force_upcast
    const auto images = vae->decode(e.at("sd.z"));
    QCOMPARE(images.scalar_type(), at::kFloat);
    // The fp32 copy holds the fp16-rounded weights: close to the fp32 reference, not equal.
    COMPARE_LOGGED("fp16 sd.decoded_z", images, e.at("sd.decoded_z"), 0.02);  // measured 3.3e-3
    const auto dist = vae->encode(e.at("sd.images"));
    QCOMPARE(dist.mean.scalar_type(), at::kFloat);
    COMPARE_LOGGED("fp16 sd.mean", dist.mean, e.at("sd.mean"), 0.01);  // measured 1.6e-3
    QCOMPARE(vae->decoder->conv_in->weight.scalar_type(), at::kHalf);  // the module itself stays fp16
    vae->release_fp32_copies();
    vae->config.force_upcast = false;
    QVERIFY(!vae->upcasts());
    vae->config.force_upcast = true;
    vae->to(at::kBFloat16);
    QVERIFY(!vae->upcasts());  // bf16 has fp32's range
  }

  void klPresets() {
    const auto sd = models::AutoencoderKLConfig::sd();
    QCOMPARE(sd.block_out_channels, (std::vector<int64_t>{128, 256, 512, 512}));
    QCOMPARE(sd.scaling_factor, 0.18215);
    QVERIFY(sd.use_quant_conv && !sd.shift_factor);
    const auto xl = models::AutoencoderKLConfig::sdxl();
    QCOMPARE(xl.scaling_factor, 0.13025);
    QVERIFY(xl.force_upcast);
    const auto sd3 = models::AutoencoderKLConfig::sd3();
    QCOMPARE(sd3.latent_channels, int64_t(16));
    QCOMPARE(sd3.scaling_factor, 1.5305);
    QCOMPARE(*sd3.shift_factor, 0.0609);
    QVERIFY(!sd3.use_quant_conv && !sd3.use_post_quant_conv);
    const auto flux = models::AutoencoderKLConfig::flux();
    QCOMPARE(flux.latent_channels, int64_t(16));
    QCOMPARE(flux.scaling_factor, 0.3611);
    QCOMPARE(*flux.shift_factor, 0.1159);
    // The presets build the published layouts (parameter counts of the SD / FLUX.1 VAEs).
    auto count = [](const models::AutoencoderKLConfig& c) {
      int64_t n = 0;
      for (const auto& p : models::AutoencoderKL(c)->parameters()) n += p.numel();
      return n;
    };
    QCOMPARE(count(sd), int64_t(83653863));
    QCOMPARE(count(flux), int64_t(83819683));
  }

  // --- TAESD -----------------------------------------------------------------------------------

  void tinyConfigsMatchDiffusers() {
    at::NoGradGuard no_grad;
    const auto e = cases("tiny_cases.safetensors");
    for (const char* name : {"tiny4", "tiny16"}) {
      auto tae = models::load_taesd(vae_dir() / name);
      QVERIFY(tae->has_encoder() && tae->has_decoder());
      QVERIFY(!tae->config.midblock_group_norm);
      const std::string n = name;
      COMPARE_LOGGED(n + ".latents", tae->encode(e.at(n + ".images")), e.at(n + ".latents"), kTinyAtol);
      COMPARE_LOGGED(n + ".decoded_z", tae->decode(e.at(n + ".z")), e.at(n + ".decoded_z"), kTinyAtol);
      COMPARE_LOGGED(n + ".decoded_latents", tae->decode(e.at(n + ".latents")), e.at(n + ".decoded_latents"), kTinyAtol);
    }
    QCOMPARE(models::load_taesd(vae_dir() / "tiny4")->config.variant, std::string("taesd"));
    QCOMPARE(models::load_taesd(vae_dir() / "tiny16")->config.variant, std::string(""));  // custom widths
  }

  void originalPthFilesLoad() {
    at::NoGradGuard no_grad;
    const auto e = cases("tiny_cases.safetensors");
    auto pair = models::load_taesd(vae_dir() / "tiny4-pth");
    QCOMPARE(pair->config.variant, std::string("taesd"));
    QCOMPARE(pair->config.latent_channels, int64_t(4));
    DIFFRACT_COMPARE_TENSORS(pair->encode(e.at("tiny4.images")), e.at("tiny4.latents"), kTinyAtol);
    DIFFRACT_COMPARE_TENSORS(pair->decode(e.at("tiny4.z")), e.at("tiny4.decoded_z"), kTinyAtol);

    auto decoder_only = models::load_taesd(vae_dir() / "tiny4-pth" / "taesd_decoder.pth");
    QVERIFY(!decoder_only->has_encoder() && decoder_only->has_decoder());
    DIFFRACT_COMPARE_TENSORS(decoder_only->decode(e.at("tiny4.z")), e.at("tiny4.decoded_z"), kTinyAtol);
    auto encoder_only = models::load_taesd(vae_dir() / "tiny4-pth" / "taesd_encoder.pth");
    QVERIFY(encoder_only->has_encoder() && !encoder_only->has_decoder());
    DIFFRACT_COMPARE_TENSORS(encoder_only->encode(e.at("tiny4.images")), e.at("tiny4.latents"), kTinyAtol);
  }

  void taef2RealWeightsMatchReference() {
    at::NoGradGuard no_grad;
    const auto e = cases("taef2_cases.safetensors");
    auto tae = models::load_taesd(test::shared_dir() / "data" / "taesd");
    QCOMPARE(tae->config.variant, std::string("taef2"));
    QCOMPARE(tae->config.latent_channels, int64_t(32));
    QVERIFY(tae->config.midblock_group_norm);
    const auto& photo = e.at("photo");
    const auto latents = tae->encode(photo);
    COMPARE_LOGGED("taef2 latents", latents, e.at("latents"), kTaef2Atol);
    COMPARE_LOGGED("taef2 decoded", tae->decode(e.at("latents")), e.at("decoded"), kTaef2Atol);
    COMPARE_LOGGED("taef2 decoded_z", tae->decode(e.at("z")), e.at("decoded_z"), kTaef2Atol);

    const double ours = psnr(tae->decode(latents), photo);
    qInfo("TAEF2 round trip of astronaut.png: %.2f dB (Python reference %.2f dB)", ours, e.at("psnr").item<double>());
    QVERIFY2(ours > kTaef2MinPsnr, qPrintable(QString("PSNR %1 dB").arg(ours)));

    // The decoder file alone: what previews load.
    auto preview = models::load_taesd(test::shared_dir() / "data" / "taesd" / "taef2_decoder.pth");
    QCOMPARE(preview->config.variant, std::string("taef2"));
    QVERIFY(!preview->has_encoder());
    DIFFRACT_COMPARE_TENSORS(preview->decode(e.at("z")), e.at("decoded_z"), kTaef2Atol);
  }

  void taesdPresets() {
    QCOMPARE(models::TAESDConfig::taesd().latent_channels, int64_t(4));
    QCOMPARE(models::TAESDConfig::taesdxl().latent_channels, int64_t(4));
    QCOMPARE(models::TAESDConfig::taesd3().latent_channels, int64_t(16));
    QCOMPARE(models::TAESDConfig::taef1().latent_channels, int64_t(16));
    QCOMPARE(models::TAESDConfig::taef2().latent_channels, int64_t(32));
    QVERIFY(models::TAESDConfig::taef2().midblock_group_norm && !models::TAESDConfig::taef1().midblock_group_norm);
    QCOMPARE(models::TAESDConfig::taesd().downscale_factor(), int64_t(8));
  }

  // --- bad inputs ------------------------------------------------------------------------------

  void rejectsBadInputs() {
    at::NoGradGuard no_grad;
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    const auto kl = vae_dir() / "kl-sd";

    auto a = edited_copy(kl, dir / "a", [](auto& j) { j.erase("latent_channels"); });
    DIFFRACT_EXPECT_ERROR(models::load_autoencoder_kl(a), "config.json", "missing key 'latent_channels'");
    auto b = edited_copy(kl, dir / "b", [](auto& j) { j["down_block_types"][1] = "AttnDownEncoderBlock2D"; });
    DIFFRACT_EXPECT_ERROR(models::load_autoencoder_kl(b), "config.json",
                          "down_block_types[1] 'AttnDownEncoderBlock2D' is not supported");
    auto c = edited_copy(kl, dir / "c", [](auto& j) { j["up_block_types"] = {"UpDecoderBlock2D"}; });
    DIFFRACT_EXPECT_ERROR(models::load_autoencoder_kl(c), "'up_block_types' has 1 entries");
    auto d = edited_copy(kl, dir / "d", [](auto& j) { j["use_quant_conv"] = false; });
    DIFFRACT_EXPECT_ERROR(models::load_autoencoder_kl(d), "diffusion_pytorch_model.safetensors", "unexpected keys (2)",
                          "quant_conv.weight");
    auto t = edited_copy(vae_dir() / "tiny16", dir / "t", [](auto& j) { j.erase("num_encoder_blocks"); });
    DIFFRACT_EXPECT_ERROR(models::load_taesd(t), "config.json", "missing key 'num_encoder_blocks'");
    auto u = edited_copy(vae_dir() / "tiny16", dir / "u", [](auto& j) { j["act_fn"] = "gelu"; });
    DIFFRACT_EXPECT_ERROR(models::load_taesd(u), "act_fn 'gelu' is not supported");

    auto vae = models::load_autoencoder_kl(kl);
    DIFFRACT_EXPECT_ERROR(vae->encode(at::zeros({1, 3, 36, 40})), "image size 36x40 is not a multiple of 8");
    DIFFRACT_EXPECT_ERROR(vae->encode(at::zeros({1, 4, 32, 32})), "expects images [B, 3, H, W], got [1, 4, 32, 32]");
    DIFFRACT_EXPECT_ERROR(vae->decode(at::zeros({1, 16, 4, 4})), "expects latents [B, 4, h, w], got [1, 16, 4, 4]");

    auto preview = models::load_taesd(vae_dir() / "tiny4-pth" / "taesd_decoder.pth");
    DIFFRACT_EXPECT_ERROR(preview->encode(at::zeros({1, 3, 32, 32})), "taesd_decoder.pth", "has no encoder");
    auto tae = models::load_taesd(vae_dir() / "tiny4");
    DIFFRACT_EXPECT_ERROR(tae->encode(at::zeros({1, 3, 60, 64})), "image size 60x64 is not a multiple of 8");
    DIFFRACT_EXPECT_ERROR(tae->decode(at::zeros({1, 16, 4, 4})), "decode expects latents [B, 4, h, w], got [1, 16, 4, 4]");
    DIFFRACT_EXPECT_ERROR(models::load_taesd(vae_dir() / "taesd-bad" / "taesd_decoder.pth"), "taesd_decoder.pth",
                          "match no TAESD variant", "8 latent channels");
    DIFFRACT_EXPECT_ERROR(models::load_taesd(vae_dir() / "taesd-bad"), "match no TAESD variant");

    fs::create_directories(dir / "empty");
    DIFFRACT_EXPECT_ERROR(models::load_taesd(dir / "empty"), "neither a diffusers folder");
    fs::create_directories(dir / "two");
    for (const char* f : {"taesd_decoder.pth", "taesdxl_decoder.pth"})
      fs::copy_file(vae_dir() / "tiny4-pth" / "taesd_decoder.pth", dir / "two" / f);
    DIFFRACT_EXPECT_ERROR(models::load_taesd(dir / "two"), "several TAESD models (taesd, taesdxl)");
    DIFFRACT_EXPECT_ERROR(models::load_taesd(dir / "missing.pth"), "no such file or folder");
  }
};

QTEST_GUILESS_MAIN(TestAutoencoders)
#include "test_autoencoders.moc"
