#include "core/engine/engine.h"
#include "core/engine/lora_library.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "core/pipeline/factory.h"
#include "core/util/device_work.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::engine {

struct Engine::Impl {
  std::mutex mutex;               // guards queue and stopping
  std::condition_variable wake;
  struct Queued {
    std::shared_ptr<Job> job;
    job::GenerationRequest request;
    job::JobObserver observer;
    bool load_only = false;
  };
  std::deque<Queued> queue;
  std::shared_ptr<Job> running;
  bool stopping = false;
  std::mutex model_mutex;         // one job at a time uses the model
  std::unique_ptr<pipeline::Pipeline> model;  // chosen from the folder: SD 1.x / 2.x / XL or SD3
  std::string model_config;
  bool model_without_t5 = false;  // loaded with drop_t5: a job that wants T5 needs a reload
  std::string model_t5_placement;
  std::thread worker;

  pipeline::Pipeline& model_for(const job::GenerationRequest& r) {
    if (r.model.empty()) throw Error("no model chosen");
    if (!model || model->path() != r.model || model->device() != r.device || model_config != r.model_config ||
        (model_without_t5 && !r.drop_t5) ||
        (model->family() == job::ModelFamily::Flux && model_t5_placement != r.t5_placement)) {
      model.reset();  // free the old one first: two SDXL models may not fit
      release_cached_memory();  // and its blocks, which a CUDA graph's private pool cannot reuse
      model = pipeline::load_pipeline(r.model, r.device, r.model_config, r.drop_t5, r.t5_placement);
      model_config = r.model_config;
      model_without_t5 = r.drop_t5;
      model_t5_placement = r.t5_placement;
      // On a GPU the first job would otherwise pay for cuDNN plans and graph captures.
      if (r.device.rfind("cuda", 0) == 0) model->warm_up();
    }
    return *model;
  }

  job::GenerationResult run(const job::GenerationRequest& r, const job::JobObserver& o, const job::CancelToken& c) {
    std::lock_guard lock(model_mutex);
    auto resolved = r;
    resolve_lora_tags(resolved);
    return model_for(resolved).generate(resolved, o, c);
  }

  void loop() {
    while (true) {
      std::shared_ptr<Job> job;
      job::GenerationRequest request;
      job::JobObserver observer;
      bool load_only = false;
      {
        std::unique_lock lock(mutex);
        wake.wait(lock, [&] { return stopping || !queue.empty(); });
        if (stopping && queue.empty()) return;
        job = queue.front().job;
        request = std::move(queue.front().request);
        observer = std::move(queue.front().observer);
        load_only = queue.front().load_only;
        queue.pop_front();
        running = job;
      }
      try {
        if (job->token().cancelled()) throw job::Cancelled{};
        if (load_only) {
          std::lock_guard model_lock(model_mutex);
          const double prepared_ms = model_for(request).prepare(request);
          if (observer.on_stage) observer.on_stage("loaded", prepared_ms);
        } else {
          auto result = run(request, observer, job->token());
          if (observer.on_done) observer.on_done(result);
        }
      } catch (const job::Cancelled&) {
        if (observer.on_cancelled) observer.on_cancelled();
      } catch (const std::exception& e) {
        // Out-of-memory and other torch errors arrive here too; the engine stays usable.
        log::get("engine").error(e.what());
        if (observer.on_error) observer.on_error(e.what());
      }
      std::lock_guard lock(mutex);
      running.reset();
    }
  }
};

Engine::Engine() : impl_(std::make_unique<Impl>()) {
  impl_->worker = std::thread([this] { impl_->loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
    for (auto& q : impl_->queue) q.job->cancel();
    if (impl_->running) impl_->running->cancel();
  }
  impl_->wake.notify_all();
  impl_->worker.join();
}

std::shared_ptr<Job> Engine::submit(job::GenerationRequest request, job::JobObserver observer) {
  auto job = std::make_shared<Job>();
  {
    std::lock_guard lock(impl_->mutex);
    impl_->queue.push_back({job, std::move(request), std::move(observer), false});
  }
  impl_->wake.notify_one();
  return job;
}

std::shared_ptr<Job> Engine::preload(job::GenerationRequest request, job::JobObserver observer) {
  auto job = std::make_shared<Job>();
  {
    std::lock_guard lock(impl_->mutex);
    impl_->queue.push_back({job, std::move(request), std::move(observer), true});
  }
  impl_->wake.notify_one();
  return job;
}

job::GenerationResult Engine::run(const job::GenerationRequest& request, const job::JobObserver& observer, const job::CancelToken& cancel) {
  return impl_->run(request, observer, cancel);
}

}  // namespace diffract::engine
