#include "core/util/build_info.h"

#include <torch/cuda.h>
#include <torch/version.h>

#ifdef DIFFRACT_HAS_NCCL
#include <nccl.h>
#endif

namespace diffract {

BuildInfo build_info() {
  BuildInfo info;
  info.diffract_version = DIFFRACT_VERSION;
  info.torch_version = TORCH_VERSION;
#ifdef DIFFRACT_HAS_CUDA
  info.cuda_built = true;
#endif
  info.cuda_devices = static_cast<int>(torch::cuda::device_count());
#ifdef DIFFRACT_HAS_NCCL
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess)
    info.nccl_version = std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
#endif
#ifdef DIFFRACT_HAS_ICU  // what CLIPTokenizer::has_unicode_support() says, without the text layer
  info.unicode_tokenizer = true;
#endif
  return info;
}

std::string describe(const BuildInfo& i) {
  return "Diffract " + i.diffract_version + " (LibTorch " + i.torch_version + ", CUDA " +
         (i.cuda_built ? "built, " + std::to_string(i.cuda_devices) + " device(s)" : std::string("not built")) +
         ", NCCL " + (i.nccl_version.empty() ? "no" : i.nccl_version) + ", Unicode tokenizer " +
         (i.unicode_tokenizer ? "yes" : "no (ASCII prompts only)") + ")";
}

}  // namespace diffract
