#pragma once
// Every DIFFRACT_* runtime switch in one table: its name, type, default, scope and one line of
// doc. This is the only place in core that reads the environment; everything else asks here.
//  Process scope: set in the environment; read where the code needs it (when a model loads, when
//   a kernel first runs), so a value set after that has no effect on what was already read. A
//   job cannot carry its own.
//  Job scope: read for each job, and a job may carry its own value (job::GenerationRequest::
//   options, applied by JobOptionsScope on the job's thread), so one process can A/B them.
// No torch headers: the GUI, the CLI and the bench include this.
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace diffract::options {

enum class Id {
  EmbeddedModel,
  PresetsDir,
  OutputDir,
  CudaGraphs,
  StageGraphs,
  ChannelsLast,
  PinnedUpload,
  Sdpa,
  WideHeadAttention,
  FusedQkv,
  FusedCrossKv,
  FusedTimeProj,
  GegluOneGemm,
  FusedLayerNorm,
  FusedAddLayerNorm,
  FusedModulation,
  FusedRmsNormRope,
  RmsNormRopeVector,
  GeluSliceKernel,
  ConvBiasKernel,
  GroupNormStatsBlocks,
  GemmGelu,
  GemmStridedBatch,
  GemmTuning,
  FusedTaesd,
  NcclTrace,
  DriffusionPairs,
  ParallelVae,
  BatchVae,
  DeepCacheBranch,
  Precision,
  CacheWarmup,
  Fp8Layers,
  Fp8FusedRows,
  Fp8JoinedRows,
  TuningStore,
  TuningDir,
  ConvTuning,
  BackgroundTuning,
  GraphWarmups,
};

enum class Type { Flag, Integer, Choice, Path };
enum class Scope { Process, Job };

struct Option {
  Id id;
  std::string_view name;
  Type type;
  std::string_view default_value;  // "" for a path or choice: unset
  Scope scope;
  std::string_view doc;
  std::vector<std::string_view> choices;  // Choice only; "" among them means unset
};

const std::vector<Option>& table();
const Option& info(Id id);
const Option* find(std::string_view name);
std::string_view type_name(Type type);
std::string_view scope_name(Scope scope);

// Why `value` is not a valid setting of `option` ("" when it is).
std::string invalid_reason(const Option& option, std::string_view value);

// The value in force on this thread: a job's own value (job scope, inside a JobOptionsScope),
// else the environment's (checked: an invalid one is warned about once and the default used),
// else the default.
std::string value(Id id);
bool flag(Id id);     // Flag: "0" is off, "1" on
int integer(Id id);   // Integer
bool is_set(Id id);   // the environment (or the job) gives a value

// A job's own values of job-scope options, by name.
using Overrides = std::map<std::string, std::string>;
// Throws diffract::Error naming an unknown option, a process-scope one (it cannot differ between
// jobs of one process) or an invalid value.
void check_overrides(const Overrides& overrides);

// The job-scope values in force on the calling thread (null outside a JobOptionsScope), for
// threads that work for the same job (a strategy's ranks) to take on.
const Overrides* current_overrides();

// Makes `overrides` the job-scope values on the calling thread for its lifetime.
class JobOptionsScope {
 public:
  explicit JobOptionsScope(const Overrides& overrides);
  ~JobOptionsScope();
  JobOptionsScope(const JobOptionsScope&) = delete;
  JobOptionsScope& operator=(const JobOptionsScope&) = delete;

 private:
  const Overrides* previous_;
};

}  // namespace diffract::options
