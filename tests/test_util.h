#pragma once
// Helpers shared by the Qt Test files: where the oracle's fixtures are, tensor comparison.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>

#include <ATen/ATen.h>
#include <QtTest>
#include <nlohmann/json.hpp>

namespace diffract::test {

inline std::filesystem::path fixtures() {
  const char* d = std::getenv("DIFFRACT_FIXTURES");
  return d ? std::filesystem::path(d) : std::filesystem::path("fixtures");
}

// The shipped embedded model in the source tree (the tests point DIFFRACT_EMBEDDED_MODEL nowhere,
// so that no test picks it up unasked).
inline std::filesystem::path emoji_model() {
  return std::filesystem::path(QT_TESTCASE_SOURCEDIR) / ".." / "resources" / "models" / "diffract-emoji";
}

inline std::filesystem::path shared_dir() {
  const char* d = std::getenv("DIFFRACT_SHARED");
  return d ? std::filesystem::path(d) : std::filesystem::path("../shared");
}

// Max absolute difference, checked against a tolerance stated by the caller.
inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// "" when got ≈ want within rtol of want's magnitude (at least 1), else what differs: the
// layer-by-layer checks against diffusers (llm.c style, a tolerance per tensor).
inline std::string scaled_mismatch(const at::Tensor& got, const at::Tensor& want, double rtol) {
  if (got.sizes() != want.sizes()) return "shape " + c10::str(got.sizes()) + " vs " + c10::str(want.sizes());
  const double scale = std::max(1.0, want.abs().max().item<double>());
  const double d = max_abs_diff(got, want);
  if (d <= rtol * scale) return "";
  return "max |diff| " + std::to_string(d) + " > " + std::to_string(rtol * scale);
}

// A copy of the model folder `src` (config.json + diffusion_pytorch_model.safetensors) in `dst`
// with its config edited: for the bad-config error tests.
inline void copy_with_config(const std::filesystem::path& src, const std::filesystem::path& dst,
                             const std::function<void(nlohmann::json&)>& edit) {
  std::ifstream in(src / "config.json");
  auto j = nlohmann::json::parse(in);
  edit(j);
  std::filesystem::create_directories(dst);
  std::ofstream(dst / "config.json") << j.dump(1);
  std::filesystem::copy_file(src / "diffusion_pytorch_model.safetensors", dst / "diffusion_pytorch_model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
}

}  // namespace diffract::test

// Fails the test (with both shapes and the max difference) unless a ≈ b within atol.
#define DIFFRACT_COMPARE_TENSORS(a, b, atol)                                                                \
  do {                                                                                                      \
    const at::Tensor _a = (a), _b = (b);                                                                    \
    QVERIFY2(_a.sizes() == _b.sizes(),                                                                      \
             qPrintable(QString("shape %1 vs %2").arg(c10::str(_a.sizes()).c_str(), c10::str(_b.sizes()).c_str()))); \
    const double _d = diffract::test::max_abs_diff(_a, _b);                                                 \
    QVERIFY2(_d <= (atol), qPrintable(QString("%1: max |diff| %2 > %3").arg(#a).arg(_d).arg(atol)));        \
  } while (0)

// Fails the test naming `what` unless got ≈ want within rtol of want's magnitude (scaled_mismatch).
#define DIFFRACT_EXPECT_CLOSE(got, want, rtol, what)                                                        \
  do {                                                                                                      \
    const std::string _m = diffract::test::scaled_mismatch((got), (want), (rtol));                          \
    QVERIFY2(_m.empty(), qPrintable(QString::fromStdString(std::string(what) + ": " + _m)));                 \
  } while (0)

// Runs `expr`, which must throw diffract::Error whose message contains every fragment.
#define DIFFRACT_EXPECT_ERROR(expr, ...)                                                                    \
  do {                                                                                                      \
    bool _thrown = false;                                                                                   \
    try {                                                                                                   \
      (void)(expr);                                                                                         \
    } catch (const diffract::Error& _e) {                                                                   \
      _thrown = true;                                                                                       \
      const std::string _msg = _e.what();                                                                   \
      /* Fragments as strings: a fragment built in the call (a temporary's c_str()) lives on. */            \
      for (const std::string& _frag : std::initializer_list<std::string>{__VA_ARGS__})                      \
        QVERIFY2(_msg.find(_frag) != std::string::npos,                                                     \
                 qPrintable(QString("error '%1' lacks '%2'").arg(_msg.c_str(), _frag.c_str())));            \
    }                                                                                                       \
    QVERIFY2(_thrown, "expected a diffract::Error from " #expr);                                            \
  } while (0)
