#include "core/engine/engine.h"
#include "core/engine/lora_library.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <mutex>
#include <thread>

#include "core/job/sizes.h"
#include "core/pipeline/factory.h"
#include "core/util/device_work.h"
#include "core/util/embedded_model.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"
#include "core/util/torch_errors.h"

namespace diffract::engine {

namespace {

// Runs work handed to it on one thread of its own, the caller waiting for the result. Every job
// on a device runs on that device's thread: LibTorch keeps cuDNN's handles and its benchmarked
// convolution plans per thread, so a job on a new thread (a lane's) benchmarked every
// convolution again (the embedded model's 256 px VAE decode on an H200: 3.6 ms warm, 378 ms on
// a fresh thread).
class DeviceThread {
 public:
  DeviceThread() : thread_([this] { loop(); }) {}
  ~DeviceThread() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  DeviceThread(const DeviceThread&) = delete;
  DeviceThread& operator=(const DeviceThread&) = delete;

  template <typename F>
  auto run(F&& f) -> decltype(f()) {
    using R = decltype(f());
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(f));
    auto result = task->get_future();
    {
      std::lock_guard lock(mutex_);
      work_.push_back([task] { (*task)(); });
    }
    wake_.notify_one();
    return result.get();  // rethrows what the work threw
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || !work_.empty(); });
        if (work_.empty()) return;
        work = std::move(work_.front());
        work_.pop_front();
      }
      work();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> work_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members it reads exist
};

// An inpainting or outpainting job on the embedded model runs on the inpainting model fine-tuned
// from it, which repaints the mask from the prompt and keeps the rest (the base can only blend).
// Not with ControlNets or a strategy, which an inpainting model does not take.
void use_embedded_inpainting_model(job::GenerationRequest& r) {
  if (!(r.input.has_image() && (r.input.has_mask() || r.input.outpaints())) || !r.controlnets.empty() ||
      !r.strategy.single() || r.model.empty())
    return;
  const auto inpainting = embedded_inpainting_model_dir();
  std::error_code ec;
  if (inpainting.empty() || !std::filesystem::equivalent(r.model, embedded_model_dir(), ec)) return;
  log::get("engine").info("inpainting with " + inpainting.filename().string() + ", the embedded model's inpainting variant");
  r.model = inpainting.string();
}

}  // namespace

struct Engine::Impl {
  std::mutex mutex;               // guards queue and stopping
  std::condition_variable wake;
  struct Queued {
    std::shared_ptr<Job> job;
    job::GenerationRequest request;
    job::JobObserver observer;
    bool load_only = false;
    std::optional<LaneSet> lanes;  // a lane group
    std::vector<int> enabled_gpus;
    LaneGroupObserver lane_observer;
    LaneGroupEnd lane_end;
  };
  std::deque<Queued> queue;
  std::shared_ptr<Job> running;
  bool stopping = false;
  // Sizes to prepare on a GPU while no job waits (job::sizes_to_tune of a model just loaded), so
  // that a designer switching aspect ratios finds each one tuned and its first image at full
  // speed: one size at a time, each a short job (Pipeline::prepare) that a queued job waits for
  // at most. The timed choices go to the tuning store, so on the next start these cost little.
  std::deque<job::GenerationRequest> to_prepare;  // guarded by mutex
  bool queues_jobs = false;  // submit() or preload() was called (the GUI); guarded by mutex

  // The model loaded on one device (a strategy's first device). Only its thread touches it, so
  // one job at a time uses it.
  struct Slot {
    DeviceThread thread;  // runs every job on the device
    std::unique_ptr<pipeline::Pipeline> model;  // chosen from the folder: SD 1.x / 2.x / XL, SD3 or Flux
    std::string config;
    bool without_t5 = false;  // loaded with drop_t5: a job that wants T5 needs a reload
    std::string t5_placement;
  };
  std::mutex slots_mutex;  // guards slots (not what they hold)
  std::map<std::string, std::shared_ptr<Slot>> slots;  // by device
  std::thread worker;

  std::shared_ptr<Slot> slot(const std::string& device) {
    std::lock_guard lock(slots_mutex);
    auto& s = slots[device];
    if (!s) s = std::make_shared<Slot>();
    return s;
  }

