#pragma once
// What the image oracle tests share: a job from one of the reference scripts' cases, and our
// 8-bit image against diffusers' float one.
#include <string>

#include <ATen/ATen.h>
#include <QString>
#include <nlohmann/json.hpp>

#include "core/io/image.h"
#include "core/job/request.h"
#include "test_util.h"

namespace diffract::test {

// A case's model (a folder under the fixtures), prompts, steps, CFG, size, seed and sampler; no previews.
inline job::GenerationRequest request_from_case(const nlohmann::json& c) {
  job::GenerationRequest r;
  r.model = (fixtures() / c["model"].get<std::string>()).string();
  r.prompt = c["prompt"];
  r.negative_prompt = c["negative_prompt"];
  r.steps = c["steps"];
  r.cfg = c["cfg"];
  r.width = c["width"];
  r.height = c["height"];
  r.seed = c["seed"];
  r.sampler = c["sampler"];
  r.preview_every = 0;
  return r;
}

// A job from a diffusers pipeline call's keyword arguments (prompt, negative_prompt,
// num_inference_steps, guidance_scale, width, height, seed, num_images_per_prompt) on `model`.
// `distilled`: guidance_scale is Flux's embedded guidance and true_cfg_scale the CFG scale (1 when
// absent); otherwise guidance_scale is the CFG scale.
inline job::GenerationRequest request_from_call(const nlohmann::json& c, const std::string& model, bool distilled) {
  job::GenerationRequest r;
  r.model = model;
  r.prompt = c["prompt"];
  r.negative_prompt = c.value("negative_prompt", "");
  r.steps = c["num_inference_steps"];
  if (distilled) {
    r.cfg = c.value("true_cfg_scale", 1.0);
    r.guidance = c["guidance_scale"];
  } else {
    r.cfg = c["guidance_scale"];
  }
  r.width = c["width"];
  r.height = c["height"];
  r.seed = c["seed"];
  r.batch = c.value("num_images_per_prompt", 1);
  r.preview_every = 0;
  return r;
}

inline at::Tensor image_levels(const io::Image& img) {
  return at::from_blob(const_cast<std::uint8_t*>(img.rgb.data()), {img.height, img.width, 3}, at::kByte).to(at::kInt);
}

// diffusers' image ([H, W, 3] floats in [0, 1], rounded to levels) against ours: at most
// `max_levels` apart anywhere and `max_mean` on average. Empty when it holds, else what differs.
inline QString image_mismatch(const io::Image& ours, const at::Tensor& theirs_float, const std::string& name,
                              int max_levels = 1, double max_mean = 0.05) {
  const auto theirs = (theirs_float * 255).round().to(at::kInt);
  const auto mine = image_levels(ours);
  if (mine.sizes() != theirs.sizes())
    return QString("%1: %2 vs %3").arg(name.c_str(), c10::str(mine.sizes()).c_str(), c10::str(theirs.sizes()).c_str());
  const auto diff = (mine - theirs).abs();
  const int max = diff.max().item<int>();
  const double mean = diff.to(at::kFloat).mean().item<float>();
  qInfo("%s: max %d levels, mean %.4f", name.c_str(), max, mean);
  if (max <= max_levels && mean <= max_mean) return {};
  return QString("%1: max %2 levels, mean %3").arg(name.c_str()).arg(max).arg(mean);
}

}  // namespace diffract::test
