#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/serialize/archive.h>

#include "core/models/autoencoders/taesd.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/schedulers/sampler.h"
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
  // A model folder export_diffusers() wrote (unet/ and text_encoder/ config.json).
  static ModelConfig from_folder(const std::filesystem::path& dir);
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
  double min_snr_gamma = 5.0;       // Min-SNR loss weighting, clamp(SNR, 1, gamma) on x0 (0: plain v-MSE)
  int64_t log_every = 25;
  int64_t bank_scenes = 0;          // scenes encoded before training (0: every training combination)
  std::filesystem::path base;       // a model folder export_diffusers() wrote, to start from instead of random weights
  int64_t lora_rank = 0;            // > 0: train only a LoRA of this rank on the base's UNet (needs base)
  std::string style;                // the scenes' style (SceneOptions::style): "" or "outline"
  bool inpaint = false;             // fine-tune base into an inpainting model: its UNet also takes the mask and the
                                    // masked image's latents (diffusers' 9-channel layout: 2 x latent + 1)
  bool resume = false;
  bool export_model = true;
  std::uint64_t seed = 0;
};

// The noise schedule the model is trained with and ships in scheduler_config.json: SD's
// scaled-linear betas rescaled to zero terminal SNR (Lin et al. 2023), with v-prediction, which
// zero SNR needs. With SD's own schedule the last timestep keeps 7 % of the signal, so a model
// learns to read a scene's flat background and layout from that leak; sampling starts from noise
// without it and gave washed-out backgrounds whose colour followed the seed, not the caption.
// Inference samples trailing timesteps, so its first step is t = 999.
struct NoiseSchedule {
  static constexpr int64_t kTrainSteps = 1000;
  static constexpr double kBetaStart = 0.00085, kBetaEnd = 0.012;  // scaled_linear
  static schedulers::SchedulerConfig config();
  at::Tensor alphas_cumprod;  // [1000] float64 on CPU; the last is 0
  NoiseSchedule();
  // Keeps a float32 copy on `device` for the three below.
  void to(const at::Device& device);
  // alphas_cumprod[t] in float32 on t's device (the one given to to()); t: [B] long.
  at::Tensor alphas_at(const at::Tensor& t) const;
  // diffusers' DDPMScheduler.add_noise and get_velocity, in float32 on x0's device; t: [B] long.
  at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& t) const;
  at::Tensor velocity(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& t) const;

 private:
  // sqrt(alphas_cumprod[t]) and sqrt(1 - alphas_cumprod[t]) shaped [B, 1, 1, 1] on x0's device.
  std::pair<at::Tensor, at::Tensor> coefficients(const at::Tensor& x0, const at::Tensor& t) const;
  at::Tensor float_;  // alphas_cumprod in float32 on the device given to to()
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
  // and `timesteps` may be given for reproducible batches; an inpainting model needs `extra`, its
  // mask and masked image's latents [B, 1 + C, h, w].
  double step(const at::Tensor& latents, const at::Tensor& ids, const at::Tensor& noise = {},
              const at::Tensor& timesteps = {}, const at::Tensor& extra = {});
  // The loss without updating anything.
  double loss(const at::Tensor& latents, const at::Tensor& ids, const at::Tensor& noise, const at::Tensor& timesteps,
              const at::Tensor& extra = {});

  // The EMA weights as a diffusers StableDiffusionPipeline folder (fp16), with TAEF2 as vae.
  void export_diffusers(const std::filesystem::path& dir) const;
  // A LoRA run's EMA adapters as a diffusers / PEFT LoRA file (unet.<module>.lora_A / lora_B,
  // fp16, alpha = rank), as StableDiffusionPipeline.load_lora_weights and <lora:...> read it.
  void export_lora(const std::filesystem::path& file) const;

  models::UNet2DConditionModel& unet() { return unet_; }
  models::CLIPTextModel& text_encoder() { return text_encoder_; }
  double latent_scale() const { return latent_scale_; }
  void set_latent_scale(double s) { latent_scale_ = s; }
  const TrainConfig& config() const { return config_; }

 private:
  bool autocast_on() const;
  at::Tensor forward_loss(const at::Tensor& latents, const at::Tensor& ids, at::Tensor noise, at::Tensor timesteps,
                          const at::Tensor& extra);
  void update_ema();
  double lr_at(double progress, int64_t step) const;
  void save_checkpoint(const std::filesystem::path& dir) const;
  void load_checkpoint(const std::filesystem::path& dir);
  // What trains, by checkpoint name: the UNet's and text encoder's parameters ("unet.", "text."),
  // or a LoRA run's adapters ("lora.<module>.down" [rank, in], ".up" [out, rank]).
  std::vector<std::pair<std::string, at::Tensor>> named_trainables() const;
  std::vector<at::Tensor> parameters() const;
  void load_base(const std::filesystem::path& dir);
  void attach_lora();
  // Points each adapted layer's weight at base + up @ down for the next forward.
  void patch_lora();

  TrainConfig config_;
  ModelConfig model_config_;
  at::Device device_{at::kCPU};
  models::UNet2DConditionModel unet_{nullptr};
  models::CLIPTextModel text_encoder_{nullptr};
  struct LoraAdapter {
    std::string module;  // the UNet's module name ("down_blocks.1.attentions.0...attn1.to_q")
    models::LinearImpl* linear = nullptr;
    at::Tensor base, down, up;
  };
  std::vector<LoraAdapter> lora_;
  std::vector<at::Tensor> ema_;
  std::unique_ptr<FusedAdamW> optimizer_;
  NoiseSchedule schedule_;
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
