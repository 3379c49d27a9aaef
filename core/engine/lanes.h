#pragma once
// Lanes: one prompt, seed and set of inputs run with several settings at once (strategy, steps,
// sampler, cache threshold), each lane on its own devices, then compared with a baseline lane.
// No torch headers: the GUI and the CLI include this.
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/engine/measures.h"
#include "core/job/job.h"

namespace diffract::engine {

inline constexpr int kMaxLanes = 8;

struct Lane {
  std::string name;              // shown above the lane's view and in the table; empty: lane_label()
  job::StrategyParams strategy;  // devices: how many the lane takes (GPUs, or CPU virtual devices)
  std::vector<int> gpus;         // its GPUs in rank order; empty: the next enabled ones (plan_lanes)
  int steps = 0;                 // 0: the group's
  std::string sampler;           // empty: the group's
  std::string precision;         // "bf16" or "fp8"; empty: the group's
};

// A lanes file:
//   {"name": "Baseline vs DRiffusion x2 vs step skip x2", "description": "...", "baseline": 0,
//    "lanes": [{"name": "baseline", "strategy": "single"},
//              {"strategy": "driffusion", "devices": 2},
//              {"strategy": "step-skip", "skip": 2, "steps": 30, "sampler": "euler"}]}
// Lane keys: name, strategy (default single), devices, gpus, skip, patches, cache_threshold,
// steps, sampler, precision. "baseline" (default 0) is the index of the lane the others are compared with.
// Unknown keys are errors.
struct LaneSet {
  std::string name;
  std::string description;
  std::vector<Lane> lanes;
  int baseline = 0;
  std::filesystem::path file;  // where load_lane_set read it (not part of the JSON)
};

// "driffusion x2, 20 steps": the strategy with its parameters, and what the lane sets itself.
std::string lane_label(const Lane& lane);
// The lane's own name, else lane_label().
std::string lane_title(const Lane& lane);

// Errors start with `where` and name the lane and the field.
LaneSet parse_lane_set(const std::string& json_text, const std::string& where);
LaneSet load_lane_set(const std::filesystem::path& file);
std::string lane_set_to_json(const LaneSet& set);
// Validates, then writes beside and renames over (a failed write leaves the old file whole).
void save_lane_set(const LaneSet& set, const std::filesystem::path& file);
void validate_lane_set(const LaneSet& set, const std::string& where);
// Lane setups saved in `dirs`, each name once, in folder order; a file that does not parse is
// skipped, its error added to `problems` (when given) or logged.
std::vector<LaneSet> list_lane_sets(const std::vector<std::filesystem::path>& dirs,
                                    std::vector<std::string>* problems = nullptr);

// How one lane runs.
struct LanePlan {
  job::GenerationRequest request;    // the group's request with the lane's settings and devices
  std::vector<std::string> devices;  // "cpu" or "cuda:N": what it holds while it runs
  std::vector<int> after;            // earlier lanes sharing a device with it: it starts when they end
  std::string error;                 // non-empty: this lane cannot run, and why; the others still do
};

// Every lane's request and devices. With no GPU enabled each lane runs on the CPU (its devices
// as virtual devices). With GPUs, a lane without its own `gpus` takes the next `enabled_gpus`
// in lane order, as many as its strategy needs (engine::choose_devices), starting again from the
// first when they run out. Lanes that share a device run one after another, in lane order, so
// that their times stay comparable; the others run at the same time.
std::vector<LanePlan> plan_lanes(const job::GenerationRequest& group, const LaneSet& set,
                                 const std::vector<int>& enabled_gpus);
// One line per device that several lanes share ("lanes 1, 2 and 3 share cpu: they run one
// after another"); empty when every lane has devices of its own.
std::vector<std::string> describe_sharing(const std::vector<LanePlan>& plans);
// What `lane` sets differently from `baseline` ("steps 30 -> 20", "strategy single -> driffusion x2").
std::vector<std::string> lane_differences(const LanePlan& lane, const LanePlan& baseline);

struct LaneOutcome {
  enum class State { Done, Failed, Cancelled };
  State state = State::Cancelled;
  job::GenerationResult result;          // Done
  std::string error;                     // Failed: why
  bool compared = false;                 // Done, not the baseline, and the baseline Done
  Measures against_baseline;             // when compared
  std::vector<std::string> differences;  // lane_differences against the baseline lane
};

struct LaneGroupResult {
  LaneSet set;
  std::vector<LanePlan> plans;
  std::vector<LaneOutcome> lanes;
  bool cancelled = false;  // the group was cancelled: lanes not finished then are Cancelled
};

// Callbacks run on the lanes' threads (several at once); keep them short.
struct LaneGroupObserver {
  // Lane i's job observer, asked for once per lane before any lane starts. Exactly one of its
  // on_done / on_error / on_cancelled ends each lane, including lanes that cannot run.
  std::function<job::JobObserver(int lane)> lane;
  std::function<void(int lane)> on_lane_started;  // after its wait, when its job begins
};

// Runs one lane's job (the engine: thread-safe for requests on different devices).
using RunJob = std::function<job::GenerationResult(const job::GenerationRequest&, const job::JobObserver&,
                                                   const job::CancelToken&)>;

// Runs the planned lanes, each on a thread of its own once the lanes it waits for have ended,
// after warm-up jobs (a one-step plain job on each lane's first device, a two-step job of each
// strategy the first time it runs there), so that no lane's time holds a device's or a
// strategy's first-use costs. A failing lane fails alone. Returns when every lane has ended;
// the group's cancel token cancels them all.
LaneGroupResult run_lane_group(const LaneSet& set, std::vector<LanePlan> plans, const RunJob& run,
                               const LaneGroupObserver& observer, const job::CancelToken& cancel);

// The file save_lane_group writes lane `lane`'s (0-based) first image to: "lane-<lane + 1>.png".
std::string lane_file(int lane);

// Writes lane-<i>.png per finished lane (its parameters and metadata inside),
// lane-<i>-heatmap.png against the baseline, and lanes.json (the set, each lane's file, timings,
// speed-up, PSNR, SSIM, latents rel-L2 and differences) into `dir`; returns lanes.json's path.
std::filesystem::path save_lane_group(const LaneGroupResult& result, const std::filesystem::path& dir);
// A lane group saved by save_lane_group, read back from its lanes.json (the gallery reopens it):
// each lane's title and first image (absolute; empty when the lane did not finish) with its
// measures against the baseline when it was compared. Errors name the file and the field; an
// image named outside the group's folder is refused.
struct SavedLaneGroup {
  struct Lane {
    std::string title, image;
    double speedup = 0, psnr = 0, ssim = 0;  // 0 when not compared; psnr 0 also when identical
    bool compared = false, identical = false;
  };
  std::string name;
  int baseline = 0;
  std::vector<Lane> lanes;
};
SavedLaneGroup read_lane_group(const std::filesystem::path& lanes_json);

// The comparison table the CLI prints: one row per lane.
std::string lane_table(const LaneGroupResult& result);

}  // namespace diffract::engine
