#pragma once
#include <string>

namespace diffract {

// What this build and machine offer, for --version, logs and benchmark reports.
struct BuildInfo {
  std::string diffract_version;
  std::string torch_version;
  bool cuda_built = false;     // LibTorch and Diffract were built with CUDA
  int cuda_devices = 0;        // usable now
  std::string nccl_version;    // empty when built without NCCL
  bool unicode_tokenizer = false;
};

BuildInfo build_info();
std::string describe(const BuildInfo& info);

}  // namespace diffract
