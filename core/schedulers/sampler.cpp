#include "core/schedulers/sampler.h"

#include <array>
#include <cmath>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>

#include "core/io/json_file.h"
#include "core/io/read_file.h"
#include "core/schedulers/detail.h"
#include "core/schedulers/schedule.h"
#include "core/util/error.h"

namespace diffract::schedulers {

namespace {

constexpr std::array<std::pair<SamplerKind, std::string_view>, 7> kNames{{
    {SamplerKind::Euler, "euler"},
    {SamplerKind::EulerAncestral, "euler-ancestral"},
    {SamplerKind::DDIM, "ddim"},
    {SamplerKind::DDPM, "ddpm"},
    {SamplerKind::DPMPP2M, "dpmpp-2m"},
    {SamplerKind::DPMPP2MKarras, "dpmpp-2m-karras"},
    {SamplerKind::FlowMatchEuler, "flow-euler"},
}};

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// A feature a supported scheduler class has but these samplers do not implement: an error for
// from_json, "not native" for native_sampler.
class Unsupported : public Error {
 public:
  using Error::Error;
};

// diffusers writes float('-inf') defaults (lambda_min_clipped) as the bare tokens -Infinity,
// Infinity and NaN, which strict JSON parsers reject; they are read as strings instead.
nlohmann::json parse_lenient(const std::filesystem::path& path) {
  const std::string text = io::read_file(path, 1 << 20);
  std::string fixed;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      fixed += c;
      if (c == '\\' && i + 1 < text.size()) fixed += text[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (std::string_view token : {"-Infinity", "Infinity", "NaN"}) {
      if (text.compare(i, token.size(), token) == 0) {
        fixed += '"' + std::string(token) + '"';
        i += token.size() - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) fixed += c;
  }
  auto j = io::parse_json(fixed, path.string());
  if (!j.is_object()) throw Error(path.string() + ": expected a JSON object");
  return j;
}

// Reads the keys of one diffusers scheduler class; errors name the file and the key.
class Reader {
 public:
  Reader(const io::JsonFile& j, SamplerKind kind) : j_(j), kind_(kind) {}

  template <typename T>
  T get(const std::string& key, T fallback) const {
    return j_.optional<T>(key, fallback);
  }
  bool has(const std::string& key) const { return j_.has(key); }
  std::string where(const std::string& key) const { return j_.path().string() + ": key '" + key + "'"; }

  [[noreturn]] void unknown(const std::string& key, const std::string& value, const std::string& expected) const {
    throw Error(where(key) + ": unknown value '" + value + "' (expected " + expected + ")");
  }
  [[noreturn]] void unsupported(const std::string& key, const std::string& value) const {
    throw Unsupported(where(key) + ": " + value + " is not supported by the " + std::string(sampler_name(kind_)) +
                      " sampler");
  }
  // A boolean feature flag that must stay off.
  void must_be_false(const std::string& key) const {
    if (get<bool>(key, false)) unsupported(key, "true");
  }

 private:
  const io::JsonFile& j_;
  SamplerKind kind_;
};

double read_number_or_infinity(const Reader& r, const io::JsonFile& j, const std::string& key, double fallback) {
  if (!r.has(key)) return fallback;
  const auto& v = j.json().at(key);
  if (v.is_string()) {
    const auto s = v.get<std::string>();
    if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
    if (s == "Infinity") return std::numeric_limits<double>::infinity();
  }
  return r.get<double>(key, fallback);
}

// FlowMatchEulerDiscreteScheduler's keys: a static shift or resolution-dependent shifting; the
// schedule variants it also offers (terminal shifting, inverted, Karras / exponential / beta
// sigmas, stochastic sampling) are not implemented.
SchedulerConfig resolve_flow(const io::JsonFile& j, const Reader& r) {
  SchedulerConfig c = SchedulerConfig::defaults(SamplerKind::FlowMatchEuler);
  c.num_train_timesteps = r.get<int>("num_train_timesteps", c.num_train_timesteps);
  c.shift = r.get<double>("shift", c.shift);
  c.use_dynamic_shifting = r.get<bool>("use_dynamic_shifting", false);
  c.base_shift = r.get<double>("base_shift", c.base_shift);
  c.max_shift = r.get<double>("max_shift", c.max_shift);
  c.base_image_seq_len = r.get<int>("base_image_seq_len", c.base_image_seq_len);
  c.max_image_seq_len = r.get<int>("max_image_seq_len", c.max_image_seq_len);
  c.time_shift_type = r.get<std::string>("time_shift_type", c.time_shift_type);
  if (c.time_shift_type != "exponential" && c.time_shift_type != "linear")
    r.unknown("time_shift_type", c.time_shift_type, "exponential or linear");
  for (const char* key : {"invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas",
                          "use_beta_sigmas", "stochastic_sampling"})
    r.must_be_false(key);
  if (r.has("shift_terminal") && r.get<double>("shift_terminal", 0) != 0)
    r.unsupported("shift_terminal", io::json_brief(j.json()["shift_terminal"]));
  c.validate(j.path().string());
  return c;
}

SchedulerConfig resolve(const io::JsonFile& j, SamplerKind kind) {
  const Reader r(j, kind);
  if (kind == SamplerKind::FlowMatchEuler) return resolve_flow(j, r);
  SchedulerConfig c = SchedulerConfig::defaults(kind);
  c.num_train_timesteps = r.get<int>("num_train_timesteps", c.num_train_timesteps);
  c.beta_start = r.get<double>("beta_start", c.beta_start);
  c.beta_end = r.get<double>("beta_end", c.beta_end);
  c.beta_schedule = r.get<std::string>("beta_schedule", c.beta_schedule);
  c.trained_betas = r.get<std::vector<double>>("trained_betas", {});
  if (c.trained_betas.empty()) {
    if (c.beta_schedule == "sigmoid" || c.beta_schedule == "laplace")
      r.unsupported("beta_schedule", "'" + c.beta_schedule + "'");
    if (c.beta_schedule != "linear" && c.beta_schedule != "scaled_linear" && c.beta_schedule != "squaredcos_cap_v2")
      r.unknown("beta_schedule", c.beta_schedule, "linear, scaled_linear or squaredcos_cap_v2");
  }
  const auto prediction = r.get<std::string>("prediction_type", "epsilon");
  if (auto p = parse_prediction(prediction)) c.prediction_type = *p;
  else if (prediction == "sample" || prediction == "original_sample" || prediction == "flow_prediction")
    r.unsupported("prediction_type", "'" + prediction + "'");
  else r.unknown("prediction_type", prediction, "epsilon or v_prediction");
  const auto spacing = r.get<std::string>("timestep_spacing", std::string(spacing_name(c.timestep_spacing)));
  if (auto s = parse_spacing(spacing)) c.timestep_spacing = *s;
  else r.unknown("timestep_spacing", spacing, "leading, trailing or linspace");
  c.steps_offset = r.get<int>("steps_offset", c.steps_offset);
  c.rescale_betas_zero_snr = r.get<bool>("rescale_betas_zero_snr", false);

  const auto sigma_schedule = [&] {
    // diffusers' Karras conversion reads sigma_min / sigma_max whenever the file has them.
    if (r.has("sigma_min")) c.sigma_min = r.get<double>("sigma_min", 0);
    if (r.has("sigma_max")) c.sigma_max = r.get<double>("sigma_max", 0);
    c.final_sigmas_type = r.get<std::string>("final_sigmas_type", c.final_sigmas_type);
    if (c.final_sigmas_type != "zero" && c.final_sigmas_type != "sigma_min")
      r.unknown("final_sigmas_type", c.final_sigmas_type, "zero or sigma_min");
    r.must_be_false("use_exponential_sigmas");
    r.must_be_false("use_beta_sigmas");
  };
  const auto clipping = [&] {
    c.clip_sample = r.get<bool>("clip_sample", c.clip_sample);
    c.clip_sample_range = r.get<double>("clip_sample_range", c.clip_sample_range);
    r.must_be_false("thresholding");
  };

  switch (kind) {
    case SamplerKind::Euler: {
      c.use_karras_sigmas = r.get<bool>("use_karras_sigmas", false);
      sigma_schedule();
      const auto interpolation = r.get<std::string>("interpolation_type", "linear");
      if (interpolation == "log_linear") r.unsupported("interpolation_type", "'log_linear'");
      if (interpolation != "linear") r.unknown("interpolation_type", interpolation, "linear or log_linear");
      const auto timestep_type = r.get<std::string>("timestep_type", "discrete");
      if (timestep_type != "discrete" && timestep_type != "continuous")
        r.unknown("timestep_type", timestep_type, "discrete or continuous");
      if (timestep_type == "continuous" && c.prediction_type == Prediction::VPrediction)
        r.unsupported("timestep_type", "'continuous' with v_prediction");
      break;
    }
    case SamplerKind::EulerAncestral:
    case SamplerKind::FlowMatchEuler:  // resolve_flow
      break;
    case SamplerKind::DDIM:
      clipping();
      c.set_alpha_to_one = r.get<bool>("set_alpha_to_one", c.set_alpha_to_one);
      break;
    case SamplerKind::DDPM: {
      clipping();
      c.variance_type = r.get<std::string>("variance_type", c.variance_type);
      const auto& v = c.variance_type;
      if (v == "fixed_large_log" || v == "learned" || v == "learned_range")
        r.unsupported("variance_type", "'" + v + "'");
      if (v != "fixed_small" && v != "fixed_small_log" && v != "fixed_large")
        r.unknown("variance_type", v, "fixed_small, fixed_small_log or fixed_large");
      break;
    }
    case SamplerKind::DPMPP2M:
    case SamplerKind::DPMPP2MKarras: {
      // The kind fixes the algorithm (dpmsolver++, second order) and the Karras choice.
      sigma_schedule();
      r.must_be_false("thresholding");
      r.must_be_false("use_lu_lambdas");
      r.must_be_false("use_flow_sigmas");
      c.lower_order_final = r.get<bool>("lower_order_final", c.lower_order_final);
      c.euler_at_final = r.get<bool>("euler_at_final", c.euler_at_final);
      c.solver_type = r.get<std::string>("solver_type", c.solver_type);
      if (c.solver_type == "logrho" || c.solver_type == "bh1" || c.solver_type == "bh2") c.solver_type = "midpoint";
      if (c.solver_type != "midpoint" && c.solver_type != "heun")
        r.unknown("solver_type", c.solver_type, "midpoint or heun");
      c.lambda_min_clipped = read_number_or_infinity(r, j, "lambda_min_clipped", c.lambda_min_clipped);
      break;
    }
  }
  c.validate(j.path().string());
  return c;
}

}  // namespace

std::optional<SamplerKind> parse_sampler(std::string_view name) {
  for (const auto& [kind, n] : kNames)
    if (n == name) return kind;
  return std::nullopt;
}

SamplerKind parse_sampler_or_throw(std::string_view name) {
  if (auto k = parse_sampler(name)) return *k;
  throw Error("unknown sampler '" + std::string(name) + "' (valid: " + join(sampler_names()) + ")");
}

std::string_view sampler_name(SamplerKind kind) {
  for (const auto& [k, n] : kNames)
    if (k == kind) return n;
  return "?";
}

std::vector<std::string> sampler_names() {
  std::vector<std::string> v;
  for (const auto& [k, n] : kNames) v.emplace_back(n);
  return v;
}

bool is_flow_matching(SamplerKind kind) { return kind == SamplerKind::FlowMatchEuler; }

std::optional<Prediction> parse_prediction(std::string_view name) {
  if (name == "epsilon") return Prediction::Epsilon;
  if (name == "v_prediction") return Prediction::VPrediction;
  return std::nullopt;
}

std::string_view prediction_name(Prediction p) { return p == Prediction::Epsilon ? "epsilon" : "v_prediction"; }

std::optional<Spacing> parse_spacing(std::string_view name) {
  if (name == "leading") return Spacing::Leading;
  if (name == "trailing") return Spacing::Trailing;
  if (name == "linspace") return Spacing::Linspace;
  return std::nullopt;
}

std::string_view spacing_name(Spacing s) {
  switch (s) {
    case Spacing::Leading: return "leading";
    case Spacing::Trailing: return "trailing";
    case Spacing::Linspace: return "linspace";
  }
  return "?";
}

SchedulerConfig SchedulerConfig::defaults(SamplerKind kind) {
  SchedulerConfig c;
  switch (kind) {
    case SamplerKind::Euler:
    case SamplerKind::EulerAncestral:
    case SamplerKind::DPMPP2M:
    case SamplerKind::FlowMatchEuler:
      break;
    case SamplerKind::DPMPP2MKarras:
      c.use_karras_sigmas = true;
      break;
    case SamplerKind::DDIM:
    case SamplerKind::DDPM:
      c.timestep_spacing = Spacing::Leading;
      break;
  }
  return c;
}

SchedulerConfig SchedulerConfig::from_json(const std::filesystem::path& path, SamplerKind kind) {
  return resolve(io::JsonFile(path, parse_lenient(path)), kind);
}

SchedulerConfig SchedulerConfig::from_json_text(const std::string& text, SamplerKind kind, const std::string& where) {
  return resolve(io::JsonFile(where, io::parse_json(text, where)), kind);
}

void SchedulerConfig::validate(const std::string& where) const {
  const auto fail = [&](const std::string& what) { throw Error(where + ": " + what); };
  if (num_train_timesteps < 2)
    fail("num_train_timesteps must be at least 2, got " + std::to_string(num_train_timesteps));
  if (!trained_betas.empty()) {
    if (static_cast<int>(trained_betas.size()) != num_train_timesteps)
      fail("trained_betas has " + std::to_string(trained_betas.size()) + " values but num_train_timesteps is " +
           std::to_string(num_train_timesteps));
    for (double b : trained_betas)
      if (!(b > 0 && b < 1)) fail("trained_betas holds " + std::to_string(b) + ", outside (0, 1)");
  } else {
    if (beta_schedule != "linear" && beta_schedule != "scaled_linear" && beta_schedule != "squaredcos_cap_v2")
      fail("unknown beta_schedule '" + beta_schedule + "' (expected linear, scaled_linear or squaredcos_cap_v2)");
    if (beta_schedule != "squaredcos_cap_v2" && !(beta_start > 0 && beta_end < 1 && beta_start <= beta_end))
      fail("beta_start " + std::to_string(beta_start) + " and beta_end " + std::to_string(beta_end) +
           " must satisfy 0 < beta_start <= beta_end < 1");
  }
  if (steps_offset < 0) fail("steps_offset must not be negative, got " + std::to_string(steps_offset));
  if (!(clip_sample_range > 0)) fail("clip_sample_range must be positive, got " + std::to_string(clip_sample_range));
  if (variance_type != "fixed_small" && variance_type != "fixed_small_log" && variance_type != "fixed_large")
    fail("unsupported variance_type '" + variance_type + "' (expected fixed_small, fixed_small_log or fixed_large)");
  if (final_sigmas_type != "zero" && final_sigmas_type != "sigma_min")
    fail("unknown final_sigmas_type '" + final_sigmas_type + "' (expected zero or sigma_min)");
  if (solver_type != "midpoint" && solver_type != "heun")
    fail("unknown solver_type '" + solver_type + "' (expected midpoint or heun)");
  for (auto [name, v] : {std::pair{"sigma_min", sigma_min}, {"sigma_max", sigma_max}})
    if (v && !(*v > 0)) fail(std::string(name) + " must be positive, got " + std::to_string(*v));
  if (!(shift > 0)) fail("shift must be positive, got " + std::to_string(shift));
  if (use_dynamic_shifting) {
    if (!(std::isfinite(base_shift) && std::isfinite(max_shift) && std::abs(base_shift) < 100 && std::abs(max_shift) < 100))
      fail("base_shift and max_shift must be numbers between -100 and 100");
    if (base_image_seq_len <= 0 || max_image_seq_len <= base_image_seq_len)
      fail("base_image_seq_len " + std::to_string(base_image_seq_len) + " and max_image_seq_len " +
           std::to_string(max_image_seq_len) + " must satisfy 0 < base < max");
    if (mu && !(std::isfinite(*mu) && (time_shift_type == "exponential" ? std::abs(*mu) < 50 : *mu > 0)))
      fail("the dynamic shift mu " + std::to_string(*mu) + " is out of range for a " + time_shift_type + " time shift");
  }
}

double SchedulerConfig::flow_mu(int64_t image_seq_len) const {
  const double m = (max_shift - base_shift) / (max_image_seq_len - base_image_seq_len);
  const double b = base_shift - m * base_image_seq_len;
  return static_cast<double>(image_seq_len) * m + b;
}

std::optional<SamplerKind> native_sampler(const std::filesystem::path& path) {
  const io::JsonFile j(path, parse_lenient(path));
  const auto cls = j.required<std::string>("_class_name");
  std::optional<SamplerKind> kind;
  if (cls == "EulerDiscreteScheduler") kind = SamplerKind::Euler;
  else if (cls == "EulerAncestralDiscreteScheduler") kind = SamplerKind::EulerAncestral;
  else if (cls == "DDIMScheduler") kind = SamplerKind::DDIM;
  else if (cls == "DDPMScheduler") kind = SamplerKind::DDPM;
  else if (cls == "FlowMatchEulerDiscreteScheduler") kind = SamplerKind::FlowMatchEuler;
  else if (cls == "DPMSolverMultistepScheduler") {
    const auto algorithm = j.optional<std::string>("algorithm_type", "dpmsolver++");
    if ((algorithm != "dpmsolver++" && algorithm != "deis") || j.optional<int>("solver_order", 2) != 2)
      return std::nullopt;
    kind = j.optional<bool>("use_karras_sigmas", false) ? SamplerKind::DPMPP2MKarras : SamplerKind::DPMPP2M;
  }
  if (!kind) return std::nullopt;
  try {
    resolve(j, *kind);
  } catch (const Unsupported&) {
    return std::nullopt;
  }
  return kind;
}

std::unique_ptr<Sampler> Sampler::create(SamplerKind kind, const SchedulerConfig& config, int n) {
  config.validate(std::string(sampler_name(kind)) + " sampler config");
  if (n < 1 || n > config.num_train_timesteps)
    throw Error(std::string(sampler_name(kind)) + " sampler: num_inference_steps " + std::to_string(n) +
                " must be between 1 and num_train_timesteps (" + std::to_string(config.num_train_timesteps) + ")");
  switch (kind) {
    case SamplerKind::Euler:
    case SamplerKind::EulerAncestral: return detail::make_euler(kind, config, n);
    case SamplerKind::DDIM: return detail::make_ddim(config, n);
    case SamplerKind::DDPM: return detail::make_ddpm(config, n);
    case SamplerKind::DPMPP2M:
    case SamplerKind::DPMPP2MKarras: return detail::make_dpm_solver(kind, config, n);
    case SamplerKind::FlowMatchEuler: return detail::make_flow_match_euler(config, n);
  }
  throw Error("unknown sampler kind");
}

Sampler::~Sampler() = default;

at::Tensor Sampler::scale_model_input(const at::Tensor& sample, int step) const {
  check_step(step);
  return sample;
}

void Sampler::reset() {}

void Sampler::check_step(int i) const {
  if (i < 0 || i >= num_steps())
    throw Error(std::string(sampler_name(kind_)) + " sampler: step " + std::to_string(i) + " is out of range (0.." +
                std::to_string(num_steps() - 1) + ")");
}

void Sampler::check_level(int i) const {
  if (i < 0 || i > num_steps())
    throw Error(std::string(sampler_name(kind_)) + " sampler: no noise level " + std::to_string(i) + " (it has 0.." +
                std::to_string(num_steps()) + ")");
}

void Sampler::check_jump(int i, int j) const {
  check_step(i);
  if (j <= i || j > num_steps())
    throw Error(std::string(sampler_name(kind_)) + " sampler: cannot jump from step " + std::to_string(i) +
                " to step " + std::to_string(j) + " (the target must be in " + std::to_string(i + 1) + ".." +
                std::to_string(num_steps()) + ")");
}

namespace detail {

at::Tensor upcast(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
}

at::Tensor noise_like(const at::Tensor& like, const at::Generator& generator) {
  if (!generator.defined()) return at::randn(like.sizes(), like.options());
  // A CPU generator draws on the CPU and the noise moves, so seeds give the same images anywhere.
  if (generator.device().is_cpu() && !like.device().is_cpu())
    return at::randn(like.sizes(), generator, like.options().device(at::kCPU)).to(like.device());
  return at::randn(like.sizes(), generator, like.options());
}

std::vector<double> sigma_space_alphas_cumprod(const SchedulerConfig& config) {
  auto ac = alphas_cumprod(config);
  if (config.rescale_betas_zero_snr) ac.back() = std::ldexp(1.0, -24);
  return ac;
}

void check_timesteps_in_range(const std::vector<double>& timesteps, const SchedulerConfig& c, SamplerKind kind) {
  for (double t : timesteps)
    if (t < 0 || t >= c.num_train_timesteps)
      throw Error(std::string(sampler_name(kind)) + " sampler: timestep " + std::to_string(static_cast<int64_t>(t)) +
                  " lies outside the training schedule (0.." + std::to_string(c.num_train_timesteps - 1) +
                  "); lower steps_offset (" + std::to_string(c.steps_offset) + ") or the number of steps (" +
                  std::to_string(timesteps.size()) + ")");
}

}  // namespace detail

at::Tensor blend_outside_mask(const Sampler& sampler, int i, const at::Tensor& latents, const at::Tensor& mask,
                              const at::Tensor& x0, const at::Tensor& noise) {
  const auto kept = i + 1 < sampler.num_steps() ? sampler.add_noise(x0, noise, i + 1) : x0;
  return (1 - mask) * kept + mask * latents;
}

}  // namespace diffract::schedulers
