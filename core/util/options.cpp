#include "core/util/options.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>

#include "core/util/environment.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::options {

namespace {

const std::vector<Option>& build_table() {
  static const std::vector<Option> t = {
      {Id::EmbeddedModel, "DIFFRACT_EMBEDDED_MODEL", Type::Path, "", Scope::Process,
       "the folder of the model used without --model (default: the installed or source tree's diffract-emoji)", {}},
      {Id::PresetsDir, "DIFFRACT_PRESETS_DIR", Type::Path, "", Scope::Process,
       "a folder searched first for presets by name", {}},
      {Id::OutputDir, "DIFFRACT_OUTPUT_DIR", Type::Path, "", Scope::Process,
       "where the GUI saves its images (default: Pictures/Diffract)", {}},
      {Id::CudaGraphs, "DIFFRACT_CUDA_GRAPHS", Type::Flag, "1", Scope::Process,
       "replay the denoiser and text encoders from CUDA graphs on GPUs (0: eager)", {}},
      {Id::StageGraphs, "DIFFRACT_STAGE_GRAPHS", Type::Flag, "1", Scope::Process,
       "CUDA graphs for the strategies' UNet stages too (0: stages eager)", {}},
      {Id::ChannelsLast, "DIFFRACT_CHANNELS_LAST", Type::Choice, "", Scope::Process,
       "the UNet's memory format on GPUs: 1 channels-last, 0 NCHW, unset: measured at warm-up", {"", "0", "1"}},
      {Id::PinnedUpload, "DIFFRACT_PINNED_UPLOAD", Type::Flag, "1", Scope::Process,
       "load weights through pinned buffers straight onto the GPU (0: into CPU tensors, then moved)", {}},
      {Id::Sdpa, "DIFFRACT_SDPA", Type::Choice, "", Scope::Process,
       "ATen's attention kernels: flash (no cuDNN), efficient (no cuDNN, no flash), unset: ATen's choice",
       {"", "flash", "efficient"}},
      {Id::WideHeadAttention, "DIFFRACT_WIDE_HEAD_ATTENTION", Type::Flag, "1", Scope::Process,
       "heads wider than 256 (the VAE's) by chunked GEMMs on CUDA (0: SDPA)", {}},
      {Id::FusedQkv, "DIFFRACT_FUSED_QKV", Type::Flag, "1", Scope::Process,
       "self-attention's q, k, v projections as one GEMM (SD3, Flux: the text tokens' too; Flux: with the single "
       "blocks' MLP input)",
       {}},
      {Id::FusedCrossKv, "DIFFRACT_FUSED_CROSS_KV", Type::Flag, "1", Scope::Process,
       "every cross-attention's keys and values in one GEMM per step", {}},
      {Id::FusedTimeProj, "DIFFRACT_FUSED_TIME_PROJ", Type::Flag, "1", Scope::Process,
       "every ResNet block's time-embedding projection in one GEMM per step", {}},
      {Id::GegluOneGemm, "DIFFRACT_GEGLU_ONE_GEMM", Type::Flag, "1", Scope::Process,
       "GEGLU's projection as one GEMM on CUDA (0: two half-width GEMMs)", {}},
      {Id::FusedLayerNorm, "DIFFRACT_FUSED_LAYER_NORM", Type::Flag, "1", Scope::Process,
       "LayerNorm through Diffract's CUDA kernel (0: ATen's)", {}},
      {Id::FusedAddLayerNorm, "DIFFRACT_FUSED_ADD_LAYER_NORM", Type::Flag, "1", Scope::Process,
       "a residual add and the next LayerNorm in one kernel", {}},
      {Id::FusedModulation, "DIFFRACT_FUSED_MODULATION", Type::Flag, "1", Scope::Process,
       "SD3's and Flux's adaptive LayerNorm (with the gated residual before it) and gated residuals as CUDA "
       "kernels (0: ATen's ops)",
       {}},
      {Id::FusedRmsNormRope, "DIFFRACT_FUSED_RMS_NORM_ROPE", Type::Flag, "1", Scope::Process,
       "Flux: the queries' and keys' RMSNorm and rotary embedding as one CUDA kernel (0: ATen's ops)", {}},
      {Id::RmsNormRopeVector, "DIFFRACT_RMS_NORM_ROPE_VECTOR", Type::Flag, "1", Scope::Process,
       "Flux's RMSNorm + rotary kernel with four elements a lane where aligned (0: one element a lane)", {}},
      {Id::GeluSliceKernel, "DIFFRACT_GELU_SLICE_KERNEL", Type::Flag, "1", Scope::Process,
       "Flux's single blocks: the tanh GELU into its column slice by Diffract's kernel (0: ATen's gelu_out)", {}},
      {Id::ConvBiasKernel, "DIFFRACT_CONV_BIAS_KERNEL", Type::Flag, "1", Scope::Process,
       "convolution biases (and residuals) added by Diffract's kernel", {}},
      {Id::GroupNormStatsBlocks, "DIFFRACT_GROUP_NORM_STATS_BLOCKS", Type::Integer, "2", Scope::Process,
       "GroupNorm's statistics pass: thread blocks per SM", {}},
      {Id::GemmGelu, "DIFFRACT_GEMM_GELU", Type::Flag, "1", Scope::Process,
       "SD3's and Flux's feed-forward GELU (tanh) in the first GEMM's cuBLASLt epilogue on CUDA (0: a GELU pass "
       "after the GEMM)",
       {}},
      {Id::GemmStridedBatch, "DIFFRACT_GEMM_STRIDED_BATCH", Type::Flag, "1", Scope::Process,
       "SD3's joint attention: its projections written into the joint sequence and its out projections read from it "
       "by strided-batch GEMMs, without ATen's cat and copy (0: the GEMMs, then the cat and the copy)",
       {}},
      {Id::GemmTuning, "DIFFRACT_GEMM_TUNING", Type::Flag, "1", Scope::Process,
       "time cuBLASLt's algorithms per linear-layer shape and keep the fastest (0: at::linear)", {}},
      {Id::FusedTaesd, "DIFFRACT_FUSED_TAESD", Type::Flag, "1", Scope::Process,
       "TAESD's decoder blocks as cuDNN fused convolutions on CUDA", {}},
      {Id::NcclTrace, "DIFFRACT_NCCL_TRACE", Type::Choice, "0", Scope::Process,
       "log every NCCL operation (1), and wait for each on the device (sync: serialises, for hangs)",
       {"0", "1", "sync"}},
      {Id::DriffusionPairs, "DIFFRACT_DRIFFUSION_PAIRS", Type::Flag, "1", Scope::Job,
       "DRiffusion: a round with devices to spare runs each point's two CFG branches on two devices", {}},
      {Id::ParallelVae, "DIFFRACT_PARALLEL_VAE", Type::Choice, "", Scope::Job,
       "multi-GPU VAE decode in row bands: overlap (or 1), exchange, 0 off; unset: exchange from 3 MP",
       {"", "0", "1", "overlap", "exchange"}},
      {Id::BatchVae, "DIFFRACT_BATCH_VAE", Type::Flag, "1", Scope::Job,
       "a multi-GPU job's batch decoded image by image over its devices", {}},
      {Id::DeepCacheBranch, "DIFFRACT_DEEPCACHE_BRANCH", Type::Choice, "0", Scope::Job,
       "deepcache: the down layers its shallow path keeps (DeepCache's cache_branch_id; 0 its default for SD / SDXL)",
       {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11"}},
      {Id::Precision, "DIFFRACT_PRECISION", Type::Choice, "bf16", Scope::Job,
       "the denoiser's linear layers: bf16 (the model's dtype) or fp8 (e4m3, where it is faster; a job's "
       "precision sets it)",
       {"bf16", "fp8"}},
      {Id::CacheWarmup, "DIFFRACT_CACHE_WARMUP", Type::Choice, "10", Scope::Job,
       "the step caches: the first this many percent of a loop's steps always run in full (the image's layout "
       "forms there; 0: the published schedules)",
       {"0", "10", "20", "25", "30", "40", "50"}},
      {Id::Fp8Layers, "DIFFRACT_FP8_LAYERS", Type::Choice, "timed", Scope::Job,
       "an fp8 job's CUDA linear layers: timed (each shape keeps fp8 where it is at least 5 % faster than bf16) or all (every "
       "eligible layer in fp8, for measuring fp8's quality on its own)",
       {"timed", "all"}},
      {Id::Fp8FusedRows, "DIFFRACT_FP8_FUSED_ROWS", Type::Flag, "1", Scope::Process,
       "an fp8 job's GEMM inputs quantised by the kernels that write them (the LayerNorms, the MLPs' GELU and "
       "GEGLU; the out projections' strided inputs without a copy; 0: a contiguous copy and a pass of their own)",
       {}},
      {Id::Fp8JoinedRows, "DIFFRACT_FP8_JOINED_ROWS", Type::Flag, "1", Scope::Process,
       "Flux's single blocks in an fp8 job: proj_out's input (the attention's output, then the MLP's GELU) joined, "
       "activated and quantised by one kernel (0: a GELU, a copy and a quantisation pass)",
       {}},
      {Id::TuningStore, "DIFFRACT_TUNING_STORE", Type::Flag, "1", Scope::Process,
       "keep the GPU tuning choices (GEMM algorithms, convolution plans, fp8 or bf16 per layer) on disk, per GPU "
       "model, driver and library versions, so a size tuned once starts without tuning (0: memory only)", {}},
      {Id::TuningDir, "DIFFRACT_TUNING_DIR", Type::Path, "", Scope::Process,
       "the folder of the tuning store (default: $XDG_CACHE_HOME/diffract/tuning or ~/.cache/diffract/tuning)", {}},
      {Id::ConvTuning, "DIFFRACT_CONV_TUNING", Type::Choice, "heuristic", Scope::Process,
       "CUDA convolutions' cuDNN plans: heuristic (cuDNN's heuristic plan, untimed), timed (per shape, the heuristic "
       "plan against the benchmarked one, the faster kept and remembered in the tuning store), benchmark (ATen's "
       "benchmark mode: every new shape benchmarked, nothing kept)",
       {"heuristic", "timed", "benchmark"}},
      {Id::BackgroundTuning, "DIFFRACT_BACKGROUND_TUNING", Type::Flag, "1", Scope::Process,
       "after a model loads on a GPU, prepare the offered sizes near its native one while no job waits (the GUI)",
       {}},
      {Id::GraphWarmups, "DIFFRACT_GRAPH_WARMUPS", Type::Choice, "auto", Scope::Process,
       "eager calls before a CUDA graph's capture (the tuning, plans and workspaces happen in the first; the "
       "capture itself must not tune); auto: none where every choice is known, the capture redone after two "
       "where it met a shape without its tuning choice",
       {"auto", "1", "2"}},
  };
  for (std::size_t i = 0; i < t.size(); ++i)
    if (static_cast<std::size_t>(t[i].id) != i) throw std::logic_error("options table out of order");
  return t;
}

thread_local const Overrides* t_job = nullptr;

std::string from_environment(const Option& o) {
  const char* v = std::getenv(std::string(o.name).c_str());  // with environment(), the only readers of it in core
  if (!v) return std::string(o.default_value);
  const std::string s = v;
  if (const auto why = invalid_reason(o, s); !why.empty()) {
    static std::mutex mutex;
    static std::set<Id> warned;
    std::lock_guard<std::mutex> lock(mutex);
    if (warned.insert(o.id).second)
      log::get("options").warn(std::string(o.name) + "=" + s.substr(0, 40) + ": " + why + "; using the default '" +
                               std::string(o.default_value) + "'");
    return std::string(o.default_value);
  }
  return s;
}

}  // namespace

const std::vector<Option>& table() {
  static const auto& t = build_table();
  return t;
}

const Option& info(Id id) { return table().at(static_cast<std::size_t>(id)); }

const Option* find(std::string_view name) {
  for (const auto& o : table())
    if (o.name == name) return &o;
  return nullptr;
}

std::string_view type_name(Type type) {
  switch (type) {
    case Type::Flag: return "flag";
    case Type::Integer: return "integer";
    case Type::Choice: return "choice";
    case Type::Path: return "path";
  }
  return "";
}

std::string_view scope_name(Scope scope) { return scope == Scope::Job ? "job" : "process"; }

std::string invalid_reason(const Option& o, std::string_view v) {
  switch (o.type) {
    case Type::Flag:
      return v == "0" || v == "1" ? "" : "expected 0 or 1";
    case Type::Integer: {
      if (v.empty() || v.size() > 6 || v.find_first_not_of("0123456789") != std::string_view::npos)
        return "expected a whole number from 1 to 999999";
      return std::stoi(std::string(v)) >= 1 ? "" : "expected a whole number from 1 to 999999";
    }
    case Type::Choice: {
      if (std::find(o.choices.begin(), o.choices.end(), v) != o.choices.end()) return "";
      std::string list;
      for (const auto c : o.choices)
        if (!c.empty()) list += (list.empty() ? "" : ", ") + std::string(c);
      return "expected one of " + list;
    }
    case Type::Path:
      return v.size() > 4096 ? "longer than 4096 characters" : "";
  }
  return "";
}

std::string value(Id id) {
  const auto& o = info(id);
  if (o.scope == Scope::Job) {
    if (t_job)
      if (const auto it = t_job->find(std::string(o.name)); it != t_job->end()) return it->second;
  }
  return from_environment(o);
}

bool flag(Id id) { return value(id) != "0"; }

int integer(Id id) {
  const auto v = value(id);
  return invalid_reason(info(id), v).empty() ? std::stoi(v) : std::stoi(std::string(info(id).default_value));
}

bool is_set(Id id) {
  const auto& o = info(id);
  if (o.scope == Scope::Job && t_job && t_job->count(std::string(o.name))) return true;
  const char* v = std::getenv(std::string(o.name).c_str());
  return v && invalid_reason(o, v).empty();
}

std::string environment(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

void check_overrides(const Overrides& overrides) {
  for (const auto& [name, v] : overrides) {
    const auto* o = find(name);
    if (!o) throw Error("unknown option " + name.substr(0, 80) + " (diffract-cli info lists them)");
    if (o->scope != Scope::Job) {
      std::string job;
      for (const auto& t : table())
        if (t.scope == Scope::Job) job += (job.empty() ? "" : ", ") + std::string(t.name);
      throw Error(name + " is read once per process, so a job cannot set its own (" + job +
                  " can); set it in the environment instead");
    }
    if (const auto why = invalid_reason(*o, v); !why.empty())
      throw Error(name + "=" + v.substr(0, 40) + ": " + why);
  }
}

const Overrides* current_overrides() { return t_job; }

JobOptionsScope::JobOptionsScope(const Overrides& overrides) : previous_(t_job) { t_job = &overrides; }
JobOptionsScope::~JobOptionsScope() { t_job = previous_; }

}  // namespace diffract::options
