#pragma once
// Bitwise comparison of two modules' parameters and buffers, by name (the single-file tests:
// a model bound from a single file against the same model from its diffusers folder).
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <QtTest>
#include <torch/nn/module.h>

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

}  // namespace diffract::test

#define EXPECT_SAME_TENSORS(a, b)                                                       \
  do {                                                                                  \
    const std::string _why = diffract::test::same_tensors(*(a), *(b));                  \
    QVERIFY2(_why.empty(), qPrintable(QString::fromStdString(#a ": " + _why)));         \
  } while (0)
