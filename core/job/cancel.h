#pragma once
#include <atomic>

namespace diffract::job {

class CancelToken {
 public:
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  std::atomic<bool> cancelled_{false};
};

// Thrown when a job stops because its token was cancelled; the engine stays usable.
struct Cancelled {};

}  // namespace diffract::job
