// diffract-cli: the headless front end.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/engine/compare.h"
#include "core/engine/devices.h"
#include "core/engine/engine.h"
#include "core/engine/image_inputs.h"
#include "core/engine/output.h"
#include "core/engine/preset.h"
#include "core/io/diffusers_folder.h"
#include "core/io/image.h"
#include "core/io/pth.h"
#include "core/io/read_file.h"
#include "core/io/safetensors.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/parallel/registry.h"
#include "core/text/clip_tokenizer.h"
#include "core/io/tuning_store.h"
#include "core/util/build_info.h"
#include "core/util/embedded_model.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"
#include "core/util/torch_errors.h"

namespace fs = std::filesystem;
using namespace diffract;

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

text::CLIPTokenizer open_tokenizer(const fs::path& path) {
  if (fs::is_directory(path)) return text::CLIPTokenizer::from_folder(path);
  return text::CLIPTokenizer::from_openai_bpe(path);
}

int inspect(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::cout << io::DiffusersFolder::open(path).summary() << "\n";
    return 0;
  }
  // A torch.save archive is a zip ("PK"); anything else is read as safetensors, whose errors say
  // what does not fit.
  if (io::read_file_head(path, 2) == "PK") {
    const auto weights = io::load_pth(path);
    std::size_t bytes = 0;
    for (const auto& [name, t] : weights) {
      bytes += t.nbytes();
      std::cout << name << "  " << c10::toString(t.scalar_type()) << " " << t.sizes() << "\n";
    }
    std::cout << weights.size() << " tensors, " << bytes / 1e6 << " MB (a torch.save archive)\n";
    return 0;
  }
  auto archive = io::SafetensorsArchive::open(path);
  std::size_t bytes = 0;
  for (const auto& t : archive->tensors()) {
    bytes += t.nbytes;
    std::cout << t.name << "  " << io::dtype_name(t.dtype) << " [";
    for (std::size_t i = 0; i < t.shape.size(); ++i) std::cout << (i ? ", " : "") << t.shape[i];
    std::cout << "]\n";
  }
  std::cout << archive->tensors().size() << " tensors, " << bytes / 1e6 << " MB\n";
  return 0;
}

int tokenize(const fs::path& tokenizer, const std::string& prompt) {
  const auto tok = open_tokenizer(tokenizer);
  const auto t = tok.tokenize(prompt);
  for (int i = 0; i < t.length; ++i) std::cout << (i ? " " : "") << t.ids[static_cast<std::size_t>(i)];
  std::cout << "\n";
  if (t.dropped > 0)
    log::get("text").warn(log::str("prompt is ", t.dropped, " tokens over the limit of ", tok.max_length(),
                                   ": the end was cut off"));
  return 0;
}

int encode(const fs::path& model, const std::string& component, const std::string& prompt) {
  const auto log = log::get("cli");
  const auto t0 = std::chrono::steady_clock::now();
  const auto folder = io::DiffusersFolder::open(model);
  const std::string suffix = component.substr(std::string("text_encoder").size());
  const auto& tok_c = folder.require("tokenizer" + suffix);
  const auto& enc_c = folder.require(component);
  const auto tok = text::CLIPTokenizer::from_folder(tok_c.dir);
  const bool projected = enc_c.class_name == "CLIPTextModelWithProjection";
  if (!projected && enc_c.class_name != "CLIPTextModel")
    throw Error(enc_c.dir.string() + ": text encoder class '" + enc_c.class_name + "' is not supported yet");
  models::CLIPTextModel plain{nullptr};
  models::CLIPTextModelWithProjection with_proj{nullptr};
  if (projected) with_proj = models::load_clip_text_model_with_projection(enc_c.dir);
  else plain = models::load_clip_text_model(enc_c.dir);
  const double load_ms = ms_since(t0);

  const auto t1 = std::chrono::steady_clock::now();
  const auto tokens = tok.tokenize(prompt);
  const double tokenize_ms = ms_since(t1);
  if (tokens.dropped > 0)
    log.warn(log::str("prompt is ", tokens.dropped, " tokens over the limit of ", tok.max_length(),
                      ": the end was cut off"));
  auto ids = at::tensor(at::ArrayRef<int>(tokens.ids), at::kLong).unsqueeze(0);

  const auto t2 = std::chrono::steady_clock::now();
  at::NoGradGuard no_grad;
  auto out = projected ? with_proj->forward(ids, true) : plain->forward(ids, true);
  const double encode_ms = ms_since(t2);

  auto stats = [](const at::Tensor& x) {
    return "shape " + std::string(c10::str(x.sizes())) + ", mean " + std::to_string(x.mean().item<double>()) +
           ", std " + std::to_string(x.std().item<double>());
  };
  std::cout << "tokens: " << tokens.length << " of " << tok.max_length() << "\n"
            << "last_hidden_state: " << stats(out.last_hidden_state) << "\n"
            << "penultimate hidden state: " << stats(out.hidden_states[out.hidden_states.size() - 2]) << "\n"
            << "pooled: " << stats(out.pooled) << "\n";
  if (projected) std::cout << "text_embeds: " << stats(out.text_embeds) << "\n";
  std::cout << "timings: load " << load_ms << " ms, tokenize " << tokenize_ms << " ms, text encode " << encode_ms
            << " ms\n";
  return 0;
}

