#include "core/job/model_family.h"

namespace diffract::job {

std::string_view family_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::SD1: return "sd1";
    case ModelFamily::SD2: return "sd2";
    case ModelFamily::SDXL: return "sdxl";
    case ModelFamily::SD3: return "sd3";
    case ModelFamily::Flux: return "flux";
  }
  return "";
}

}  // namespace diffract::job
