#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/engine/lanes.h"
#include "core/job/job.h"

namespace diffract::engine {

class Job {
 public:
  void cancel() { token_.cancel(); }
  const job::CancelToken& token() const { return token_; }

 private:
  job::CancelToken token_;
};

// Runs generation jobs and lane groups one at a time on its own worker thread and keeps their
// models loaded (one per device), so the next job with the same model and device starts without
// loading.
class Engine {
 public:
  Engine();
  ~Engine();  // cancels queued and running jobs, then joins the worker
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a job; its observer hears from the worker thread. The returned handle cancels it.
  std::shared_ptr<Job> submit(job::GenerationRequest request, job::JobObserver observer);

  // Loads (and on a GPU warms up) the request's model in the background, so that the first
  // job after start-up runs as fast as later ones; on a GPU it also prepares the request's size,
  // batch and previews (Pipeline::prepare) when they are not the warm-up's. Reports "loaded"
  // (with the ms spent preparing) through on_stage, errors through on_error.
  std::shared_ptr<Job> preload(job::GenerationRequest request, job::JobObserver observer = {});
  // Queues a lane group (engine/lanes.h): `request` with each lane's settings, on the devices
  // plan_lanes gives them out of `enabled_gpus`. The lanes' observers hear from the lanes'
  // threads; on_done ends the group (its result says whether it was cancelled), on_error only
  // when it could not run at all.
  struct LaneGroupEnd {
    std::function<void(const LaneGroupResult&)> on_done;
    std::function<void(const std::string& message)> on_error;
  };
  std::shared_ptr<Job> submit_lanes(job::GenerationRequest request, LaneSet lanes, std::vector<int> enabled_gpus,
                                    LaneGroupObserver observer, LaneGroupEnd end);

  // Runs a job on the calling thread (the CLI), with the same model cache. Throws
  // diffract::Error or Cancelled. Jobs on different devices may run at the same time.
  job::GenerationResult run(const job::GenerationRequest& request, const job::JobObserver& observer, const job::CancelToken& cancel);
  // Runs a lane group on the calling thread; the lanes on threads of their own.
  LaneGroupResult run_lanes(const job::GenerationRequest& request, const LaneSet& lanes,
                            const std::vector<int>& enabled_gpus, const LaneGroupObserver& observer,
                            const job::CancelToken& cancel);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::engine