  // Frees the models on devices not in `keep` (a job on another device would otherwise hold two
  // models' memory: a strategy's model keeps replicas on the devices after its first).
  void keep_only(const std::set<std::string>& keep) {
    std::vector<std::shared_ptr<Slot>> dropped;
    {
      std::lock_guard lock(slots_mutex);
      for (auto it = slots.begin(); it != slots.end();)
        if (!keep.count(it->first)) {
          dropped.push_back(it->second);
          it = slots.erase(it);
        } else {
          ++it;
        }
    }
    bool freed = false;
    for (auto& s : dropped)
      freed |= s->thread.run([&] {
        const bool had = s->model != nullptr;
        s->model.reset();
        return had;
      });
    if (freed) release_cached_memory();
  }

  pipeline::Pipeline& model_in(Slot& s, const job::GenerationRequest& r) {
    if (r.model.empty()) throw Error("no model chosen");
    if (!s.model || s.model->path() != r.model || s.model->device() != r.device || s.config != r.model_config ||
        (s.without_t5 && !r.drop_t5) ||
        (s.model->family() == job::ModelFamily::Flux && s.t5_placement != r.t5_placement)) {
      s.model.reset();  // free the old one first: two SDXL models may not fit
      release_cached_memory();  // and its blocks, which a CUDA graph's private pool cannot reuse
      s.model = pipeline::load_pipeline(r.model, r.device, r.model_config, r.drop_t5, r.t5_placement);
      s.config = r.model_config;
      s.without_t5 = r.drop_t5;
      s.t5_placement = r.t5_placement;
      // On a GPU the first job would otherwise pay for cuDNN plans and graph captures.
      if (r.device.rfind("cuda", 0) == 0) {
        s.model->warm_up();
        plan_preparing(r, s.model->native_size());
      }
    }
    return *s.model;
  }

  // Replaces the sizes waiting for `loaded`'s device with the ones worth preparing for its model.
  void plan_preparing(const job::GenerationRequest& loaded, int native_size) {
    if (!options::flag(options::Id::BackgroundTuning)) return;
    auto base = loaded;
    base.strategy = {};
    base.gpus.clear();
    base.input = {};
    base.hires = {};
    base.controlnets.clear();
    base.batch = 1;
    std::lock_guard lock(mutex);
    if (!queues_jobs) return;  // Engine::run alone (the CLI): no idle time to use
    drop_preparing(loaded.device);
    for (const auto& size : job::sizes_to_tune(native_size)) {
      auto r = base;
      r.width = size.width;
      r.height = size.height;
      to_prepare.push_back(std::move(r));
    }
  }

  // One waiting size, on its device's thread, if that device still holds the model it was
  // planned for (never loads one).
  void prepare_one(const job::GenerationRequest& r) {
    std::shared_ptr<Slot> s;
    {
      std::lock_guard lock(slots_mutex);
      const auto it = slots.find(r.device);
      if (it == slots.end()) return;
      s = it->second;
    }
    try {
      s->thread.run([&] {
        if (s->model && s->model->path() == r.model && s->model->device() == r.device) s->model->prepare(r);
      });
    } catch (const std::exception& e) {
      // Out of memory at a large size, say: the sizes after it on that device are not tried.
      log::get("engine").warn(log::str("preparing ", r.width, "x", r.height, " on ", r.device, " failed: ", message_of(e)));
      std::lock_guard lock(mutex);
      drop_preparing(r.device);
    }
  }

  void drop_preparing(const std::string& device) {  // with mutex held
    to_prepare.erase(std::remove_if(to_prepare.begin(), to_prepare.end(),
                                    [&](const job::GenerationRequest& q) { return q.device == device; }),
                     to_prepare.end());
  }

  job::GenerationResult run(const job::GenerationRequest& r, const job::JobObserver& o, const job::CancelToken& c) {
    auto resolved = r;
    resolve_lora_tags(resolved);
    use_embedded_inpainting_model(resolved);
    const auto s = slot(r.device);
    return s->thread.run([&] { return model_in(*s, resolved).generate(resolved, o, c); });
  }