// --preview-size: "auto", "full" (0) or a number of pixels, 1 or more.
int parse_preview_size(const std::string& v) {
  if (v == "auto") return job::GenerationRequest::kPreviewAuto;
  if (v == "full") return 0;
  if (!v.empty() && v.size() < 6 && v.find_first_not_of("0123456789") == std::string::npos) return std::stoi(v);
  throw Error("--preview-size '" + v + "': expected auto, full or a number of pixels");
}

// --image / --mask and the options that need them.
struct ImageOptions {
  std::string image, mask, outpaint, hires;
  CLI::Option* hires_upscaler = nullptr;
  CLI::Option* hires_steps = nullptr;
  CLI::Option* strength = nullptr;
  CLI::Option* mask_blur = nullptr;
  CLI::Option* full_res = nullptr;
  CLI::Option* paste_back = nullptr;
  CLI::Option* outpaint_option = nullptr;
  CLI::Option* outpaint_fill = nullptr;
};

// --controlnet DIR ... with --control-image FILE ... (one each, in order) and per-ControlNet (or
// one for all) --control-scale / --control-start / --control-end.
struct ControlNetOptions {
  std::vector<std::string> nets, images;
  std::vector<double> scales, starts, ends;
};

void add_controlnet_options(CLI::App* cmd, ControlNetOptions& o) {
  cmd->add_option("--controlnet", o.nets, "a diffusers ControlNetModel folder or its .safetensors alone (repeatable; SD 1.x / 2.x / XL)")
      ->allow_extra_args(false);
  cmd->add_option("--control-image", o.images, "its control image (edges, depth, pose, ...): one per --controlnet")
      ->allow_extra_args(false);
  cmd->add_option("--control-scale", o.scales, "conditioning scale (default 1; one for all, or one per --controlnet)")
      ->allow_extra_args(false);
  cmd->add_option("--control-start", o.starts, "the fraction of the steps before it acts (default 0)")->allow_extra_args(false);
  cmd->add_option("--control-end", o.ends, "the fraction of the steps after which it stops (default 1)")->allow_extra_args(false);
}

// `preset` (may be empty): a preset's ControlNets, taken when no --controlnet is given; their
// images still come from --control-image, and --control-scale / -start / -end override theirs.
void apply_controlnet_options(job::GenerationRequest& req, const ControlNetOptions& o,
                              const std::vector<engine::Preset::ControlNet>& preset = {}) {
  const bool from_preset = o.nets.empty() && !preset.empty();
  const auto n = from_preset ? preset.size() : o.nets.size();
  if (o.images.size() != n)
    throw Error("--control-image: " + std::to_string(o.images.size()) + " given for " + std::to_string(n) +
                (from_preset ? " ControlNet(s) of the preset (" + preset.front().model + (n > 1 ? ", ..." : "") + ")"
                             : std::string(" --controlnet")) +
                " (one image per ControlNet, in order)");
  const auto pick = [&](const std::vector<double>& v, std::size_t i, double fallback, const char* name) {
    if (v.empty()) return fallback;
    if (v.size() != 1 && v.size() != n)
      throw Error(std::string(name) + ": give one value for all ControlNets or one per --controlnet (" + std::to_string(n) + ")");
    return v.size() == 1 ? v[0] : v[i];
  };
  for (std::size_t i = 0; i < n; ++i) {
    job::ControlNetRef c;
    c.path = from_preset ? preset[i].model : o.nets[i];
    if (from_preset && preset[i].preprocessor != "none")
      throw Error("the preset's ControlNet " + c.path + " makes its image with '" + preset[i].preprocessor +
                  "' (the GUI's preprocessor): give --control-image the preprocessed image and --controlnet " + c.path);
    auto decoded = io::read_image(o.images[i]);
    c.image = decoded.image;
    c.scale = pick(o.scales, i, from_preset ? preset[i].scale : 1.0, "--control-scale");
    c.start = pick(o.starts, i, from_preset ? preset[i].start : 0.0, "--control-start");
    c.end = pick(o.ends, i, from_preset ? preset[i].end : 1.0, "--control-end");
    req.controlnets.push_back(std::move(c));
  }
}

