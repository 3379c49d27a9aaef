#include "core/parallel/registry.h"

#include <algorithm>

#include "core/parallel/strategies.h"
#include "core/util/error.h"
#include "core/util/options.h"

namespace diffract::parallel {

namespace {

using job::StrategyParams;

std::unique_ptr<Strategy> make_single(const StrategyParams&) { return std::make_unique<SingleDevice>(); }
std::unique_ptr<Strategy> make_cfg_parallel(const StrategyParams&) { return std::make_unique<CfgParallel>(); }
std::unique_ptr<Strategy> make_hybrid_cfg(const StrategyParams&) { return std::make_unique<HybridCfg>(); }

std::unique_ptr<Strategy> make_driffusion(const StrategyParams& p) {
  auto s = std::make_unique<DRiffusion>();
  s->cfg_split = p.name.rfind("cfg-", 0) == 0;
  if (s->cfg_split && (p.devices < 2 || p.devices % 2 != 0))
    throw Error(p.name + " runs each draft's prompt and negative prompt on a pair of devices: it needs an even "
                "number of devices, 2 or more, not " + std::to_string(p.devices));
  s->n = s->cfg_split ? p.devices / 2 : p.devices;
  s->mode = p.name.find("aggressive") == std::string::npos ? DRiffusion::Mode::Conservative
                                                           : DRiffusion::Mode::Aggressive;
  s->pair_branches = options::flag(options::Id::DriffusionPairs);
  return s;
}

std::unique_ptr<Strategy> make_data_parallel(const StrategyParams& p) {
  auto s = std::make_unique<DataParallel>();
  s->n = p.devices;
  return s;
}

std::unique_ptr<Strategy> make_sequence_parallel(const StrategyParams& p) {
  auto s = std::make_unique<SequenceParallel>();
  s->n = p.devices;
  return s;
}

// The step caches and their cfg- (the CFG branches on two devices) and dp- (the batch over the
// devices) variants.
void set_split(StepCaching& s, const StrategyParams& p) {
  if (p.name.rfind("cfg-", 0) == 0) s.split = CacheSplit::Cfg;
  if (p.name.rfind("dp-", 0) == 0) {
    s.split = CacheSplit::Batch;
    s.n = p.devices;
  }
}

std::unique_ptr<Strategy> make_first_block_cache(const StrategyParams& p) {
  auto s = std::make_unique<FirstBlockCaching>();
  s->threshold = cache_threshold(p);
  set_split(*s, p);
  return s;
}

std::unique_ptr<Strategy> make_teacache(const StrategyParams& p) {
  auto s = std::make_unique<TeaCaching>();
  s->threshold = cache_threshold(p);
  set_split(*s, p);
  return s;
}

std::unique_ptr<Strategy> make_deepcache(const StrategyParams& p) {
  auto s = std::make_unique<DeepCaching>();
  s->interval = p.skip;
  s->branch = std::stoi(options::value(options::Id::DeepCacheBranch));
  set_split(*s, p);
  return s;
}

std::unique_ptr<Strategy> make_step_skip(const StrategyParams& p) {
  auto s = std::make_unique<StepSkipping>();
  s->skip = p.skip;
  return s;
}

std::unique_ptr<Strategy> make_pipefusion(const StrategyParams& p) {
  auto s = std::make_unique<PipeFusion>();
  s->cfg_split = p.name == "cfg-pipefusion";
  if (s->cfg_split && (p.devices < 2 || p.devices % 2 != 0))
    throw Error("cfg-pipefusion runs one pipeline for the prompt and one for the negative prompt, each over half "
                "the devices: it needs an even number of devices, 2 or more, not " + std::to_string(p.devices));
  s->n = s->cfg_split ? p.devices / 2 : p.devices;
  s->patches = p.patches;
  return s;
}

constexpr std::string_view kStridePrefix = "asyncdiff-stride";

std::unique_ptr<Strategy> make_asyncdiff(const StrategyParams& p) {
  auto s = std::make_unique<AsyncDiff>();
  if (p.name.rfind(kStridePrefix, 0) != 0) {
    s->n = p.devices;
    return s;
  }
  const std::string digits = p.name.substr(kStridePrefix.size());
  if (digits.empty() || digits.size() > 3 || digits.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(digits) < 1)
    throw Error("strategy '" + p.name + "': the stride after asyncdiff-stride must be a whole number 1 or more");
  s->stride = std::stoi(digits);
  s->n = p.devices - (s->stride - 1);  // the last component also runs on stride - 1 more devices
  if (s->n < 2)
    throw Error(p.name + " runs 2 or more UNet components on components + " + std::to_string(s->stride - 1) +
                " devices: it needs " + std::to_string(s->stride + 1) + " or more devices, not " +
                std::to_string(p.devices));
  return s;
}

std::unique_ptr<Strategy> make_distrifusion(const StrategyParams& p) {
  auto s = std::make_unique<DistriFusion>();
  s->n = p.devices;
  return s;
}

constexpr std::string_view kUNetOnly =
    "it splits a UNet's layers, and SD3's and Flux's denoisers are transformers (use cfg-parallel, pipefusion or "
    "driffusion)";
constexpr std::string_view kTransformerOnly =
    "it splits a transformer's blocks into stages: it runs SD3 and Flux, and SD 1.x / 2.x / XL have a UNet (use "
    "cfg-parallel, hybrid-cfg, driffusion or data-parallel)";

constexpr std::string_view kNoCacheControlNets =
    "a UNet's step cache runs its layers in parts, and a ControlNet's residuals join whole evaluations only; use "
    "single, cfg-parallel, data-parallel, step-skip or a driffusion variant";

constexpr std::string_view kFbcacheThreshold =
    "First-Block Cache: the other blocks (a UNet's deep layers) are reused while the first block's (first down "
    "layer's) residual moved less than this since they last ran (higher: faster, further from the plain loop; 0: "
    "never)";
constexpr std::string_view kTeacacheThreshold =
    "TeaCache: every block is skipped while the timestep-modulated input's changes, rescaled and summed since the "
    "last full step, stay under this (Flux.1-dev: 0.25 about 1.5x, 0.4 1.8x, 0.6 2x; 0: never)";
constexpr std::string_view kTeacacheRefused =
    "it reads the first block's timestep-modulated input, which transformers with AdaLN have (SD3, Flux) and a UNet "
    "has not (use deepcache or fbcache)";
constexpr std::string_view kDeepcacheRefused =
    "it splits a UNet's shallow path from its deep layers, and SD3's and Flux's denoisers are transformers (use "
    "fbcache or teacache)";

constexpr std::string_view kTransformersOnly =
    "it shards a transformer's attention over the image tokens: it runs Flux and SD3, and SD 1.x / 2.x / XL have a "
    "UNet (use cfg-parallel, driffusion or data-parallel)";

const std::vector<StrategyInfo> kStrategies = {
    {"single", "The plain loop on one device.", Level::Loop, true, true, "", false, true, {1, 1, 1}, {}, make_single, "", ""},
    {"cfg-parallel", "Prompt and negative prompt on two devices at once; the same image.", Level::Evaluation, true,
     true, "", true, true, {2, 2, 1}, {}, make_cfg_parallel, "", ""},
    {"hybrid-cfg",
     "CFG-parallel, with a few layer-split steps a step stale where the two branches agree; small changes.",
     Level::Evaluation, true, false,
     "its stale window needs a layer split of the UNet (its U split); SD3's MMDiT has none: use cfg-parallel, or "
     "pipefusion for a split of the transformer's blocks",
     true, false, {2, 2, 1}, {}, make_hybrid_cfg},
    {"driffusion", "Drafts the next steps on the other devices from an exact anchor, then refines; small changes.",
     Level::Loop, true, true, "", false, false, {0, 1, 1}, {Param::Devices}, make_driffusion, kNoImageInputs, ""},
    {"driffusion-aggressive",
     "Drafts and anchor in one round (one step per device per round); changes the image a little more.", Level::Loop,
     true, true, "", false, false, {0, 1, 1}, {Param::Devices}, make_driffusion, kNoImageInputs, ""},
    {"cfg-driffusion", "Conservative DRiffusion with each draft's two CFG branches on a pair of devices.",
     Level::Loop, true, true, "", true, false, {0, 2, 2}, {Param::Devices}, make_driffusion, kNoImageInputs, ""},
    {"cfg-driffusion-aggressive", "Aggressive DRiffusion with each draft's two CFG branches on a pair of devices.",
     Level::Loop, true, true, "", true, false, {0, 2, 2}, {Param::Devices}, make_driffusion, kNoImageInputs, ""},
    {"data-parallel", "A batch's images split over the devices; the same images.", Level::Evaluation, true, true,
     "", false, true, {0, 1, 1}, {Param::Devices}, make_data_parallel, "", ""},
    {"step-skip", "Evaluates every skip-th step on one device and jumps over the rest: the naive baseline.",
     Level::Loop, true, true, "", false, false, {1, 1, 1}, {Param::Skip}, make_step_skip, kNoImageInputs, ""},
    {"fbcache",
     "The first block every step, the rest only when its output moved more than the threshold (a UNet: its first "
     "down layer and the shallow path); one device, changes the image a little.",
     Level::Evaluation, true, true, "", false, false, {1, 1, 1}, {Param::CacheThreshold}, make_first_block_cache,
     kNoImageInputs, kNoCacheControlNets, 0.12, kFbcacheThreshold},
    {"teacache",
     "SD3, Flux: every block skipped while the timestep-modulated input barely moved (TeaCache); one device, changes "
     "the image a little.",
     Level::Evaluation, false, true, kTeacacheRefused, false, false, {1, 1, 1}, {Param::CacheThreshold}, make_teacache,
     kNoImageInputs, "", 0.4, kTeacacheThreshold},
    {"deepcache",
     "SD / SDXL: the UNet's deep layers every skip-th step, its shallow path every step (DeepCache); one device, "
     "changes the image a little.",
     Level::Evaluation, true, false, kDeepcacheRefused, false, false, {1, 1, 1}, {Param::Skip}, make_deepcache,
     kNoImageInputs, kNoCacheControlNets},
    {"cfg-fbcache",
     "fbcache with the prompt's and the negative prompt's branches on two devices at once; the same steps reused.",
     Level::Evaluation, true, true, "", true, false, {2, 2, 1}, {Param::CacheThreshold}, make_first_block_cache,
     kNoImageInputs, kNoCacheControlNets, 0.12, kFbcacheThreshold},
    {"cfg-teacache",
     "teacache with the prompt's and the negative prompt's branches on two devices at once; the same steps reused.",
     Level::Evaluation, false, true, kTeacacheRefused, true, false, {2, 2, 1}, {Param::CacheThreshold}, make_teacache,
     kNoImageInputs, "", 0.4, kTeacacheThreshold},
    {"cfg-deepcache",
     "deepcache with the prompt's and the negative prompt's branches on two devices at once; the same steps reused.",
     Level::Evaluation, true, false, kDeepcacheRefused, true, false, {2, 2, 1}, {Param::Skip}, make_deepcache,
     kNoImageInputs, kNoCacheControlNets},
    {"dp-fbcache",
     "fbcache with the batch's images split over the devices, as data-parallel splits them; the steps one device "
     "would reuse for the whole batch.",
     Level::Evaluation, true, true, "", false, false, {0, 2, 1}, {Param::Devices, Param::CacheThreshold},
     make_first_block_cache, kNoImageInputs, kNoCacheControlNets, 0.12, kFbcacheThreshold},
    {"dp-teacache",
     "teacache with the batch's images split over the devices, as data-parallel splits them; the steps one device "
     "would reuse for the whole batch.",
     Level::Evaluation, false, true, kTeacacheRefused, false, false, {0, 2, 1},
     {Param::Devices, Param::CacheThreshold}, make_teacache, kNoImageInputs, "", 0.4, kTeacacheThreshold},
    {"sequence-parallel",
     "Flux, SD3: each device a share of the image tokens, attention trading tokens for heads (Ulysses); the same "
     "image.",
     Level::Model, false, true, kTransformersOnly, false, true, {0, 1, 1}, {Param::Devices}, make_sequence_parallel},
    {"pipefusion", "SD3, Flux: the transformer's blocks over the devices, the image in patches, a step stale.",
     Level::Model, false, true, kTransformerOnly, false, false, {0, 1, 1}, {Param::Devices, Param::Patches},
     make_pipefusion},
    {"cfg-pipefusion", "SD3, Flux: one PipeFusion pipeline per CFG branch, each on half the devices.", Level::Model,
     false,
     true, kTransformerOnly, true, false, {0, 2, 2}, {Param::Devices, Param::Patches}, make_pipefusion},
    {"asyncdiff", "The UNet's layers over the devices, each fed the step before.", Level::Model, true, false,
     kUNetOnly, false, false, {0, 2, 1}, {Param::Devices}, make_asyncdiff},
    {"asyncdiff-stride2", "AsyncDiff that also runs two steps at a time (3 or more devices).", Level::Model, true,
     false, kUNetOnly, false, false, {0, 3, 1}, {Param::Devices}, make_asyncdiff},
    {"distrifusion", "The image in bands over the devices, exchanging activations a step late; pays at large sizes.",
     Level::Model, true, false, kUNetOnly, false, false, {0, 2, 1}, {Param::Devices}, make_distrifusion},
};

}  // namespace

int DeviceRule::most_of(int available) const {
  if (fixed > 0) return available >= fixed ? fixed : 0;
  const int n = available - available % multiple;
  return n >= min ? n : 0;
}

std::string DeviceRule::describe() const {
  if (fixed > 0) return std::to_string(fixed) + (fixed == 1 ? " device" : " devices");
  if (multiple == 2) return "an even number of devices, " + std::to_string(min) + " or more";
  return std::to_string(min) + " or more devices";
}

bool StrategyInfo::takes(Param p) const { return std::find(params.begin(), params.end(), p) != params.end(); }

bool StrategyInfo::runs(job::ModelFamily family) const { return job::has_unet(family) ? unet : transformer; }

const std::vector<StrategyInfo>& strategies() { return kStrategies; }

const StrategyInfo* find_strategy(std::string_view name) {
  if (name.empty()) name = "single";
  for (const auto& s : kStrategies)
    if (s.name == name) return &s;
  if (name.rfind(kStridePrefix, 0) == 0) return find_strategy("asyncdiff-stride2");
  return nullptr;
}

std::string strategy_names() {
  std::string out;
  for (const auto& s : kStrategies) out += (out.empty() ? "" : ", ") + std::string(s.name);
  return out;
}

double cache_threshold(const job::StrategyParams& p) {
  if (p.cache_threshold >= 0) return p.cache_threshold;
  const auto* s = find_strategy(p.name);
  return s ? s->default_cache_threshold : 0;
}

const StrategyInfo& strategy_info(std::string_view name) {
  if (const auto* s = find_strategy(name)) return *s;
  throw Error("unknown strategy '" + std::string(name.substr(0, 80)) + "' (" + strategy_names() + ")");
}

void check_strategy(const job::StrategyParams& p, job::ModelFamily family, bool cfg) {
  const auto& s = strategy_info(p.name);
  if (!s.runs(family))
    throw Error(std::string(s.name) + " does not run " + std::string(job::family_name(family)) + " models: " +
                std::string(s.refused_why));
  if (s.needs_cfg && !cfg)
    throw Error(std::string(s.name) + " needs classifier-free guidance (a CFG scale above 1)");
}

void check_image_inputs(std::string_view name, bool mask) {
  const auto& s = strategy_info(name);
  if (!s.image_refused_why.empty())
    throw Error(std::string(s.name) + " does not take an init image" + (mask ? " or a mask" : "") + ": " +
                std::string(s.image_refused_why));
}

void check_controlnets(std::string_view name) {
  const auto& s = strategy_info(name);
  if (!s.controlnet_refused_why.empty())
    throw Error(std::string(s.name) + " does not run ControlNets: " + std::string(s.controlnet_refused_why));
}

std::unique_ptr<Strategy> make_strategy(const job::StrategyParams& p) {
  const auto& s = strategy_info(p.name);
  // Each strategy checks its own device count (validate); this bounds what any may be given.
  if (p.devices > 64)
    throw Error("strategy " + p.display_name() + ": devices " + std::to_string(p.devices) + " must be 64 or fewer");
  if (s.takes(Param::Skip) && (p.skip < 1 || p.skip > 1000))
    throw Error("step skipping needs a skip of 1 or more, not " + std::to_string(p.skip));
  if (s.takes(Param::CacheThreshold) && !(p.cache_threshold <= 10))  // negative: the default
    throw Error("strategy " + p.display_name() + ": cache threshold " + std::to_string(p.cache_threshold) +
                " must be between 0 (never reuse) and 10");
  if (s.takes(Param::Patches) && (p.patches < 0 || p.patches > 4096))
    throw Error("strategy " + p.display_name() + ": patches " + std::to_string(p.patches) + " must be 0 (one per stage) or more");
  auto named = p;
  if (named.name.empty()) named.name = "single";
  return s.make(named);
}

std::unique_ptr<Strategy> make_strategy(const std::string& name, int n, int patches) {
  job::StrategyParams p;
  p.name = name;
  const auto* s = find_strategy(name);
  if (s && s->takes(Param::Skip)) {
    p.skip = n;
  } else {
    p.devices = n;
  }
  p.patches = patches;
  return make_strategy(p);
}

}  // namespace diffract::parallel
