#pragma once
#include <memory>

#include "core/job/job.h"

namespace diffract::engine {

class Job {
 public:
  void cancel() { token_.cancel(); }
  const job::CancelToken& token() const { return token_; }

 private:
  job::CancelToken token_;
};

// Runs generation jobs one at a time on its own worker thread and keeps the last model
// loaded, so the next job with the same model and device starts without loading.
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
  // Runs a job on the calling thread (the CLI), with the same model cache. Throws
  // diffract::Error or Cancelled.
  job::GenerationResult run(const job::GenerationRequest& request, const job::JobObserver& observer, const job::CancelToken& cancel);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::engine