void add_image_options(CLI::App* cmd, job::GenerationRequest& req, ImageOptions& o) {
  cmd->add_option("--image", o.image, "init image (PNG or JPEG): image-to-image, or inpainting with --mask or its alpha");
  o.strength = cmd->add_option("--strength", req.input.strength,
                               "how much of the image is repainted, 0..1 (default 0.75; 1.0 with --mask)");
  cmd->add_option("--mask", o.mask, "inpainting mask (white = repaint), resized to the image when it differs");
  o.mask_blur = cmd->add_option("--mask-blur", req.input.mask_blur, "blur the mask's edge by PX pixels (default 0)");
  o.full_res = cmd->add_option("--inpaint-full-res", req.input.full_res_padding,
                               "inpaint the mask's region, padded by PAD pixels, at the job's size, and paste it back");
  o.paste_back = cmd->add_flag("--paste-back", req.input.paste_back,
                               "put the original's unmasked pixels back over the result");
  o.outpaint_option = cmd->add_option("--outpaint", o.outpaint,
                                      "extend the canvas by LEFT,TOP,RIGHT,BOTTOM pixels and paint the new area");
  o.outpaint_fill = cmd->add_option("--outpaint-fill", req.input.outpaint_fill,
                                    "what the new area starts from: edge (its pixels repeated) or blur")
                        ->capture_default_str();
  cmd->add_option("--hires", o.hires, "hires fix: upscale by SCALE (above 1, at most 4) and denoise again from "
                                      "STRENGTH (default 0.5), in one job");
  o.hires_upscaler = cmd->add_option("--hires-upscaler", req.hires.upscaler,
                                     "latent (bicubic on the latents) or lanczos (in pixels)")
                         ->capture_default_str();
  o.hires_steps = cmd->add_option("--hires-steps", req.hires.steps, "the second pass's steps (default: --steps)");
}

