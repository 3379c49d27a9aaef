#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/serialize/archive.h>

#include "core/models/autoencoders/taesd.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/training/scenes.h"

namespace diffract::text {
class CLIPTokenizer;
}

namespace diffract::training {

// The denoiser and text encoder to train, sized by name: "emoji" (the shipped model) or
// "tiny" (CPU tests).
struct ModelConfig {
  models::UNet2DConditionConfig unet;
  models::CLIPTextConfig text;
  static ModelConfig preset(const std::string& name);
};

struct TrainConfig {
  std::string model = "emoji";
  std::filesystem::path atlas;      // diffract-dataset's output folder
  std::filesystem::path holdout;    // hold-out list (TSV); required for training
  std::filesystem::path taesd;      // folder with taef2_encoder.pth / taef2_decoder.pth
  std::filesystem::path bpe;        // bpe_simple_vocab_16e6.txt.gz
  std::filesystem::path out;        // run folder: loss.csv, checkpoint/, model/
  int64_t atlas_limit = 0;          // first N sprites only (0: all)
  std::string device = "cpu";
  std::string autocast = "auto";    // bf16 autocast: auto (on for CUDA), on, off
  int64_t batch = 128;
  int64_t steps = 0;                // this run's step budget (0: none)
  double minutes = 0;               // this run's wall-clock budget (0: none)
  double schedule_minutes = 0;      // LR schedule length in training minutes over all runs (0: minutes)
  int64_t schedule_steps = 0;       // or in steps (wins when set)
  double lr = 4e-4;
  double weight_decay = 0.01;
  int64_t warmup = 200;
  double min_lr_ratio = 0.1;
  double ema_decay = 0.999;
  double cfg_dropout = 0.1;
  double grad_clip = 1.0;
  double min_snr_gamma = 5.0;       // Min-SNR loss weighting (0: plain MSE)
  int64_t log_every = 25;
  int64_t bank_scenes = 0;          // scenes encoded before training (0: every training combination)
  bool resume = false;
  bool export_model = true;
  std::uint64_t seed = 0;
};

// The noise schedule the model is trained with and ships in scheduler_config.json.
struct NoiseSchedule {
  static constexpr int64_t kTrainSteps = 1000;
  static constexpr double kBetaStart = 0.00085, kBetaEnd = 0.012;  // scaled_linear
  at::Tensor alphas_cumprod;  // [1000] float64 on CPU
  NoiseSchedule();
};

struct TrainSummary {
  int64_t steps = 0;            // total over all runs
  int64_t run_steps = 0;        // this run
  double seconds = 0;           // training time over all runs
  double images_per_second = 0; // this run
  double last_loss = 0;         // mean of the last log window
  double latent_scale = 1.0;
};

// AdamW with ATen's fused kernel (CPU and CUDA): one launch for all parameters, where
// torch::optim::AdamW runs several small kernels per parameter tensor.
class FusedAdamW {
 public:
  FusedAdamW(std::vector<at::Tensor> params, double beta1, double beta2, double weight_decay, double eps = 1e-8);
  // Parameters without a gradient are left alone, as torch::optim does.
  void step(double lr);
  void zero_grad();
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, steps_;
  double beta1_, beta2_, weight_decay_, eps_;
};

// The training scenes encoded once: latents[i] (scaled, bf16, on the training device) is the
// scene specs[i], rendered with one jitter draw.
struct LatentBank {
  std::vector<SceneSpec> specs;
  at::Tensor latents;
};

// Trains the UNet and CLIP text encoder on scenes encoded by the TAEF2 encoder.
class Trainer {
 public:
  explicit Trainer(TrainConfig config);
  ~Trainer();

  // Loads data, measures the latent scale (or resumes), trains within the budgets, saves the
  // checkpoint and the loss log, exports the EMA model to <out>/model.
  TrainSummary train();

  // One optimisation step on given normalised latents and token ids; returns the loss. `noise`
  // and `timesteps` may be given for reproducible batches.
  double step(const at::Tensor& latents, const at::Tensor& ids, const at::Tensor& noise = {},
              const at::Tensor& timesteps = {});
  // The loss without updating anything.
  double loss(const at::Tensor& latents, const at::Tensor& ids, const at::Tensor& noise, const at::Tensor& timesteps);

  // The EMA weights as a diffusers StableDiffusionPipeline folder (fp16), with TAEF2 as vae.
  void export_diffusers(const std::filesystem::path& dir) const;

  models::UNet2DConditionModel& unet() { return unet_; }
  models::CLIPTextModel& text_encoder() { return text_encoder_; }
  double latent_scale() const { return latent_scale_; }
  void set_latent_scale(double s) { latent_scale_ = s; }
  const TrainConfig& config() const { return config_; }

 private:
  bool autocast_on() const;
  at::Tensor forward_loss(const at::Tensor& latents, const at::Tensor& ids, at::Tensor noise, at::Tensor timesteps);
  void update_ema();
  double lr_at(double progress, int64_t step) const;
  void save_checkpoint(const std::filesystem::path& dir) const;
  void load_checkpoint(const std::filesystem::path& dir);
  std::vector<at::Tensor> parameters() const;

  TrainConfig config_;
  ModelConfig model_config_;
  at::Device device_{at::kCPU};
  models::UNet2DConditionModel unet_{nullptr};
  models::CLIPTextModel text_encoder_{nullptr};
  std::vector<at::Tensor> ema_;
  std::unique_ptr<FusedAdamW> optimizer_;
  NoiseSchedule schedule_;
  at::Tensor alphas_cumprod_;  // on the device, float
  double latent_scale_ = 1.0;
  int64_t step_ = 0;
  double seconds_ = 0;
  std::mt19937_64 rng_;
};

// Token ids [B, 77] for captions, cached per caption.
class CaptionEncoder {
 public:
  explicit CaptionEncoder(const text::CLIPTokenizer& tokenizer);
  at::Tensor ids(const std::vector<std::string>& captions);

 private:
  const text::CLIPTokenizer& tokenizer_;
  std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace diffract::training
