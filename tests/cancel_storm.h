#pragma once
// Jobs submitted to an engine one after the other, each cancelled after a wait (test_pipeline on
// the CPU, diffract-gpu-checks cancel_any on a GPU): how they ended, with a hook after each job
// to read the process's memory.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/engine/engine.h"

#if defined(__SANITIZE_ADDRESS__)
// The sanitizers' allocator interface (gcc ships no header for it).
extern "C" std::size_t __sanitizer_get_current_allocated_bytes();
#endif

namespace diffract::test {

// The process's memory: its resident size, or under ASan the bytes still allocated (ASan keeps
// freed blocks in its quarantine, 256 MB by default, which the resident size would count as
// growth).
inline std::int64_t process_memory_bytes() {
#if defined(__SANITIZE_ADDRESS__)
  return static_cast<std::int64_t>(__sanitizer_get_current_allocated_bytes());
#else
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<std::int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
#endif
}

struct CancelStorm {
  int cancelled = 0, finished = 0;
  std::vector<std::string> errors;
  bool hung = false;  // a job had not ended a minute after its cancel (the storm stopped there)
};

// Job i runs request(i) and is cancelled after wait(i); after(i) runs once it has ended.
inline CancelStorm cancel_storm(engine::Engine& engine, int jobs, const std::function<job::GenerationRequest(int)>& request,
                                const std::function<std::chrono::microseconds(int)>& wait,
                                const std::function<void(int)>& after = {}) {
  struct Ending {  // shared with the observer, which may outlive a hung job's turn
    std::mutex mutex;
    std::atomic<bool> ended{false};
    bool done = false, cancelled = false;
    std::string error;
  };
  CancelStorm storm;
  for (int i = 0; i < jobs; ++i) {
    const auto e = std::make_shared<Ending>();
    const auto end = [e](const std::function<void(Ending&)>& how) {
      std::lock_guard lock(e->mutex);
      how(*e);
      e->ended = true;
    };
    job::JobObserver o;
    o.on_preview = [](const job::PreviewEvent&) {};
    o.on_done = [end](const job::GenerationResult&) { end([](Ending& x) { x.done = true; }); };
    o.on_cancelled = [end] { end([](Ending& x) { x.cancelled = true; }); };
    o.on_error = [end](const std::string& m) { end([&m](Ending& x) { x.error = m; }); };
    auto job = engine.submit(request(i), o);
    std::this_thread::sleep_for(wait(i));
    job->cancel();
    for (int waited = 0; !e->ended.load() && waited < 60000; ++waited)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!e->ended.load()) {
      storm.hung = true;
      return storm;
    }
    {
      std::lock_guard lock(e->mutex);
      storm.cancelled += e->cancelled;
      storm.finished += e->done;
      if (!e->error.empty()) storm.errors.push_back(e->error);
    }
    if (after) after(i);
  }
  return storm;
}

}  // namespace diffract::test