// "SCALE[:STRENGTH]".
void parse_hires(const std::string& text, job::HiresFix& h) {
  const auto colon = text.find(':');
  const auto number = [&](const std::string& s, const char* what) {
    std::size_t used = 0;
    double v = 0;
    try {
      v = std::stod(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (s.empty() || used != s.size() || !std::isfinite(v))
      throw Error("--hires '" + text + "': " + what + " is not a number (expected SCALE[:STRENGTH], e.g. 1.5:0.5)");
    return v;
  };
  h.scale = number(text.substr(0, colon), "the scale");
  if (colon != std::string::npos) h.strength = number(text.substr(colon + 1), "the strength");
  if (!(h.scale > 1.0 && h.scale <= 4.0)) throw Error("--hires '" + text + "': the scale must be above 1, at most 4");
  if (!(h.strength >= 0.0 && h.strength <= 1.0)) throw Error("--hires '" + text + "': the strength must be from 0 to 1");
}

// "LEFT,TOP,RIGHT,BOTTOM": four whole numbers of pixels, 0..4096 each, not all 0.
void parse_outpaint(const std::string& text, job::ImageInputs& in) {
  std::vector<int> v;
  std::size_t start = 0;
  while (start <= text.size() && v.size() < 5) {
    const auto comma = text.find(',', start);
    const std::string part = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (part.empty() || part.size() > 4 || part.find_first_not_of("0123456789") != std::string::npos)
      throw Error("--outpaint '" + text + "': expected LEFT,TOP,RIGHT,BOTTOM in whole pixels, e.g. 0,0,256,0");
    v.push_back(std::stoi(part));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (v.size() != 4) throw Error("--outpaint '" + text + "': expected four numbers, LEFT,TOP,RIGHT,BOTTOM");
  for (const int x : v)
    if (x > 4096) throw Error("--outpaint '" + text + "': each margin must be 4096 pixels or fewer");
  if (v[0] + v[1] + v[2] + v[3] == 0) throw Error("--outpaint '" + text + "': every margin is 0");
  in.outpaint_left = v[0];
  in.outpaint_top = v[1];
  in.outpaint_right = v[2];
  in.outpaint_bottom = v[3];
}

void apply_image_options(job::GenerationRequest& req, const ImageOptions& o) {
  if (!o.hires.empty()) parse_hires(o.hires, req.hires);
  for (const auto* opt : {o.hires_upscaler, o.hires_steps})
    if (opt->count() > 0 && o.hires.empty()) throw Error(opt->get_name() + " needs --hires");
  if (o.image.empty()) {
    for (const auto* opt : {o.strength, o.mask_blur, o.full_res, o.paste_back, o.outpaint_option, o.outpaint_fill})
      if (opt->count() > 0) throw Error(opt->get_name() + " needs --image");
    if (!o.mask.empty()) throw Error("--mask needs --image (the picture to inpaint)");
    return;
  }
  if (o.strength->count() > 0 && !(req.input.strength >= 0.0 && req.input.strength <= 1.0))
    throw Error("--strength " + std::to_string(req.input.strength) + ": must be from 0 to 1");
  if (req.input.mask_blur < 0 || req.input.mask_blur > 256) throw Error("--mask-blur must be 0..256 pixels");
  if (o.full_res->count() > 0 && (req.input.full_res_padding < 0 || req.input.full_res_padding > 4096))
    throw Error("--inpaint-full-res must be 0..4096 pixels of padding");
  if (!o.outpaint.empty()) parse_outpaint(o.outpaint, req.input);
  if (o.outpaint_fill->count() > 0 && o.outpaint.empty()) throw Error("--outpaint-fill needs --outpaint");
  for (const auto& note : engine::load_image_inputs(req.input, o.image, o.mask)) log::get("cli").info(note);
  for (const auto* opt : {o.mask_blur, o.full_res, o.paste_back})
    if (opt->count() > 0 && !req.input.has_mask() && !req.input.outpaints())
      throw Error(opt->get_name() + " needs a mask (--mask, or an image with transparency)");
}

int generate(const job::GenerationRequest& request, const fs::path& out, const std::string& preview_dir) {
  if (out.extension() != ".png") throw Error("--out " + out.string() + ": the output must be a .png file");
  if (!out.parent_path().empty() && !fs::is_directory(out.parent_path()))
    throw Error("--out " + out.string() + ": folder " + out.parent_path().string() + " does not exist");
  if (!preview_dir.empty()) fs::create_directories(preview_dir);
  job::JobObserver observer;
  observer.on_step = [](const job::StepEvent& e) {
    std::cerr << "\rstep " << e.index + 1 << "/" << e.total << " (" << static_cast<int>(e.step_ms) << " ms)" << std::flush;
  };
  if (!preview_dir.empty())
    observer.on_preview = [&](const job::PreviewEvent& e) {
      char name[32];
      std::snprintf(name, sizeof name, "step_%03d.png", e.index + 1);
      io::write_png(fs::path(preview_dir) / name, e.image);
    };
  engine::Engine eng;
  job::CancelToken never;
  auto request_with_previews = request;
  if (preview_dir.empty()) request_with_previews.preview_every = 0;
  const auto result = eng.run(request_with_previews, observer, never);
  std::cerr << "\n";
  const int n = static_cast<int>(result.images.size());
  for (int i = 0; i < n; ++i) {
    const auto path = engine::batch_file(out, i, n);
    const auto text = engine::batch_image_text(result.a1111_parameters, result.metadata_json, i, n);
    engine::save_image(path, result.images[static_cast<std::size_t>(i)], text.parameters, text.metadata_json);
    std::cout << "wrote " << path.string() << "\n";
  }
  const auto& t = result.timings;
  double steps = 0;
  for (double s : t.step_ms) steps += s;
  double previews = 0;
  for (double s : t.preview_ms) previews += s;
  std::cout << "timings (ms): load " << t.load_ms << ", tokenize " << t.tokenize_ms << ", text encode "
            << t.text_encode_ms << ", denoise " << steps << " (" << t.step_ms.size() << " steps, "
            << (t.step_ms.empty() ? 0 : steps / t.step_ms.size()) << " per step), previews " << previews
            << ", VAE decode " << t.vae_decode_ms << ", total " << t.total_ms << "\n";
  return 0;
}

// The registry's strategies, one line each, for --help.
std::string strategy_help() {
  std::string out = "Strategies (--strategy):\n";
  for (const auto& s : parallel::strategies()) {
    out += "  " + std::string(s.name) + std::string(s.name.size() < 26 ? 26 - s.name.size() : 1, ' ') +
           std::string(s.hint) + " [" + s.devices.describe() + (s.exact ? "" : ", approximate") +
           (s.needs_cfg ? ", needs CFG" : "") + (!s.unet ? ", SD3 / Flux only" : !s.transformer ? ", SD / SDXL only" : "") +
           "]\n";
  }
  return out;
}

// What the command line says about a job's strategy and devices, applied by apply_devices().
struct DeviceOptions {
  int devices = 0;  // --devices (0: not given)
  int skip = 0;     // --skip (0: not given)
  std::vector<int> gpus;
};

// The GPUs a job may use: --gpus, else every GPU from --device's on; none on the CPU.
std::vector<int> enabled_gpus(const std::string& device, std::vector<int> gpus) {
  const bool cuda = device.rfind("cuda", 0) == 0;
  if (cuda && gpus.empty()) {
    const int first = device == "cuda" ? 0 : std::stoi(device.substr(5));
    for (const auto& g : engine::list_devices())
      if (g.index >= first) gpus.push_back(g.index);
    if (gpus.empty()) throw Error("device '" + device + "': no such CUDA device");
  } else if (!cuda && !gpus.empty()) {
    throw Error("--gpus lists GPUs but --device is " + device);
  }
  return gpus;
}

// The same rule as the GUI's (engine::choose_devices): the GPUs are --gpus, else every GPU from
// --device's on; the strategy takes its fixed count or --devices of them (or, without --devices,
// as many as its rule allows).
void apply_devices(job::GenerationRequest& req, const DeviceOptions& d) {
  const auto& info = parallel::strategy_info(req.strategy.name);
  if (req.strategy.single()) req.strategy.name = std::string(info.name);
  if (info.takes(parallel::Param::Skip)) {
    req.strategy.skip = d.skip > 0 ? d.skip : d.devices > 1 ? d.devices : req.strategy.skip;
    if (d.skip == 0 && d.devices > 1)
      log::get("cli").warn(log::str(info.name, " runs on one device: --devices ", d.devices,
                                    " taken as its skip factor (say --skip ", d.devices, ")"));
  } else if (d.skip > 0) {
    throw Error("--skip applies to step-skip and deepcache, not to " + req.strategy.display_name());
  } else if (d.devices > 0 && info.devices.fixed > 0 && d.devices != info.devices.fixed) {
    throw Error("--devices " + std::to_string(d.devices) + ": " + std::string(info.name) + " runs on " +
                info.devices.describe());
  }
  if (req.strategy.single() && d.devices <= 1 && d.gpus.empty()) return;
  const std::vector<int> enabled = enabled_gpus(req.device, d.gpus);
  const bool cuda = req.device.rfind("cuda", 0) == 0;
  const int count = info.takes(parallel::Param::Skip) ? 1 : d.devices > 0 ? d.devices : req.strategy.devices;
  const auto c = engine::choose_devices(enabled, std::string(info.name), count, cuda ? (d.devices > 0 ? count : 0) : 0);
  if (!c.error.empty()) throw Error(c.error);
  req.device = c.device;
  req.strategy.devices = c.devices;
  req.gpus = c.gpus;
}

std::vector<int> parse_gpus(const std::string& list) {
  std::vector<int> out;
  if (list.empty()) return out;
  std::size_t from = 0;
  while (from <= list.size()) {
    const auto comma = list.find(',', from);
    const auto item = list.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
    if (item.empty() || item.size() > 3 || item.find_first_not_of("0123456789") != std::string::npos)
      throw Error("--gpus '" + list.substr(0, 80) + "': expected GPU indices separated by commas, e.g. 0,2");
    out.push_back(std::stoi(item));
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
  return out;
}

// "FILE[:WEIGHT]": the weight after the last colon (when what follows it is no path).
job::LoraRef parse_lora(const std::string& text) {
  job::LoraRef ref;
  ref.path = text;
  const auto colon = text.rfind(':');
  if (colon != std::string::npos && text.find('/', colon) == std::string::npos) {
    const auto w = text.substr(colon + 1);
    std::size_t used = 0;
    double v = 0;
    try {
      v = std::stod(w, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (w.empty() || used != w.size() || !std::isfinite(v))
      throw Error("--lora '" + text + "': the weight '" + w + "' is not a number (expected FILE[:WEIGHT], e.g. style.safetensors:0.8)");
    ref.path = text.substr(0, colon);
    ref.weight = ref.text_encoder_weight = v;
  }
  if (ref.path.empty()) throw Error("--lora '" + text + "': no file given");
  return ref;
}

void add_generation_options(CLI::App* cmd, job::GenerationRequest& req, bool with_strategy = true) {
  cmd->add_option("--model", req.model,
                  "diffusers folder (SD 1.x / 2.x / XL, SD3, Flux.1) or single-file checkpoint (default: the embedded diffract-emoji model)");
  cmd->add_option("--config", req.model_config, "single files: diffusers folder describing the components");
  cmd->add_option("--prompt", req.prompt, "text")->required();
  cmd->add_option("--negative", req.negative_prompt, "negative prompt");
  cmd->add_option("--steps", req.steps, "denoising steps")->capture_default_str();
  cmd->add_option("--cfg", req.cfg, "classifier-free guidance scale (<= 1: off)")->capture_default_str();
  cmd->add_option("--guidance", req.guidance, "Flux.1-dev: distilled guidance the transformer embeds (others ignore it)")
      ->capture_default_str();
  cmd->add_option("--seed", req.seed, "noise seed")->capture_default_str();
  cmd->add_option("--width", req.width, "pixels (default: the model's native size)");
  cmd->add_option("--height", req.height, "pixels (default: the model's native size)");
  cmd->add_option("--scheduler", req.sampler,
                  "euler, euler-ancestral, ddim, ddpm, dpmpp-2m, dpmpp-2m-karras; flow-euler for SD3 (default: the model's own)");
  cmd->add_option("--device", req.device, "cpu or cuda:N")->capture_default_str();
  cmd->add_option("--taesd", req.taesd, "TAESD for previews (folder or .pth pair)");
  cmd->add_option("--batch", req.batch, "images per prompt")->capture_default_str();
  cmd->add_flag("--no-t5", req.drop_t5, "SD3: run without the T5 encoder (its part of the prompt embedding zeros)");
  cmd->add_option("--precision", req.precision,
                  "the denoiser's linear layers: bf16 (default: the model's dtype) or fp8 (e4m3 where faster, sm_89+ "
                  "GPUs; on the CPU emulated, for its rounding)")
      ->check(CLI::IsMember({"bf16", "fp8"}));
  cmd->add_option("--t5", req.t5_placement,
                  "Flux: where T5-XXL lives: cpu (runs there), cuda:N (another GPU), offload (host memory between "
                  "prompts, the model's GPU to encode); default: with the model");
  cmd->add_option_function<std::string>(
         "--prompt-syntax",
         [&req](const std::string& v) {
           if (v != "a1111" && v != "plain")
             throw CLI::ValidationError("--prompt-syntax", "'" + v + "': expected a1111 (weights, BREAK, long prompts) or plain (diffusers')");
           req.prompt_syntax = v == "plain" ? job::PromptSyntax::Plain : job::PromptSyntax::A1111;
         },
         "a1111 (default): (word:1.2), [word], BREAK, prompts over 75 tokens in chunks, <lora:NAME:W>; "
         "plain: the text as written, cut at 77 tokens (diffusers')");
  cmd->add_option_function<std::vector<std::string>>(
         "--lora",
         [&req](const std::vector<std::string>& v) {
           try {
             for (const auto& x : v) req.loras.push_back(parse_lora(x));
           } catch (const Error& e) {
             throw CLI::ValidationError("--lora", e.what());  // parse errors are CLI11's to print
           }
         },
         "LoRA / LyCORIS file FILE[:WEIGHT] (repeatable; weight 1 by default)")
      ->allow_extra_args(false);
  cmd->add_option("--lora-dir", req.lora_dirs, "folder where <lora:NAME> in the prompt is looked up (repeatable)");
  cmd->add_flag("--lora-lenient", req.lora_lenient, "apply a LoRA whose some layers match nothing (warn instead of failing)");
  if (with_strategy) cmd->add_option("--strategy", req.strategy.name, "multi-device strategy (default: the plain loop; listed below)");
  cmd->add_option("--cache-threshold", req.strategy.cache_threshold,
                  "fbcache: reuse the rest while the first block's (a UNet's first down layer's) output moved less "
                  "than this (relative); teacache: skip every block while the rescaled changes summed stay under "
                  "this; 0: never reuse (default: fbcache 0.12, teacache 0.4)");
  cmd->add_option("--patches", req.strategy.patches,
                  "pipefusion, cfg-pipefusion (SD3, Flux): latent row patches (default: one per stage)");
  cmd->footer(strategy_help());
}

void add_device_options(CLI::App* cmd, DeviceOptions& d, std::string& gpus) {
  cmd->add_option("--devices", d.devices, "devices the strategy runs on (default: its fixed count, or every GPU from --device)");
  cmd->add_option("--skip", d.skip, "step-skip: evaluate every N-th step; deepcache: the deep layers every N-th step (default 2; DeepCache's own 3)");
  cmd->add_option("--gpus", gpus, "the GPUs a strategy may use, e.g. 0,2 (default: every GPU from --device on)");
}

// Where --preset NAME looks: $DIFFRACT_PRESETS_DIR, the GUI's user presets, the installed
// share/diffract/presets beside this executable, then the source tree's presets/.
std::vector<fs::path> preset_dirs() {
  std::vector<fs::path> dirs;
  if (options::is_set(options::Id::PresetsDir)) dirs.emplace_back(options::value(options::Id::PresetsDir));
  const char* xdg = std::getenv("XDG_CONFIG_HOME");
  const char* home = std::getenv("HOME");
  if (xdg && *xdg) dirs.push_back(fs::path(xdg) / "Diffract" / "Diffract" / "presets");
  else if (home) dirs.push_back(fs::path(home) / ".config" / "Diffract" / "Diffract" / "presets");
  std::error_code ec;
  const auto exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back(exe.parent_path().parent_path() / "share" / "diffract" / "presets");
  dirs.emplace_back(DIFFRACT_SOURCE_PRESETS);
  return dirs;
}

// The preset fills every setting the command line did not give; --prompt fills its {subject}.
engine::Preset apply_cli_preset(const CLI::App* cmd, const std::string& name, job::GenerationRequest& req) {
  const auto preset = engine::find_preset(name, preset_dirs());
  const auto given = [&](const char* option) { return cmd->get_option(option)->count() > 0; };
  job::GenerationRequest from = req;
  engine::apply_preset(preset, req.prompt, from);
  req.prompt = from.prompt;
  if (!given("--negative")) req.negative_prompt = from.negative_prompt;
  if (!given("--width")) req.width = from.width;
  if (!given("--height")) req.height = from.height;
  if (!given("--steps")) req.steps = from.steps;
  if (!given("--cfg")) req.cfg = from.cfg;
  if (!given("--guidance")) req.guidance = from.guidance;
  if (!given("--scheduler")) req.sampler = from.sampler;
  if (!given("--strategy")) req.strategy.name = from.strategy.name;
  if (!given("--devices")) req.strategy.devices = from.strategy.devices;
  if (!given("--skip")) req.strategy.skip = from.strategy.skip;
  if (!given("--cache-threshold")) req.strategy.cache_threshold = from.strategy.cache_threshold;
  if (!given("--precision")) req.precision = from.precision;
  if (!given("--lora")) req.loras = from.loras;  // by name, found in the LoRA folders
  std::cout << "preset '" << preset.name << "': prompt '" << req.prompt << "'\n";
  return preset;
}

int compare(job::GenerationRequest request, const fs::path& out_dir) {
  const auto strategy = request.strategy.display_name();
  const int devices = request.strategy.devices;
  fs::create_directories(out_dir);
  request.preview_every = 0;
  engine::Engine eng;
  job::CancelToken never;
  const auto c = engine::compare(eng, request, request.strategy, {}, never);
  engine::save_image(out_dir / "baseline.png", c.baseline.images.front(), c.baseline.a1111_parameters,
                     c.baseline.metadata_json);
  engine::save_image(out_dir / (strategy + ".png"), c.accelerated.images.front(), c.accelerated.a1111_parameters,
                     c.accelerated.metadata_json);
  io::write_png(out_dir / "heatmap.png", c.heatmap);
  const auto meta = nlohmann::json::parse(c.accelerated.metadata_json);
  std::cout << "strategy " << strategy << " on " << devices << " device(s)\n"
            << "speed-up " << c.speedup << " (baseline " << c.baseline.timings.total_ms - c.baseline.timings.load_ms
            << " ms, strategy " << c.accelerated.timings.total_ms - c.accelerated.timings.load_ms << " ms)\n"
            << "PSNR " << c.psnr << " dB, SSIM " << c.ssim << ", latents relative L2 " << c.latents_rel_l2 << "\n";
  if (meta.contains("strategy")) std::cout << "stats " << meta["strategy"].dump() << "\n";
  if (request.device == "cpu")
    std::cout << "note: CPU virtual devices share this machine's cores; their speed-up says nothing about GPUs\n";
  std::cout << "wrote " << (out_dir / "baseline.png").string() << ", " << (out_dir / (strategy + ".png")).string()
            << ", " << (out_dir / "heatmap.png").string() << "\n";
  return 0;
}

// A lanes file, or the name or file stem of a lane setup in the preset folders' lanes/.
engine::LaneSet find_lane_set(const std::string& name_or_file) {
  if (fs::path(name_or_file).extension() == ".json" || name_or_file.find('/') != std::string::npos)
    return engine::load_lane_set(name_or_file);
  std::vector<fs::path> dirs;
  for (const auto& d : preset_dirs()) dirs.push_back(d / "lanes");
  const auto sets = engine::list_lane_sets(dirs);
  const auto lower = [](std::string t) {
    for (auto& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return t;
  };
  std::string known;
  for (const auto& set : sets) {
    if (lower(set.name) == lower(name_or_file) || set.file.stem().string() == name_or_file) return set;
    known += (known.empty() ? "" : ", ") + set.file.stem().string();
  }
  throw Error("no lane setup '" + name_or_file.substr(0, 80) + "' (a .json file, or one of: " +
              (known.empty() ? "none found" : known) + ")");
}

int lanes(const std::string& setup, job::GenerationRequest request, const std::vector<int>& gpus, const fs::path& out_dir) {
  const auto set = find_lane_set(setup);
  const std::vector<int> enabled = enabled_gpus(request.device, gpus);
  const bool cuda = request.device.rfind("cuda", 0) == 0;
  request.preview_every = 0;
  const auto plans = engine::plan_lanes(request, set, enabled);
  std::cout << "lanes '" << set.name << "': " << set.lanes.size() << " lanes\n";
  for (const auto& line : engine::describe_sharing(plans)) std::cout << "note: " << line << "\n";
  engine::Engine eng;
  job::CancelToken never;
  engine::LaneGroupObserver observer;
  observer.on_lane_started = [&](int lane) {
    std::cerr << "lane " << lane + 1 << " (" << engine::lane_title(set.lanes[static_cast<std::size_t>(lane)])
              << ") started\n";
  };
  const auto result = eng.run_lanes(request, set, enabled, observer, never);
  const auto file = engine::save_lane_group(result, out_dir);
  std::cout << engine::lane_table(result);
  if (!cuda) std::cout << "note: CPU virtual devices share this machine's cores; their speed-up says nothing about GPUs\n";
  std::cout << "wrote " << file.string() << "\n";
  int failed = 0;
  for (const auto& o : result.lanes) failed += o.state != engine::LaneOutcome::State::Done;
  return failed > 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Diffract: fast diffusion image generation (headless)"};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Debug output from every component");
  app.set_version_flag("--version", [] { return describe(build_info()); });

  auto* info_cmd = app.add_subcommand("info", "What this build and machine offer");

  std::string inspect_path;
  auto* inspect_cmd = app.add_subcommand("inspect", "List a model folder's components or a checkpoint's tensors");
  inspect_cmd->add_option("path", inspect_path, "diffusers folder or .safetensors / .index.json file")->required();

  std::string tok_path, prompt;
  auto* tok_cmd = app.add_subcommand("tokenize", "Print the CLIP token ids of a prompt");
  tok_cmd->add_option("--tokenizer", tok_path, "tokenizer folder or bpe_simple_vocab_16e6.txt.gz")->required();
  tok_cmd->add_option("--prompt", prompt, "text")->required();

  std::string model_path, component = "text_encoder";
  auto* enc_cmd = app.add_subcommand("encode", "Run a model's CLIP text encoder on a prompt");
  enc_cmd->add_option("--model", model_path, "diffusers model folder")->required();
  enc_cmd->add_option("--prompt", prompt, "text")->required();
  enc_cmd->add_option("--component", component, "text_encoder or text_encoder_2")
      ->check(CLI::IsMember({"text_encoder", "text_encoder_2"}));

  job::GenerationRequest req;
  DeviceOptions device_options;
  std::string gpus;
  std::string out_path, preview_dir, out_dir;
  auto* gen_cmd = app.add_subcommand("generate", "Text to image, image to image or inpainting; writes a PNG carrying its parameters");
  add_generation_options(gen_cmd, req);
  add_device_options(gen_cmd, device_options, gpus);
  ImageOptions image_options;
  add_image_options(gen_cmd, req, image_options);
  ControlNetOptions controlnet_options;
  add_controlnet_options(gen_cmd, controlnet_options);
  gen_cmd->add_option("--preview-dir", preview_dir, "write each step's preview here");
  std::string preview_size = "auto";
  gen_cmd->add_option("--preview-size", preview_size,
                      "largest preview side: auto (half the image, at most 512 px), full, or pixels (larger images "
                      "preview from latents averaged down)")
      ->capture_default_str();
  std::string preset_name;
  gen_cmd->add_option("--preset", preset_name,
                      "preset name or .json file: its settings, --prompt filling its {subject}; options given override it");
  gen_cmd->add_option("--out", out_path, "output .png")->required();

  auto* cmp_cmd = app.add_subcommand("compare", "A strategy against the one-device baseline, same seed: speed and quality");
  add_generation_options(cmp_cmd, req, /*with_strategy=*/false);
  cmp_cmd->add_option("--strategy", req.strategy.name, "a strategy other than single (listed below)")->required();
  add_device_options(cmp_cmd, device_options, gpus);
  cmp_cmd->add_option("--out-dir", out_dir, "folder for baseline.png, <strategy>.png and heatmap.png")->required();

  std::string lanes_setup;
  auto* lanes_cmd = app.add_subcommand(
      "lanes", "One prompt and seed through several lanes (strategy, steps, sampler each), compared with the baseline lane");
  lanes_cmd->add_option("setup", lanes_setup, "lanes .json file, or a shipped lane setup's name (presets/lanes)")->required();
  add_generation_options(lanes_cmd, req, /*with_strategy=*/false);
  lanes_cmd->add_option("--gpus", gpus, "the GPUs the lanes may use, e.g. 0,2 (default: every GPU from --device on)");
  lanes_cmd->add_option("--out-dir", out_dir, "folder for lane-<N>.png, lane-<N>-heatmap.png and lanes.json")->required();

  CLI11_PARSE(app, argc, argv);
  log::set_verbose(verbose);
  try {
    if (info_cmd->parsed()) {
      std::cout << describe(build_info()) << "\n\nRuntime options (environment; job-scope ones may differ per job):\n";
      for (const auto& o : options::table()) {
        std::cout << "  " << o.name << "=" << options::value(o.id) << (options::is_set(o.id) ? "" : " (default)") << "  ["
                  << options::type_name(o.type) << ", " << options::scope_name(o.scope) << "] " << o.doc << "\n";
      }
      const auto tuning = io::tuning_directory();
      std::cout << "\nGPU tuning store: " << (tuning.empty() ? std::string("off (choices kept in memory only)") : tuning.string())
                << "\n";
      return 0;
    }
    if (inspect_cmd->parsed()) return inspect(inspect_path);
    if (tok_cmd->parsed()) return tokenize(tok_path, prompt);
    if (enc_cmd->parsed()) return encode(model_path, component, prompt);
    if ((gen_cmd->parsed() || cmp_cmd->parsed() || lanes_cmd->parsed()) && req.model.empty()) {
      req.model = embedded_model_dir().string();
      if (req.model.empty())
        throw Error("no --model given and no embedded model (resources/models/diffract-emoji) found");
    }
    if (gen_cmd->parsed() || cmp_cmd->parsed() || lanes_cmd->parsed()) device_options.gpus = parse_gpus(gpus);
    if (lanes_cmd->parsed()) return lanes(lanes_setup, req, device_options.gpus, out_dir);
    if (gen_cmd->parsed()) {
      engine::Preset preset;
      if (!preset_name.empty()) preset = apply_cli_preset(gen_cmd, preset_name, req);
      apply_devices(req, device_options);
      apply_image_options(req, image_options);
      apply_controlnet_options(req, controlnet_options, preset.controlnets);
      req.preview_max_side = parse_preview_size(preview_size);
      return generate(req, out_path, preview_dir);
    }
    if (cmp_cmd->parsed()) {
      const auto& info = parallel::strategy_info(req.strategy.name);
      if (device_options.devices == 0 && req.device == "cpu" && !info.takes(parallel::Param::Skip) && info.devices.fixed == 0)
        device_options.devices = 2;
      apply_devices(req, device_options);
      return compare(req, out_dir);
    }
  } catch (const Error& e) {
    log::get("cli").error(e.what());
    return 1;
  } catch (const std::exception& e) {
    log::get("cli").error("internal error: " + message_of(e));
    return 2;
  }
  return 0;
}
