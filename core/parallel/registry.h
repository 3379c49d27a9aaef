#pragma once
// The strategy registry: one entry per multi-device strategy, the only place that knows their
// names. make_strategy, device choice (engine/devices.h), presets, the pipelines, the CLI's
// --help and the GUI's list all read it. No torch headers: the GUI includes this.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/job/model_family.h"
#include "core/job/request.h"

namespace diffract::parallel {

class Strategy;

// Where a strategy plugs in (docs/DESIGN.md): which (x, t) the sampler asks for, where each
// evaluation runs, or how one evaluation is split inside the network.
enum class Level { Loop, Evaluation, Model };

// The typed parameters a strategy takes (job::StrategyParams' fields).
enum class Param { Devices, Skip, Patches, CacheThreshold };

// How many devices a strategy runs on: exactly `fixed` (when above 0), else at least `min` and a
// multiple of `multiple`.
struct DeviceRule {
  int fixed = 0;
  int min = 1;
  int multiple = 1;
  bool allows(int devices) const {
    return fixed > 0 ? devices == fixed : devices >= min && devices % multiple == 0;
  }
  // The most devices the rule allows out of `available` (0 when none).
  int most_of(int available) const;
  std::string describe() const;  // "2 devices", "1 or more devices", "an even number of devices, 2 or more"
};

// Why a strategy refuses image inputs (an init image, a mask) unless its entry says otherwise.
inline constexpr std::string_view kNoImageInputs =
    "its loop starts from pure noise at the schedule's first step and keeps no mask, where image-to-image and "
    "inpainting start later in the schedule and blend the mask after every step; run image jobs on one device "
    "(single)";

// Why a strategy refuses ControlNets unless its entry says otherwise.
inline constexpr std::string_view kNoControlNets =
    "it splits the UNet's evaluation (into layers, stages or image bands), and a ControlNet's residuals join whole "
    "evaluations only; use single, cfg-parallel, data-parallel, step-skip or a driffusion variant";

struct StrategyInfo {
  std::string_view name;
  std::string_view hint;      // one line in plain words, for --help and tooltips
  Level level;
  bool unet = true;           // runs SD 1.x / 2.x / XL (a UNet)
  bool transformer = true;    // runs SD3 (an MMDiT) and Flux.1
  std::string_view refused_why;  // why the other families are refused
  bool needs_cfg = false;     // needs classifier-free guidance (a CFG scale above 1)
  bool exact = true;          // the same result as one device (up to rounding)
  DeviceRule devices;
  std::vector<Param> params;  // the parameters it reads besides its name
  std::unique_ptr<Strategy> (*make)(const job::StrategyParams&) = nullptr;
  std::string_view image_refused_why = kNoImageInputs;  // empty: takes an init image and a mask
  std::string_view controlnet_refused_why = kNoControlNets;  // empty: runs ControlNets
  double default_cache_threshold = 0;  // CacheThreshold: the threshold a job gets unless it gives one
  std::string_view threshold_hint;     // CacheThreshold: what the threshold does, for tooltips

  bool takes(Param p) const;
  bool runs(job::ModelFamily family) const;
};

// Every strategy, "single" first, in the order lists show them.
const std::vector<StrategyInfo>& strategies();
// The entry for `name` ("" is "single"); asyncdiff-stride<S> for any S finds AsyncDiff's
// stride entry. Null when there is none.
const StrategyInfo* find_strategy(std::string_view name);
// The threshold a job's step cache runs with: its own, or (negative) the strategy's default.
double cache_threshold(const job::StrategyParams& params);
// The same, or a diffract::Error naming the unknown strategy and listing the known ones.
const StrategyInfo& strategy_info(std::string_view name);
// "single, cfg-parallel, ...": every name, for messages.
std::string strategy_names();

// Checks a job's strategy against its entry before any work starts: the family, CFG, the device
// count and the parameters. Throws diffract::Error saying which and why.
void check_strategy(const job::StrategyParams& params, job::ModelFamily family, bool cfg);
// Throws diffract::Error saying why when the strategy `name` cannot run a job with an init image
// (and a mask, when `mask`).
void check_image_inputs(std::string_view name, bool mask);
// Throws diffract::Error saying why when the strategy `name` cannot run a job with ControlNets.
void check_controlnets(std::string_view name);
// The strategy, made and checked against `params` (not against a family or CFG).
std::unique_ptr<Strategy> make_strategy(const job::StrategyParams& params);
// Shorthand: `name` on `n` devices (step-skip: skip factor `n`; pipefusion: `patches` patches).
std::unique_ptr<Strategy> make_strategy(const std::string& name, int n, int patches = 0);

}  // namespace diffract::parallel
