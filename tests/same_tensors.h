#pragma once
// Bitwise comparison of two modules' parameters and buffers, by name (the single-file tests:
// a model bound from a single file against the same model from its diffusers folder).
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <QtTest>
#include <torch/nn/module.h>

#include "core/job/job.h"

namespace diffract::test {

// Every parameter and buffer, by name.
inline std::map<std::string, at::Tensor> tensors_of(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters(true)) out.emplace(p.key(), p.value());
  for (const auto& b : m.named_buffers(true)) out.emplace(b.key(), b.value());
  return out;
}

// Empty when both modules hold the same names with bitwise-equal tensors; else what differs.
inline std::string same_tensors(const torch::nn::Module& a, const torch::nn::Module& b) {
  const auto ta = tensors_of(a), tb = tensors_of(b);
  if (ta.size() != tb.size()) return std::to_string(ta.size()) + " vs " + std::to_string(tb.size()) + " tensors";
  for (const auto& [key, t] : ta) {
    auto it = tb.find(key);
    if (it == tb.end()) return "'" + key + "' only in the first";
    if (!at::equal(t, it->second)) return "'" + key + "' differs";
  }
  return {};
}

// Empty when two jobs' final latents and images are bitwise equal (a single file's job against its
// folder's); else what differs.
inline std::string same_generation(const job::GenerationResult& a, const job::GenerationResult& b) {
  const auto latents = [](const job::GenerationResult& r) {
    return at::from_blob(const_cast<float*>(r.latents.data()), r.latents_shape, at::kFloat);
  };
  const auto la = latents(a), lb = latents(b);
  if (la.sizes() != lb.sizes()) return "final latents " + c10::str(la.sizes()) + " vs " + c10::str(lb.sizes());
  if (!at::equal(la, lb)) return "final latents differ, max " + std::to_string((la - lb).abs().max().item<double>());
  if (a.images.size() != b.images.size()) return std::to_string(a.images.size()) + " vs " + std::to_string(b.images.size()) + " images";
  for (std::size_t i = 0; i < a.images.size(); ++i)
    if (a.images[i].rgb != b.images[i].rgb) return "image " + std::to_string(i) + " differs";
  return {};
}

}  // namespace diffract::test

#define EXPECT_SAME_GENERATION(a, b)                                                    \
  do {                                                                                  \
    const std::string _why = diffract::test::same_generation((a), (b));                 \
    QVERIFY2(_why.empty(), _why.c_str());                                               \
  } while (0)

#define EXPECT_SAME_TENSORS(a, b)                                                       \
  do {                                                                                  \
    const std::string _why = diffract::test::same_tensors(*(a), *(b));                  \
    QVERIFY2(_why.empty(), qPrintable(QString::fromStdString(#a ": " + _why)));         \
  } while (0)
