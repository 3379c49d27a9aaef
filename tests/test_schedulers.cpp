#include <cmath>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/io/weights.h"
#include "core/schedulers/flow_match.h"
#include "core/schedulers/schedule.h"
#include "core/schedulers/sampler.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
using namespace diffract::schedulers;
namespace fs = std::filesystem;

namespace {

// Trajectories are float32 on both sides and the tensor operations are the same, but diffusers
// computes the scalar coefficients (sqrt(alpha), lambdas, exp(-h) - 1) in float32 and we in
// double: results differ by float32 ulps, which carry forward in absolute terms, so the scale is
// the largest sample seen so far. Observed: at most 2e-6 of it (DDPM, 25 steps); 1e-5 leaves room.
constexpr double kRtol = 1e-5;
// Sigmas are the same float32 numbers; the Karras timestep search may see a log-sigma one ulp off.
constexpr double kSigmaRtol = 1e-6;

// What make_scheduler_fixtures.py writes: the loops over its index check that they saw all of
// it, so a missing or cut-short index fails instead of leaving them nothing to compare.
constexpr int kCases = 197;          // trajectories: 192 of the six discrete-time samplers, 5 of flow Euler
constexpr int kDpmCases = 61;        // of them DPM++ 2M (35) and DPM++ 2M Karras (26)
constexpr int kJumps = 48;           // DDIM, DDPM x sd, linear x epsilon, v_prediction x 6 (i, j) pairs
constexpr int kSweepKeys = 1278;     // 6 kinds x 3 spacings x 71 step counts
constexpr int kFlowSweepKeys = 260;  // 4 shifts x 65 step counts
constexpr int kResolved = 30;        // 5 real configs x 6 kinds

fs::path dir() { return test::fixtures() / "schedulers"; }

const nlohmann::json& index() {
  static const nlohmann::json j = [] {
    std::ifstream in(dir() / "index.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

const io::StateDict& tensors(const std::string& file) {
  static std::map<std::string, io::StateDict> cache;
  auto it = cache.find(file);
  if (it == cache.end()) it = cache.emplace(file, io::load_state_dict(dir() / file)).first;
  return it->second;
}

at::Generator cpu_generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// The oracle's fake denoiser, in float32 as there (the flow one has no input scaling).
at::Tensor fake_model(const Sampler& s, const at::Tensor& x, int i) {
  return 0.3 * s.scale_model_input(x, i) + 0.05 * (s.timesteps()[i] / 1000.0);
}

double magnitude(const at::Tensor& t) { return t.to(at::kDouble).abs().max().item<double>(); }

// Empty when `got` matches `want` within rtol of `scale` (by default want's magnitude, at least 1).
std::string mismatch(const at::Tensor& got, const at::Tensor& want, double rtol, double scale = 0) {
  if (got.sizes() != want.sizes()) return "shape " + c10::str(got.sizes()) + " vs " + c10::str(want.sizes());
  scale = std::max({1.0, scale, magnitude(want)});
  const double d = test::max_abs_diff(got, want);
  if (d <= rtol * scale) return "";
  return "max |diff| " + std::to_string(d) + " > " + std::to_string(rtol * scale);
}

std::string mismatch(const std::vector<double>& got, const at::Tensor& want, double rtol) {
  return mismatch(at::tensor(at::ArrayRef<double>(got), at::kDouble), want, rtol);
}

#define EXPECT_MATCH(got, want, rtol, what, ...)                                            \
  do {                                                                                      \
    const std::string _m = mismatch((got), (want), (rtol), ##__VA_ARGS__);                  \
    QVERIFY2(_m.empty(), qPrintable(QString::fromStdString(std::string(what) + ": " + _m))); \
  } while (0)

std::unique_ptr<Sampler> sampler_for(const nlohmann::json& c) {
  const auto kind = *parse_sampler(c.at("kind").get<std::string>());
  const auto name = c.at("name").get<std::string>();
  return Sampler::create(kind, SchedulerConfig::from_json(dir() / "configs" / (name + ".json"), kind),
                         c.at("steps").get<int>());
}

const nlohmann::json& find_case(const std::string& name) {
  for (const auto& c : index().at("cases"))
    if (c.at("name") == name) return c;
  throw std::runtime_error("no fixture case " + name);
}

void write_json(const fs::path& path, const nlohmann::json& j) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << j.dump(1);
}

nlohmann::json sd_config(const std::string& cls) {
  return {{"_class_name", cls}, {"beta_schedule", "scaled_linear"}, {"beta_start", 0.00085}, {"beta_end", 0.012},
          {"num_train_timesteps", 1000}, {"steps_offset", 1}};
}

bool is_sigma_space(SamplerKind k) { return k != SamplerKind::DDIM && k != SamplerKind::DDPM; }

}  // namespace

class TestSchedulers : public QObject {
  Q_OBJECT
 private slots:
  void namesRoundTrip() {
    QCOMPARE(sampler_names().size(), size_t(7));
    QVERIFY(parse_sampler("flow-euler") == SamplerKind::FlowMatchEuler);
    QVERIFY(is_flow_matching(SamplerKind::FlowMatchEuler) && !is_flow_matching(SamplerKind::Euler));
    for (const auto& n : sampler_names()) QCOMPARE(std::string(sampler_name(*parse_sampler(n))), n);
    QVERIFY(parse_sampler("dpmpp-2m-karras") == SamplerKind::DPMPP2MKarras);
    QVERIFY(!parse_sampler("heun"));
    DIFFRACT_EXPECT_ERROR(parse_sampler_or_throw("heun"), "unknown sampler 'heun'", "euler, euler-ancestral, ddim",
                          "dpmpp-2m-karras");
  }

  // Our CPU generator and torch.Generator().manual_seed(s) draw the same initial noise.
  void generatorMatchesTorch() {
    int checked = 0;
    for (const auto& c : index().at("cases")) {
      const auto name = c.at("name").get<std::string>();
      const auto want = tensors("trajectories.safetensors").at(name + ".x")[0];
      const auto x = at::randn({1, 4, 8, 8}, cpu_generator(c.at("seed").get<uint64_t>()), at::kFloat) *
                     c.at("init_noise_sigma").get<double>();
      EXPECT_MATCH(x, want, 1e-6, name + " initial noise");
      ++checked;
    }
    QCOMPARE(checked, kCases);
  }

  void trajectoriesMatchDiffusers() {
    const auto& t = tensors("trajectories.safetensors");
    int checked = 0;
    for (const auto& c : index().at("cases")) {
      const auto name = c.at("name").get<std::string>();
      const auto s = sampler_for(c);
      QVERIFY2(s->num_steps() == c.at("num_steps").get<int>(), qPrintable(QString::fromStdString(name)));
      EXPECT_MATCH(s->timesteps(), t.at(name + ".timesteps"), 1e-7, name + " timesteps");
      if (is_sigma_space(s->kind())) EXPECT_MATCH(s->sigmas(), t.at(name + ".sigmas"), kSigmaRtol, name + " sigmas");
      else QVERIFY(s->sigmas().empty());
      QVERIFY2(std::abs(s->init_noise_sigma() - c.at("init_noise_sigma").get<double>()) <=
                   1e-6 * c.at("init_noise_sigma").get<double>(),
               qPrintable(QString::fromStdString(name + " init_noise_sigma")));

      const auto xs = t.at(name + ".x"), x0s = t.at(name + ".x0");
      auto gen = cpu_generator(c.at("seed").get<uint64_t>() + 1);
      at::Tensor x = xs[0];
      double seen = 0;  // rounding errors carry forward, relative to the largest sample so far
      for (int i = 0; i < s->num_steps(); ++i) {
        seen = std::max(seen, magnitude(xs[i]));
        const auto mo = fake_model(*s, x, i);
        EXPECT_MATCH(s->predict_x0(mo, i, x), x0s[i], kRtol, name + " x0 at step " + std::to_string(i), seen);
        x = s->step(mo, i, x, gen);
        EXPECT_MATCH(x, xs[i + 1], kRtol, name + " after step " + std::to_string(i), seen);
      }
      ++checked;
    }
    QCOMPARE(checked, kCases);
  }

  // Timesteps and sigmas for many step counts. For the few counts where diffusers' trailing
  // spacing adds a spurious last timestep of -1 (61, 103, ...) we keep the n real ones.
  void schedulesMatchOverStepCounts() {
    const auto& sw = tensors("sweep.safetensors");
    const auto& uneven = index().at("sweep").at("uneven");
    int checked = 0;
    for (const auto& kind_name : sampler_names()) {
      const auto kind = *parse_sampler(kind_name);
      if (is_flow_matching(kind)) continue;  // flowSchedulesMatchOverStepCounts
      for (auto spacing : {Spacing::Leading, Spacing::Trailing, Spacing::Linspace}) {
        auto cfg = SchedulerConfig::defaults(kind);
        cfg.beta_schedule = "scaled_linear";
        cfg.beta_start = 0.00085;
        cfg.beta_end = 0.012;
        cfg.steps_offset = 1;
        cfg.set_alpha_to_one = false;
        cfg.clip_sample = false;
        cfg.timestep_spacing = spacing;
        for (int n : index().at("sweep").at("counts").get<std::vector<int>>()) {
          const auto key = kind_name + "." + std::string(spacing_name(spacing)) + "." + std::to_string(n);
          ++checked;
          auto want_t = sw.at(key + ".timesteps");
          if (!is_sigma_space(kind) && want_t.max().item<double>() >= cfg.num_train_timesteps) {
            DIFFRACT_EXPECT_ERROR(Sampler::create(kind, cfg, n), "timestep 1000 lies outside", "steps_offset (1)");
            continue;
          }
          const auto s = Sampler::create(kind, cfg, n);
          const bool spurious = std::find(uneven.begin(), uneven.end(), key) != uneven.end();
          QVERIFY2(s->num_steps() == want_t.size(0) - (spurious ? 1 : 0), qPrintable(QString::fromStdString(key)));
          want_t = want_t.slice(0, 0, s->num_steps());
          EXPECT_MATCH(s->timesteps(), want_t, 0, key + " timesteps");
          if (is_sigma_space(kind)) {
            auto want_s = sw.at(key + ".sigmas");
            if (spurious) want_s = at::cat({want_s.slice(0, 0, s->num_steps()), want_s.slice(0, -1)});
            EXPECT_MATCH(s->sigmas(), want_s, kSigmaRtol, key + " sigmas");
          }
        }
      }
    }
    QCOMPARE(checked, kSweepKeys);
  }

  // FlowMatchEulerDiscreteScheduler's sigmas and timesteps for many step counts and shifts.
  void flowSchedulesMatchOverStepCounts() {
    const auto& sw = tensors("flow_sweep.safetensors");
    const auto& j = index().at("flow_sweep");
    int checked = 0;
    for (double shift : j.at("shifts").get<std::vector<double>>()) {
      auto cfg = SchedulerConfig::defaults(SamplerKind::FlowMatchEuler);
      cfg.shift = shift;
      for (int n : j.at("counts").get<std::vector<int>>()) {
        std::ostringstream key;
        key << "flow-euler." << std::fixed << std::setprecision(1) << shift << "." << n;
        const auto s = Sampler::create(SamplerKind::FlowMatchEuler, cfg, n);
        QCOMPARE(s->num_steps(), n);
        QCOMPARE(s->init_noise_sigma(), 1.0);
        EXPECT_MATCH(s->timesteps(), sw.at(key.str() + ".timesteps"), 0, key.str() + " timesteps");
        EXPECT_MATCH(s->sigmas(), sw.at(key.str() + ".sigmas"), 0, key.str() + " sigmas");
        ++checked;
      }
    }
    QCOMPARE(checked, kFlowSweepKeys);
    // The shift formula itself, and the SD3 folder's scheduler_config.json.
    QCOMPARE(flow_shift(0.5, 3.0), 0.75);
    QCOMPARE(flow_shift(0.25, 1.0), 0.25);
    const auto sd3 = dir() / "real" / "sd3" / "scheduler_config.json";
    QVERIFY(native_sampler(sd3) == SamplerKind::FlowMatchEuler);
    const auto c = SchedulerConfig::from_json(sd3, SamplerKind::FlowMatchEuler);
    QCOMPARE(c.shift, 3.0);
    QCOMPARE(c.num_train_timesteps, 1000);
  }

  // Flux's schedules: the pipeline's linspace sigmas with the resolution-dependent shift (dev, and
  // its linear variant), without it (schnell), and the training schedule under a time shift.
  void fluxSchedulesMatch() {
    const auto& sw = tensors("flow_sweep.safetensors");
    std::ifstream in(dir() / "flux_schedules.json");
    const auto cases = nlohmann::json::parse(in);
    QVERIFY(cases.size() >= 90);
    for (const auto& k : cases) {
      const auto key = k.at("key").get<std::string>();
      auto cfg = SchedulerConfig::from_json_text(k.at("config").dump(), SamplerKind::FlowMatchEuler, key);
      cfg.linear_sigmas = k.at("linear_sigmas").get<bool>();
      if (!k.at("mu").is_null()) {
        QVERIFY(cfg.use_dynamic_shifting);
        const double mu = cfg.flow_mu(k.at("image_seq_len").get<int64_t>());
        QVERIFY2(std::abs(mu - k.at("mu").get<double>()) < 1e-12, key.c_str());
        cfg.mu = mu;
      }
      const auto s = Sampler::create(SamplerKind::FlowMatchEuler, cfg, k.at("steps").get<int>());
      EXPECT_MATCH(s->timesteps(), sw.at(key + ".timesteps"), 0, key + " timesteps");
      EXPECT_MATCH(s->sigmas(), sw.at(key + ".sigmas"), 0, key + " sigmas");
    }
    auto dev = SchedulerConfig::from_json_text(cases.at(0).at("config").dump(), SamplerKind::FlowMatchEuler, "dev");
    DIFFRACT_EXPECT_ERROR(Sampler::create(SamplerKind::FlowMatchEuler, dev, 4), "use_dynamic_shifting",
                          "gave no mu");
    dev.mu = 1e6;
    DIFFRACT_EXPECT_ERROR(Sampler::create(SamplerKind::FlowMatchEuler, dev, 4), "mu", "out of range");
  }

  // Flow Euler's jump is the straight line along v, from any step to any later one.
  void flowJumpIsLinearInSigma() {
    const auto& t = tensors("trajectories.safetensors");
    const auto s = sampler_for(find_case("flow-euler.sd3.28"));
    const auto xs = t.at("flow-euler.sd3.28.x");
    const int n = s->num_steps();
    for (auto [i, j] : {std::pair{0, 1}, {0, 5}, {3, 17}, {10, n}, {n - 1, n}, {0, n}}) {
      const auto v = fake_model(*s, xs[i], i);
      const auto want = xs[i].to(at::kDouble) + (s->sigmas()[j] - s->sigmas()[i]) * v.to(at::kDouble);
      const auto got = s->jump(v, i, j, xs[i], {});
      EXPECT_MATCH(got, want, 1e-6, "jump " + std::to_string(i) + " -> " + std::to_string(j));
      QVERIFY(at::equal(got, flow_match_transition(xs[i], v, s->sigmas()[i], s->sigmas()[j])));
      if (j == n) QVERIFY(at::allclose(got, s->predict_x0(v, i, xs[i]), 1e-5, 1e-6));
    }
  }

  void fromJsonMatchesDiffusersDefaults() {
    int checked = 0;
    for (const auto& [real, by_kind] : index().at("resolved").items()) {
      const auto path = dir() / "real" / real / "scheduler_config.json";
      for (const auto& [kind_name, want] : by_kind.items()) {
        const auto kind = *parse_sampler(kind_name);
        const auto c = SchedulerConfig::from_json(path, kind);
        const auto what = real + " / " + kind_name + ": ";
        const auto check = [&](const std::string& key, const nlohmann::json& got) {
          if (!want.contains(key)) return;
          QVERIFY2(got == want.at(key), qPrintable(QString::fromStdString(what + key + " = " + got.dump() +
                                                                           ", diffusers " + want.at(key).dump())));
        };
        check("num_train_timesteps", c.num_train_timesteps);
        check("beta_start", c.beta_start);
        check("beta_end", c.beta_end);
        check("beta_schedule", c.beta_schedule);
        check("prediction_type", std::string(prediction_name(c.prediction_type)));
        check("timestep_spacing", std::string(spacing_name(c.timestep_spacing)));
        check("steps_offset", c.steps_offset);
        check("rescale_betas_zero_snr", c.rescale_betas_zero_snr);
        check("set_alpha_to_one", c.set_alpha_to_one);
        check("clip_sample", c.clip_sample);
        check("clip_sample_range", c.clip_sample_range);
        if (kind == SamplerKind::DDPM) check("variance_type", c.variance_type);
        // Plain DPM++ 2M is never Karras, whatever the file says (the Karras kind is).
        if (kind != SamplerKind::DPMPP2M) check("use_karras_sigmas", c.use_karras_sigmas);
        else QVERIFY(!c.use_karras_sigmas);
        check("sigma_min", c.sigma_min ? nlohmann::json(*c.sigma_min) : nlohmann::json());
        check("sigma_max", c.sigma_max ? nlohmann::json(*c.sigma_max) : nlohmann::json());
        check("final_sigmas_type", c.final_sigmas_type);
        check("lower_order_final", c.lower_order_final);
        check("euler_at_final", c.euler_at_final);
        check("solver_type", c.solver_type);
        check("lambda_min_clipped", std::isinf(c.lambda_min_clipped) ? nlohmann::json("-inf")
                                                                      : nlohmann::json(c.lambda_min_clipped));
        // What these samplers always do must be what diffusers resolved.
        check("interpolation_type", "linear");
        check("timestep_type", "discrete");
        check("thresholding", false);
        check("solver_order", 2);
        check("algorithm_type", "dpmsolver++");
        ++checked;
      }
    }
    QCOMPARE(checked, kResolved);
  }

  void nativeSampler() {
    const auto real = [](const char* name) { return dir() / "real" / name / "scheduler_config.json"; };
    QVERIFY(!native_sampler(real("sd15")));  // PNDMScheduler
    QVERIFY(!native_sampler(real("lms")));
    QVERIFY(native_sampler(real("sdxl")) == SamplerKind::Euler);
    QVERIFY(native_sampler(real("sd21v")) == SamplerKind::DDIM);
    QVERIFY(native_sampler(real("dpm_karras")) == SamplerKind::DPMPP2MKarras);

    QTemporaryDir tmp;
    const fs::path d = tmp.path().toStdString();
    const auto with = [&](const std::string& name, nlohmann::json j) {
      write_json(d / name / "scheduler_config.json", j);
      return d / name / "scheduler_config.json";
    };
    auto dpm = sd_config("DPMSolverMultistepScheduler");
    QVERIFY(native_sampler(with("dpm", dpm)) == SamplerKind::DPMPP2M);
    dpm["algorithm_type"] = "sde-dpmsolver++";
    QVERIFY(!native_sampler(with("sde", dpm)));
    dpm["algorithm_type"] = "dpmsolver++";
    dpm["solver_order"] = 3;
    QVERIFY(!native_sampler(with("order3", dpm)));
    auto ddim = sd_config("DDIMScheduler");
    ddim["thresholding"] = true;
    QVERIFY(!native_sampler(with("thresholding", ddim)));
    auto euler = sd_config("EulerDiscreteScheduler");
    euler["use_exponential_sigmas"] = true;
    QVERIFY(!native_sampler(with("exponential", euler)));
    QVERIFY(native_sampler(with("ancestral", sd_config("EulerAncestralDiscreteScheduler"))) ==
            SamplerKind::EulerAncestral);
    QVERIFY(native_sampler(with("ddpm", sd_config("DDPMScheduler"))) == SamplerKind::DDPM);
    DIFFRACT_EXPECT_ERROR(native_sampler(with("noclass", {{"beta_start", 0.001}})), "scheduler_config.json",
                          "missing key '_class_name'");
    DIFFRACT_EXPECT_ERROR(native_sampler(d / "absent" / "scheduler_config.json"), "scheduler_config.json", "missing");

    // diffusers saves lambda_min_clipped = -inf as the bare token -Infinity.
    fs::create_directories(d / "inf");
    std::ofstream(d / "inf" / "scheduler_config.json")
        << R"({"_class_name": "DPMSolverMultistepScheduler", "lambda_min_clipped": -Infinity, "solver_type": "heun"})";
    QVERIFY(native_sampler(d / "inf" / "scheduler_config.json") == SamplerKind::DPMPP2M);
    const auto c = SchedulerConfig::from_json(d / "inf" / "scheduler_config.json", SamplerKind::DPMPP2M);
    QVERIFY(std::isinf(c.lambda_min_clipped) && c.lambda_min_clipped < 0);
    QCOMPARE(c.solver_type, std::string("heun"));
  }

  // Single-step samplers: a jump to the next step is the step itself, bit for bit.
  void jumpToNextEqualsStep() {
    const auto& t = tensors("trajectories.safetensors");
    int checked = 0;
    for (const auto& c : index().at("cases")) {
      const auto name = c.at("name").get<std::string>();
      const auto a = sampler_for(c), b = sampler_for(c);
      if (a->kind() == SamplerKind::DPMPP2M || a->kind() == SamplerKind::DPMPP2MKarras) continue;
      const auto xs = t.at(name + ".x");
      for (int i = 0; i < a->num_steps(); ++i) {
        const auto mo = fake_model(*a, xs[i], i);
        const auto stepped = a->step(mo, i, xs[i], cpu_generator(9 + i));
        const auto jumped = b->jump(mo, i, i + 1, xs[i], cpu_generator(9 + i));
        QVERIFY2(at::equal(stepped, jumped), qPrintable(QString::fromStdString(name + " step " + std::to_string(i))));
      }
      ++checked;
    }
    QCOMPARE(checked, kCases - kDpmCases);
  }

  void ddimAndDdpmJumpsMatchClosedForm() {
    const auto& t = tensors("trajectories.safetensors");
    const auto& want = tensors("jumps.safetensors");
    QCOMPARE(static_cast<int>(index().at("jumps").size()), kJumps);
    for (const auto& jmp : index().at("jumps")) {
      const auto key = jmp.at("key").get<std::string>();
      const auto s = sampler_for(find_case(jmp.at("case").get<std::string>()));
      const int i = jmp.at("i"), j = jmp.at("j");
      const auto x = t.at(jmp.at("case").get<std::string>() + ".x")[i];
      const auto got = s->jump(fake_model(*s, x, i), i, j, x, cpu_generator(jmp.at("seed").get<uint64_t>()));
      EXPECT_MATCH(got, want.at(key), kRtol, key);
    }
  }

  // DPM++ 2M: jumps between steps leave the multistep history alone; reset() restarts it.
  void dpmJumpKeepsHistory() {
    const auto& t = tensors("trajectories.safetensors");
    int checked = 0;
    for (const auto& c : index().at("cases")) {
      const auto name = c.at("name").get<std::string>();
      const auto s = sampler_for(c);
      if (s->kind() != SamplerKind::DPMPP2M && s->kind() != SamplerKind::DPMPP2MKarras) continue;
      const auto xs = t.at(name + ".x");
      const int n = s->num_steps();
      for (int round = 0; round < 2; ++round) {
        at::Tensor x = xs[0];
        for (int i = 0; i < n; ++i) {
          const auto mo = fake_model(*s, x, i);
          s->jump(mo, i, n, x, {});
          s->jump(mo, i, std::min(i + 3, n), x, {});
          x = s->step(mo, i, x, {});
          EXPECT_MATCH(x, xs[i + 1], kRtol, name + " after step " + std::to_string(i), magnitude(xs[i]));
        }
        s->reset();
      }
      // From a fresh history the first step is first order, i.e. the jump to step 1.
      const auto fresh = sampler_for(c);
      const auto mo = fake_model(*fresh, xs[0], 0);
      QVERIFY(at::equal(fresh->jump(mo, 0, 1, xs[0], {}), fresh->step(mo, 0, xs[0], {})));
      // The final sigma is 0 here, so a jump to the end lands on the x0 prediction.
      if (fresh->sigmas().back() == 0)
        EXPECT_MATCH(fresh->jump(mo, 0, n, xs[0], {}), fresh->predict_x0(mo, 0, xs[0]), 1e-6, name + " jump to end");
      ++checked;
    }
    QCOMPARE(checked, kDpmCases);
  }

  void halfPrecisionComesBackHalf() {
    for (const auto& kind_name : sampler_names()) {
      const auto kind = *parse_sampler(kind_name);
      const auto s = Sampler::create(kind, SchedulerConfig::defaults(kind), 10);
      const auto x = at::randn({1, 4, 8, 8}, cpu_generator(1), at::kFloat);
      const auto full = s->step(0.3 * x, 0, x, cpu_generator(2));
      const auto half = s->step((0.3 * x).to(at::kHalf), 0, x, cpu_generator(2));
      QCOMPARE(half.scalar_type(), at::kHalf);
      // The stochastic ones draw their noise in half precision too, as diffusers does.
      if (kind != SamplerKind::EulerAncestral && kind != SamplerKind::DDPM)
        EXPECT_MATCH(half, full, 2e-3, kind_name + " half");
    }
  }

  void rejectsBadInput() {
    const auto cfg = SchedulerConfig::defaults(SamplerKind::Euler);
    DIFFRACT_EXPECT_ERROR(Sampler::create(SamplerKind::Euler, cfg, 0), "num_inference_steps 0",
                          "between 1 and num_train_timesteps (1000)");
    DIFFRACT_EXPECT_ERROR(Sampler::create(SamplerKind::DDIM, SchedulerConfig::defaults(SamplerKind::DDIM), 1001),
                          "ddim sampler", "num_inference_steps 1001");
    auto bad = cfg;
    bad.beta_schedule = "cosine";
    DIFFRACT_EXPECT_ERROR(Sampler::create(SamplerKind::Euler, bad, 10), "unknown beta_schedule 'cosine'");
    bad = cfg;
    bad.trained_betas = {0.1, 0.2};
    DIFFRACT_EXPECT_ERROR(Sampler::create(SamplerKind::Euler, bad, 10), "trained_betas has 2 values",
                          "num_train_timesteps is 1000");

    const auto s = Sampler::create(SamplerKind::DDIM, SchedulerConfig::defaults(SamplerKind::DDIM), 10);
    const auto x = at::zeros({1, 4, 8, 8});
    DIFFRACT_EXPECT_ERROR(s->jump(x, 3, 3, x, {}), "ddim sampler", "cannot jump from step 3 to step 3", "4..10");
    DIFFRACT_EXPECT_ERROR(s->jump(x, 3, 2, x, {}), "cannot jump from step 3 to step 2");
    DIFFRACT_EXPECT_ERROR(s->jump(x, 3, 11, x, {}), "cannot jump from step 3 to step 11");
    DIFFRACT_EXPECT_ERROR(s->jump(x, -1, 2, x, {}), "step -1 is out of range (0..9)");
    DIFFRACT_EXPECT_ERROR(s->step(x, 10, x, {}), "step 10 is out of range (0..9)");
    DIFFRACT_EXPECT_ERROR(s->scale_model_input(x, 10), "step 10 is out of range");

    QTemporaryDir tmp;
    const fs::path d = tmp.path().toStdString();
    const auto with = [&](const std::string& key, const nlohmann::json& value) {
      auto j = sd_config("EulerDiscreteScheduler");
      j[key] = value;
      write_json(d / key / "scheduler_config.json", j);
      return d / key / "scheduler_config.json";
    };
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(with("beta_schedule", "cosine"), SamplerKind::Euler),
                          "scheduler_config.json", "key 'beta_schedule'", "unknown value 'cosine'",
                          "linear, scaled_linear or squaredcos_cap_v2");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(with("prediction_type", "x0"), SamplerKind::DDIM),
                          "scheduler_config.json", "key 'prediction_type'", "unknown value 'x0'");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(with("timestep_spacing", "middle"), SamplerKind::DPMPP2M),
                          "scheduler_config.json", "key 'timestep_spacing'", "unknown value 'middle'",
                          "leading, trailing or linspace");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(with("steps_offset", "one"), SamplerKind::Euler),
                          "scheduler_config.json", "key 'steps_offset' must be");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(with("thresholding", true), SamplerKind::DDPM),
                          "key 'thresholding'", "true is not supported by the ddpm sampler");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(with("variance_type", "learned_range"), SamplerKind::DDPM),
                          "key 'variance_type'", "'learned_range' is not supported");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(with("final_sigmas_type", "one"), SamplerKind::Euler),
                          "key 'final_sigmas_type'", "unknown value 'one'");
    const auto flow_with = [&](const std::string& key, const nlohmann::json& value) {
      nlohmann::json j = {{"_class_name", "FlowMatchEulerDiscreteScheduler"}, {"shift", 3.0}};
      j[key] = value;
      write_json(d / ("flow_" + key) / "scheduler_config.json", j);
      return d / ("flow_" + key) / "scheduler_config.json";
    };
    const auto flow = SamplerKind::FlowMatchEuler;
    QVERIFY(SchedulerConfig::from_json(flow_with("use_dynamic_shifting", true), flow).use_dynamic_shifting);
    QVERIFY(native_sampler(flow_with("use_dynamic_shifting", true)) == flow);
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(flow_with("time_shift_type", "cubic"), flow),
                          "key 'time_shift_type'", "unknown value 'cubic'");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(flow_with("invert_sigmas", true), flow),
                          "key 'invert_sigmas'", "not supported by the flow-euler sampler");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(flow_with("shift", -1.0), flow),
                          "scheduler_config.json", "shift must be positive");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(flow_with("shift", "three"), flow),
                          "key 'shift' must be");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(with("trained_betas", {0.1, 0.2}), SamplerKind::Euler),
                          "scheduler_config.json", "trained_betas has 2 values");
    DIFFRACT_EXPECT_ERROR(SchedulerConfig::from_json(d / "nowhere.json", SamplerKind::Euler), "nowhere.json",
                          "missing");
    // A key of another class is none of this class's business, as in diffusers.
    const auto c = SchedulerConfig::from_json(with("variance_type", "learned_range"), SamplerKind::Euler);
    QCOMPARE(c.beta_schedule, std::string("scaled_linear"));
    // diffusers accepts steps_offset 1 with 1000 leading steps, then indexes past alphas_cumprod.
    auto ddim = SchedulerConfig::defaults(SamplerKind::DDIM);
    ddim.steps_offset = 1;
    DIFFRACT_EXPECT_ERROR(Sampler::create(SamplerKind::DDIM, ddim, 1000), "timestep 1000 lies outside");
  }
};

QTEST_GUILESS_MAIN(TestSchedulers)
#include "test_schedulers.moc"
