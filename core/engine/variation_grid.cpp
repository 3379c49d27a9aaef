#include "core/engine/variation_grid.h"

#include <cmath>
#include <limits>

#include "core/parallel/registry.h"
#include "core/schedulers/sampler.h"
#include "core/util/error.h"

namespace diffract::engine {

namespace {

const std::vector<std::pair<GridParameter, std::string_view>>& names() {
  static const std::vector<std::pair<GridParameter, std::string_view>> n = {
      {GridParameter::Steps, "steps"},         {GridParameter::Cfg, "cfg"},
      {GridParameter::Sampler, "sampler"},     {GridParameter::Strategy, "strategy"},
      {GridParameter::Seed, "seed"},           {GridParameter::Guidance, "guidance"},
      {GridParameter::Precision, "precision"}, {GridParameter::CacheThreshold, "cache_threshold"},
      {GridParameter::LoraWeight, "lora_weight"}};
  return n;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// The whole value as a number, or an error naming it.
double number(const std::string& v, std::string_view what) {
  std::size_t used = 0;
  double d = std::numeric_limits<double>::quiet_NaN();
  try {
    d = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || !std::isfinite(d))
    throw Error(std::string(what) + ": '" + v.substr(0, 40) + "' is not a number");
  return d;
}

std::uint64_t whole(const std::string& v, std::string_view what) {
  if (v.empty() || v.size() > 20 || v.find_first_not_of("0123456789") != std::string::npos)
    throw Error(std::string(what) + ": '" + v.substr(0, 40) + "' is not a whole number");
  try {
    return std::stoull(v);
  } catch (const std::exception&) {
    throw Error(std::string(what) + ": '" + v.substr(0, 40) + "' is out of range");
  }
}

// "NAME[:N]" -> the registry's entry and N (0: none given).
std::pair<const parallel::StrategyInfo*, int> strategy_of(const std::string& v) {
  const auto colon = v.find(':');
  const auto* info = parallel::find_strategy(v.substr(0, colon));
  if (!info) throw Error("strategy: unknown '" + v.substr(0, 60) + "' (" + parallel::strategy_names() + ")");
  int n = 0;
  if (colon != std::string::npos) {
    const auto count = whole(v.substr(colon + 1), "strategy " + std::string(info->name));
    if (count < 1 || count > 64) throw Error("strategy " + std::string(info->name) + ": " + v.substr(colon + 1) + " is outside 1..64");
    n = static_cast<int>(count);
  }
  return {info, n};
}

}  // namespace

const std::vector<GridParameter>& grid_parameters() {
  static const std::vector<GridParameter> all = [] {
    std::vector<GridParameter> v;
    for (const auto& [p, n] : names()) v.push_back(p);
    return v;
  }();
  return all;
}

std::string_view grid_parameter_name(GridParameter p) {
  for (const auto& [q, n] : names())
    if (q == p) return n;
  return "?";
}

std::optional<GridParameter> parse_grid_parameter(std::string_view name) {
  for (const auto& [p, n] : names())
    if (n == name) return p;
  return std::nullopt;
}

void apply_grid_value(job::GenerationRequest& r, GridParameter p, const std::string& v) {
  const auto what = grid_parameter_name(p);
  switch (p) {
    case GridParameter::Steps: {
      const auto n = whole(v, what);
      if (n < 1 || n > 1000) throw Error("steps: " + v + " is outside 1..1000");
      r.steps = static_cast<int>(n);
      break;
    }
    case GridParameter::Cfg: {
      const double c = number(v, what);
      if (c < 0 || c > 100) throw Error("cfg: " + v + " is outside 0..100");
      r.cfg = c;
      break;
    }
    case GridParameter::Sampler:
      schedulers::parse_sampler_or_throw(v);
      r.sampler = v;
      break;
    case GridParameter::Strategy: {
      const auto [info, n] = strategy_of(v);
      r.strategy.name = std::string(info->name);
      if (n > 0) (info->takes(parallel::Param::Skip) ? r.strategy.skip : r.strategy.devices) = n;
      break;
    }
    case GridParameter::Seed:
      r.seed = whole(v, what);
      break;
    case GridParameter::Guidance: {
      const double g = number(v, what);
      if (g < 0 || g > 100) throw Error("guidance: " + v + " is outside 0..100");
      r.guidance = g;
      break;
    }
    case GridParameter::Precision:
      if (v != "bf16" && v != "fp8") throw Error("precision: '" + v.substr(0, 40) + "' is neither bf16 nor fp8");
      r.precision = v;
      break;
    case GridParameter::CacheThreshold: {
      const double t = number(v, what);
      if (t < 0 || t > 10) throw Error("cache_threshold: " + v + " is outside 0..10");
      r.strategy.cache_threshold = t;
      break;
    }
    case GridParameter::LoraWeight: {
      const double w = number(v, what);
      if (w < -10 || w > 10) throw Error("lora_weight: " + v + " is outside -10..10");
      if (r.loras.empty()) throw Error("lora_weight: the job has no LoRA to weigh (add one first)");
      for (auto& l : r.loras) l.weight = w;
      break;
    }
  }
}

GridAxis parse_grid_axis(const std::string& parameter, const std::string& values) {
  const auto p = parse_grid_parameter(trim(parameter));
  if (!p) {
    std::string known;
    for (const auto& [q, n] : names()) known += (known.empty() ? "" : ", ") + std::string(n);
    throw Error("grid axis: unknown parameter '" + trim(parameter).substr(0, 40) + "' (" + known + ")");
  }
  GridAxis axis;
  axis.parameter = *p;
  std::size_t from = 0;
  while (from <= values.size()) {
    const auto comma = values.find(',', from);
    const auto v = trim(values.substr(from, comma == std::string::npos ? std::string::npos : comma - from));
    if (v.empty()) throw Error("grid axis " + std::string(grid_parameter_name(*p)) + ": an empty value in '" +
                               values.substr(0, 80) + "'");
    if (static_cast<int>(axis.values.size()) == kMaxGridValues)
      throw Error("grid axis " + std::string(grid_parameter_name(*p)) + ": more than " + std::to_string(kMaxGridValues) +
                  " values");
    job::GenerationRequest probe;
    probe.loras.emplace_back();  // lora_weight checks its number here; the job's LoRAs at expand_grid
    apply_grid_value(probe, *p, v);
    axis.values.push_back(v);
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
  return axis;
}

std::vector<GridCell> expand_grid(const job::GenerationRequest& base, const GridAxis& x,
                                  const std::optional<GridAxis>& y) {
  if (x.values.empty()) throw Error("grid: the x axis has no values");
  if (y && y->values.empty()) throw Error("grid: the y axis has no values");
  if (y && y->parameter == x.parameter)
    throw Error("grid: both axes vary " + std::string(grid_parameter_name(x.parameter)) + "; pick two parameters");
  std::vector<GridCell> cells;
  const int rows = y ? static_cast<int>(y->values.size()) : 1;
  for (int j = 0; j < rows; ++j)
    for (int i = 0; i < static_cast<int>(x.values.size()); ++i) {
      GridCell c{i, j, base};
      apply_grid_value(c.request, x.parameter, x.values[static_cast<std::size_t>(i)]);
      if (y) apply_grid_value(c.request, y->parameter, y->values[static_cast<std::size_t>(j)]);
      cells.push_back(std::move(c));
    }
  return cells;
}

std::string grid_label(const GridAxis& axis, int index) {
  const auto& v = axis.values.at(static_cast<std::size_t>(index));
  switch (axis.parameter) {
    case GridParameter::Sampler:
    case GridParameter::Strategy:
    case GridParameter::Precision:
      return v;
    default:
      return std::string(grid_parameter_name(axis.parameter)) + " " + v;
  }
}

nlohmann::json grid_json(const GridAxis& x, const std::optional<GridAxis>& y, const std::vector<GridCell>& cells,
                         const std::vector<std::string>& cell_files) {
  const auto axis = [](const GridAxis& a) {
    return nlohmann::json{{"parameter", grid_parameter_name(a.parameter)}, {"values", a.values}};
  };
  nlohmann::json j = {{"x", axis(x)}};
  if (y) j["y"] = axis(*y);
  j["cells"] = nlohmann::json::array();
  for (std::size_t k = 0; k < cells.size(); ++k) {
    nlohmann::json c = {{"x", cells[k].x}, {"y", cells[k].y}, {"seed", cells[k].request.seed}};
    if (k < cell_files.size() && !cell_files[k].empty()) c["file"] = cell_files[k];
    j["cells"].push_back(c);
  }
  return j;
}

}  // namespace diffract::engine