  LaneGroupResult run_lanes(const job::GenerationRequest& r, const LaneSet& set, const std::vector<int>& enabled_gpus,
                            const LaneGroupObserver& o, const job::CancelToken& c) {
    auto plans = plan_lanes(r, set, enabled_gpus);
    std::set<std::string> devices;
    for (const auto& p : plans)
      if (p.error.empty()) devices.insert(p.request.device);
    keep_only(devices);
    return run_lane_group(
        set, std::move(plans),
        [this](const job::GenerationRequest& q, const job::JobObserver& jo, const job::CancelToken& jc) {
          return run(q, jo, jc);
        },
        o, c);
  }

  void loop() {
    while (true) {
      Queued q;
      {
        std::unique_lock lock(mutex);
        wake.wait(lock, [&] { return stopping || !queue.empty() || !to_prepare.empty(); });
        if (stopping && queue.empty()) return;
        if (queue.empty()) {
          const auto r = std::move(to_prepare.front());
          to_prepare.pop_front();
          lock.unlock();
          prepare_one(r);
          continue;
        }
        q = std::move(queue.front());
        queue.pop_front();
        running = q.job;
      }
      const auto& job = q.job;
      const auto& request = q.request;
      const auto& observer = q.observer;
      if (q.lanes) {
        try {
          auto result = run_lanes(request, *q.lanes, q.enabled_gpus, q.lane_observer, job->token());
          if (q.lane_end.on_done) q.lane_end.on_done(result);
        } catch (const std::exception& e) {
          const auto message = message_of(e);
          log::get("engine").error(message);
          if (q.lane_end.on_error) q.lane_end.on_error(message);
        }
        std::lock_guard lock(mutex);
        running.reset();
        continue;
      }
      try {
        if (job->token().cancelled()) throw job::Cancelled{};
        keep_only({request.device});
        if (q.load_only) {
          const auto s = slot(request.device);
          auto preloaded = request;  // the model the job will run on
          use_embedded_inpainting_model(preloaded);
          const double prepared_ms = s->thread.run([&] { return model_in(*s, preloaded).prepare(preloaded); });
          if (observer.on_stage) observer.on_stage("loaded", prepared_ms);
        } else {
          auto result = run(request, observer, job->token());
          if (observer.on_done) observer.on_done(result);
        }
      } catch (const job::Cancelled&) {
        if (observer.on_cancelled) observer.on_cancelled();
      } catch (const std::exception& e) {
        // Other LibTorch errors arrive here too, told without their backtrace; the engine stays usable.
        const auto message = message_of(e);
        log::get("engine").error(message);
        if (observer.on_error) observer.on_error(message);
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
    impl_->queues_jobs = true;
    impl_->queue.push_back({job, std::move(request), std::move(observer), false});
  }
  impl_->wake.notify_one();
  return job;
}

std::shared_ptr<Job> Engine::submit_lanes(job::GenerationRequest request, LaneSet lanes, std::vector<int> enabled_gpus,
                                          LaneGroupObserver observer, LaneGroupEnd end) {
  auto job = std::make_shared<Job>();
  {
    std::lock_guard lock(impl_->mutex);
    Impl::Queued q{job, std::move(request), {}, false};
    q.lanes = std::move(lanes);
    q.enabled_gpus = std::move(enabled_gpus);
    q.lane_observer = std::move(observer);
    q.lane_end = std::move(end);
    impl_->queue.push_back(std::move(q));
  }
  impl_->wake.notify_one();
  return job;
}

std::shared_ptr<Job> Engine::preload(job::GenerationRequest request, job::JobObserver observer) {
  auto job = std::make_shared<Job>();
  {
    std::lock_guard lock(impl_->mutex);
    impl_->queues_jobs = true;
    impl_->queue.push_back({job, std::move(request), std::move(observer), true});
  }
  impl_->wake.notify_one();
  return job;
}

job::GenerationResult Engine::run(const job::GenerationRequest& request, const job::JobObserver& observer, const job::CancelToken& cancel) {
  return impl_->run(request, observer, cancel);
}

LaneGroupResult Engine::run_lanes(const job::GenerationRequest& request, const LaneSet& lanes,
                                  const std::vector<int>& enabled_gpus, const LaneGroupObserver& observer,
                                  const job::CancelToken& cancel) {
  return impl_->run_lanes(request, lanes, enabled_gpus, observer, cancel);
}

}  // namespace diffract::engine
