// diffract-train: trains the embedded emoji text-to-image model (UNet + CLIP text encoder on
// TAEF2 latents of scenes composed from the emoji atlas), makes the hold-out list, evaluates.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <numeric>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/io/image.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/training/scenes.h"
#include "core/training/trainer.h"
#include "core/util/error.h"
#include "core/util/log.h"

using namespace diffract;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

void require_file(const fs::path& p, const std::string& what) {
  if (!fs::exists(p)) throw Error(what + " " + p.string() + " does not exist");
}

// A picture [3, H, W] in [0, 1] as 8-bit RGB.
io::Image to_image(const at::Tensor& chw) {
  auto hwc = chw.mul(255).round().clamp(0, 255).to(at::kByte).permute({1, 2, 0}).contiguous();
  io::Image out;
  out.width = static_cast<int>(hwc.size(1));
  out.height = static_cast<int>(hwc.size(0));
  out.rgb.assign(hwc.data_ptr<std::uint8_t>(), hwc.data_ptr<std::uint8_t>() + hwc.numel());
  return out;
}

// Images [3, S, S] in [0, 1] as a grid PNG, 8 a row, in order.
void write_sheet(const fs::path& path, const std::vector<at::Tensor>& cells, int64_t size) {
  const int64_t count = static_cast<int64_t>(cells.size());
  const int64_t cols = std::min<int64_t>(8, count), rows_n = (count + cols - 1) / cols, pad = 4;
  auto canvas = at::ones({3, rows_n * (size + pad) + pad, cols * (size + pad) + pad});
  for (int64_t k = 0; k < count; ++k)
    canvas.narrow(1, pad + (k / cols) * (size + pad), size).narrow(2, pad + (k % cols) * (size + pad), size)
        .copy_(cells[static_cast<std::size_t>(k)]);
  io::write_png(path, to_image(canvas));
}

// Held-out prompts generated with fixed seeds; each image's nearest rendered scene of the same
// setting (pixel space, over every emoji of the atlas) should show the same emoji. Besides, the
// background colour (the nearest named colour to the image's border) and the position (the valid
// position whose rendered scene of the prompt's emoji puts the foreground's centre nearest to the
// image's) are checked against the prompt's.
// --inpaint: each held-out prompt's setting is drawn with another emoji (the next in the atlas),
// the sprite's box (padded) masked, and the model repaints it from the prompt; besides the checks
// above, how much of the picture outside the mask changed (mean absolute difference, 0..1).
constexpr int64_t kInpaintPadding = 4;

