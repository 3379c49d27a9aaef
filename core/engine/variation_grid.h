#pragma once
// Variations over two parameters as one set of jobs (the window's "Queue grid"): each axis a
// request setting and its values, the jobs row by row (y outer, x inner), each the form's request
// with its cell's two values. The window draws their images as one labelled grid and saves it
// with grid_json() beside it.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/job/request.h"

namespace diffract::engine {

enum class GridParameter { Steps, Cfg, Sampler, Strategy, Seed, Guidance, Precision, CacheThreshold, LoraWeight };

// Every parameter, in the order lists show them, and their names: "steps", "cfg", "sampler",
// "strategy", "seed", "guidance", "precision", "cache_threshold", "lora_weight".
const std::vector<GridParameter>& grid_parameters();
std::string_view grid_parameter_name(GridParameter p);
std::optional<GridParameter> parse_grid_parameter(std::string_view name);

inline constexpr int kMaxGridValues = 16;

struct GridAxis {
  GridParameter parameter = GridParameter::Steps;
  std::vector<std::string> values;  // as written, trimmed: "20", "dpmpp-2m", "step-skip:2"
};

// An axis from a parameter's name and its values separated by commas ("20, 30, 40"). Each value
// is checked for the parameter (a whole number of steps 1..1000, a CFG 0..100, a known sampler, a
// strategy NAME[:N] of the registry, a seed, bf16 / fp8, ...); at most kMaxGridValues, no empty
// ones. Errors name the parameter and the value.
GridAxis parse_grid_axis(const std::string& parameter, const std::string& values);

// `request` with `value` of parameter `p`: a strategy's N is its devices, or its skip where it
// skips (step-skip, deepcache); lora_weight sets every LoRA's weight (an error without one).
void apply_grid_value(job::GenerationRequest& request, GridParameter p, const std::string& value);

struct GridCell {
  int x = 0, y = 0;
  job::GenerationRequest request;
};

// Every cell's request, row by row (y outer, x inner); without a y axis one row.
std::vector<GridCell> expand_grid(const job::GenerationRequest& base, const GridAxis& x,
                                  const std::optional<GridAxis>& y);

// "steps 20": an axis value as the grid labels it.
std::string grid_label(const GridAxis& axis, int index);

// The JSON saved beside a grid image: its axes with their values, and per cell (row by row) its
// x and y index, seed and the file of its own image (when saved).
nlohmann::json grid_json(const GridAxis& x, const std::optional<GridAxis>& y, const std::vector<GridCell>& cells,
                         const std::vector<std::string>& cell_files);

}  // namespace diffract::engine
