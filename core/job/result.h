#pragma once
// What a finished job gives. No torch headers.
#include <cstdint>
#include <string>
#include <vector>

#include "core/io/image.h"
#include "core/job/events.h"
#include "core/job/request.h"

namespace diffract::job {

struct GenerationResult {
  std::vector<io::Image> images;
  StageTimings timings;
  GenerationRequest request;     // as run: size, sampler and seed resolved
  std::string family;            // job::family_name: "sd1", "sd2", "sdxl", "sd3"
  std::string a1111_parameters;  // the A1111 "parameters" text
  std::string metadata_json;     // the whole job and its timings
  std::vector<float> latents;    // the final latents (float32), for comparing runs
  std::vector<std::int64_t> latents_shape;
};

}  // namespace diffract::job