json evaluate(const fs::path& model, const fs::path& atlas_dir, const fs::path& holdout_file, const fs::path& sheet,
              int steps, double cfg, int64_t limit, const std::string& device, const fs::path& lora,
              const std::string& style, bool inpaint) {
  const auto atlas = training::SpriteAtlas::load(atlas_dir);
  auto holdout = training::HoldOut::load(holdout_file, atlas);
  auto specs = holdout.specs();
  if (limit > 0 && static_cast<int64_t>(specs.size()) > limit) specs.resize(static_cast<std::size_t>(limit));
  training::SceneOptions scene_options;
  scene_options.style = style;
  training::SceneComposer composer(atlas, training::HoldOut{}, scene_options, at::Device(at::kCPU));
  auto pipe = pipeline::StableDiffusion::load(model, device);
  const int64_t n = atlas.size(), size = composer.options().image_size;
  int top1 = 0, top5 = 0, background_hits = 0, position_hits = 0;
  double unmasked_change_sum = 0;
  std::vector<at::Tensor> cells;
  json rows = json::array();
  double gen_seconds = 0;
  for (std::size_t k = 0; k < specs.size(); ++k) {
    const auto& spec = specs[k];
    job::GenerationRequest req;
    req.prompt = composer.full_caption(spec);
    req.steps = steps;
    req.cfg = cfg;
    req.seed = 1000 + static_cast<std::uint64_t>(k);
    req.preview_every = 0;
    req.width = req.height = static_cast<int>(size);
    req.device = device;
    if (!lora.empty()) req.loras.push_back({lora.string(), 1.0, 1.0, ""});
    at::Tensor source, mask;
    if (inpaint) {
      const training::SceneSpec other{(spec.emoji + 1) % n, spec.colour, spec.scale, spec.position};
      source = composer.render({other}, nullptr)[0];
      const auto [x, y, side] = composer.sprite_box(spec);
      const int64_t x0 = std::max<int64_t>(0, x - kInpaintPadding), y0 = std::max<int64_t>(0, y - kInpaintPadding);
      const int64_t x1 = std::min(size, x + side + kInpaintPadding), y1 = std::min(size, y + side + kInpaintPadding);
      mask = at::zeros({1, size, size});
      mask.narrow(1, y0, y1 - y0).narrow(2, x0, x1 - x0).fill_(1);
      req.input.image = to_image(source);
      req.input.mask = to_image(mask.expand({3, size, size}));
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto result = pipe->generate(req, {}, job::CancelToken{});
    gen_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto& img = result.images.front();
    auto gen = at::from_blob(const_cast<std::uint8_t*>(img.rgb.data()), {size, size, 3}, at::kByte)
                   .permute({2, 0, 1}).to(at::kFloat).div(255).unsqueeze(0);
    cells.push_back(gen.squeeze(0).clone());
    double unmasked_change = 0;
    if (inpaint) {
      const auto keep = 1 - mask;
      unmasked_change = ((gen.squeeze(0) - source).abs() * keep).sum().item<double>() / (3 * keep.sum().item<double>());
      unmasked_change_sum += unmasked_change;
    }
    std::vector<double> dist(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; i += 256) {
      std::vector<training::SceneSpec> refs;
      for (int64_t e = i; e < std::min(n, i + 256); ++e) refs.push_back({e, spec.colour, spec.scale, spec.position});
      auto d = (composer.render(refs, nullptr) - gen).pow(2).mean({1, 2, 3}).contiguous();
      std::copy(d.data_ptr<float>(), d.data_ptr<float>() + d.numel(), dist.begin() + i);
    }
    std::vector<int64_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + std::min<int64_t>(5, n), order.end(),
                      [&](int64_t a, int64_t b) { return dist[a] < dist[b]; });
    const bool hit1 = order[0] == spec.emoji;
    const bool hit5 = std::find(order.begin(), order.begin() + std::min<int64_t>(5, n), spec.emoji) !=
                      order.begin() + std::min<int64_t>(5, n);
    top1 += hit1;
    top5 += hit5;
    const auto image = gen.squeeze(0);
    const int colour = training::measured_background(image);
    const bool background_hit = colour == spec.colour;
    const int position = training::measured_position(composer, spec, image);
    const bool position_hit = position == spec.position;
    background_hits += background_hit;
    position_hits += position_hit;
    rows.push_back({{"prompt", req.prompt}, {"seed", req.seed}, {"top1", hit1}, {"top5", hit5},
                    {"nearest", atlas.sprites()[static_cast<std::size_t>(order[0])].name},
                    {"background", training::background_colours()[static_cast<std::size_t>(colour)].name},
                    {"background_right", background_hit},
                    {"position", position >= 0 ? training::position_names()[static_cast<std::size_t>(position)] : "none"},
                    {"position_right", position_hit}});
    if (inpaint) rows.back()["unmasked_change"] = unmasked_change;
    log::get("eval").info(log::str(k + 1, "/", specs.size(), " ", req.prompt, " -> ",
                                   atlas.sprites()[static_cast<std::size_t>(order[0])].name, hit1 ? " (hit)" : ""));
  }
  const int64_t count = static_cast<int64_t>(specs.size());
  if (!sheet.empty() && count > 0) write_sheet(sheet, cells, size);
  const double c = static_cast<double>(std::max<int64_t>(count, 1));
  json out = {{"model", model.string()}, {"lora", lora.string()}, {"style", style}, {"inpaint", inpaint}, {"prompts", count}, {"candidates", n}, {"steps", steps}, {"cfg", cfg},
          {"metric", "nearest rendered scene of the same setting in pixel space (MSE), over every emoji"},
          {"top1", top1 / c}, {"top5", top5 / c}, {"background_right", background_hits / c},
          {"position_right", position_hits / c},
          {"setting_metrics", "background: the named colour nearest to the median of the image's 4-pixel border; "
                              "position: the valid position whose rendered scene of the prompt's emoji centres "
                              "the foreground (pixels 0.2 from the background) nearest to the image's"},
          {"random_top1", 1.0 / static_cast<double>(n)},
          {"random_top5", std::min(5.0, static_cast<double>(n)) / static_cast<double>(n)},
          {"seconds_per_image", gen_seconds / c}, {"results", rows}};
  if (inpaint) {
    out["mask_padding"] = kInpaintPadding;
    out["unmasked_change"] = unmasked_change_sum / c;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"diffract-train: the embedded emoji model's trainer, hold-out list and evaluation"};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose);

  training::TrainConfig c;
  fs::path shared = "../shared";
  auto* train = app.add_subcommand("train", "train (or resume) and export the diffusers folder to <out>/model");
  train->add_option("--atlas", c.atlas, "diffract-dataset's atlas folder")->required();
  train->add_option("--holdout", c.holdout, "hold-out list (resources/training/holdout.tsv)")->required();
  train->add_option("--shared", shared, "folder with data/taesd/taef2_*.pth and data/clip/bpe_simple_vocab_16e6.txt.gz")
      ->capture_default_str();
  fs::path taesd, bpe;
  train->add_option("--taesd", taesd, "TAEF2 (its .pth pair or a diffusers AutoencoderTiny folder); default: --shared's");
  train->add_option("--bpe", bpe, "CLIP's bpe_simple_vocab_16e6.txt.gz; default: --shared's");
  train->add_option("--out", c.out, "run folder: loss.csv, summary.json, checkpoint/, model/ or lora.safetensors")->required();
  train->add_option("--model", c.model, "emoji or tiny")->capture_default_str();
  train->add_option("--device", c.device, "cpu or cuda:N")->capture_default_str();
  train->add_option("--autocast", c.autocast, "bf16 autocast: auto (CUDA), on, off")->capture_default_str();
  train->add_option("--batch", c.batch)->capture_default_str();
  train->add_option("--steps", c.steps, "step budget of this run (0: none)")->capture_default_str();
  train->add_option("--minutes", c.minutes, "wall-clock budget of this run (0: none)")->capture_default_str();
  train->add_option("--schedule-minutes", c.schedule_minutes, "cosine LR length over all runs (default: --minutes)");
  train->add_option("--schedule-steps", c.schedule_steps, "cosine LR length in steps (wins over minutes)");
  train->add_option("--lr", c.lr)->capture_default_str();
  train->add_option("--warmup", c.warmup)->capture_default_str();
  train->add_option("--ema", c.ema_decay)->capture_default_str();
  train->add_option("--cfg-dropout", c.cfg_dropout)->capture_default_str();
  train->add_option("--log-every", c.log_every)->capture_default_str();
  train->add_option("--atlas-limit", c.atlas_limit, "first N sprites only (0: all)")->capture_default_str();
  train->add_option("--bank-scenes", c.bank_scenes, "scenes encoded once before training (0: every combination)")
      ->capture_default_str();
  train->add_option("--seed", c.seed)->capture_default_str();
  train->add_flag("--resume", c.resume, "continue from <out>/checkpoint when there is one");
  train->add_option("--base", c.base, "start from this exported model folder instead of random weights");
  train->add_option("--lora-rank", c.lora_rank, "train only a LoRA of this rank on --base's UNet; exports <out>/lora.safetensors")
      ->capture_default_str();
  train->add_option("--style", c.style, "the scenes' style: outline (default: the emoji as drawn)");
  train->add_flag("--inpaint", c.inpaint, "fine-tune --base into an inpainting model (mask and masked-image inputs)");
  bool no_export = false;
  train->add_flag("--no-export", no_export);

  fs::path atlas_dir, holdout_out;
  int holdout_count = 64;
  std::uint64_t holdout_seed = 7;
  auto* holdout = app.add_subcommand("holdout", "write the fixed hold-out list for an atlas");
  holdout->add_option("--atlas", atlas_dir)->required();
  holdout->add_option("--out", holdout_out)->required();
  holdout->add_option("--count", holdout_count)->capture_default_str();
  holdout->add_option("--seed", holdout_seed)->capture_default_str();

  fs::path eval_model, eval_sheet, eval_holdout;
  int eval_steps = 20, eval_limit = 0;
  double eval_cfg = 5.0;
  std::string eval_device = "cpu";
  auto* eval = app.add_subcommand("eval", "generate the held-out prompts; nearest-scene top-1 / top-5 as JSON");
  eval->add_option("--model", eval_model)->required();
  eval->add_option("--atlas", atlas_dir)->required();
  eval->add_option("--holdout", eval_holdout)->required();
  eval->add_option("--sheet", eval_sheet, "contact sheet PNG (8 columns, hold-out order)");
  eval->add_option("--steps", eval_steps)->capture_default_str();
  eval->add_option("--cfg", eval_cfg)->capture_default_str();
  eval->add_option("--limit", eval_limit, "first N held-out prompts only")->capture_default_str();
  eval->add_option("--device", eval_device)->capture_default_str();
  fs::path eval_lora;
  std::string eval_style;
  eval->add_option("--lora", eval_lora, "a LoRA applied at weight 1");
  eval->add_option("--style", eval_style, "the style of the scenes compared against: outline (default: as drawn)");
  bool eval_inpaint = false;
  eval->add_flag("--inpaint", eval_inpaint, "repaint another emoji's box in each held-out setting from the prompt");

  fs::path scenes_out;
  int scenes_count = 16;
  auto* scenes = app.add_subcommand("scenes", "render training scenes as a sheet and print their captions");
  scenes->add_option("--atlas", atlas_dir)->required();
  scenes->add_option("--holdout", eval_holdout)->required();
  scenes->add_option("--out", scenes_out, "sheet PNG")->required();
  scenes->add_option("--count", scenes_count)->capture_default_str();
  scenes->add_option("--seed", holdout_seed)->capture_default_str();
  std::string scenes_style;
  scenes->add_option("--style", scenes_style, "outline (default: the emoji as drawn)");

  CLI11_PARSE(app, argc, argv);
  log::set_verbose(verbose);
  try {
    if (*train) {
      c.taesd = taesd.empty() ? shared / "data" / "taesd" : taesd;
      c.bpe = bpe.empty() ? shared / "data" / "clip" / "bpe_simple_vocab_16e6.txt.gz" : bpe;
      require_file(c.taesd, "TAEF2");
      require_file(c.bpe, "CLIP BPE vocabulary");
      c.export_model = !no_export;
      training::Trainer trainer(c);
      const auto s = trainer.train();
      std::cout << json{{"steps", s.steps}, {"run_steps", s.run_steps}, {"training_seconds", s.seconds},
                        {"images_per_second", s.images_per_second}, {"last_loss", s.last_loss},
                        {"latent_scale", s.latent_scale}}
                       .dump()
                << "\n";
    } else if (*holdout) {
      const auto atlas = training::SpriteAtlas::load(atlas_dir);
      training::HoldOut::make(atlas, holdout_count, holdout_seed).save(holdout_out, atlas);
      std::cout << "wrote " << holdout_count << " held-out combinations to " << holdout_out.string() << "\n";
    } else if (*scenes) {
      const auto atlas = training::SpriteAtlas::load(atlas_dir);
      training::SceneOptions scene_options;
      scene_options.style = scenes_style;
      training::SceneComposer composer(atlas, training::HoldOut::load(eval_holdout, atlas), scene_options,
                                       at::Device(at::kCPU));
      std::mt19937_64 rng(holdout_seed);
      const auto specs = composer.sample(scenes_count, rng);
      const auto images = composer.render(specs, &rng);
      std::vector<at::Tensor> cells;
      for (int64_t i = 0; i < images.size(0); ++i) cells.push_back(images[i]);
      write_sheet(scenes_out, cells, composer.options().image_size);
      for (const auto& s : specs) std::cout << composer.sample_caption(s, rng) << "\n";
    } else if (*eval) {
      std::cout << evaluate(eval_model, atlas_dir, eval_holdout, eval_sheet, eval_steps, eval_cfg, eval_limit, eval_device,
                            eval_lora, eval_style, eval_inpaint)
                       .dump(1)
                << "\n";
    }
  } catch (const std::exception& e) {
    log::get("train").error(e.what());
    return 1;
  }
  return 0;
}
