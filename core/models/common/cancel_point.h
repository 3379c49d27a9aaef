#pragma once
// Cancellation inside one evaluation, for eager steps that take long (a large image on the CPU:
// a single UNet step at 2048² runs for minutes there). A job's thread holds its token in a
// CancelScope; the models' blocks call cancel_point() between them, which throws job::Cancelled
// once the token is cancelled, so a cancel lands within a block rather than after the step.
// Threads without a scope (a strategy's other ranks, which stop between rounds) never throw. A
// CUDA graph replay runs no host code: graphed steps stop at their end, and they are short.
#include "core/job/cancel.h"

namespace diffract::models {

class CancelScope {
 public:
  explicit CancelScope(const job::CancelToken* token);
  ~CancelScope();
  CancelScope(const CancelScope&) = delete;
  CancelScope& operator=(const CancelScope&) = delete;

 private:
  const job::CancelToken* previous_;
};

// Throws job::Cancelled when this thread's scope holds a cancelled token.
void cancel_point();

}  // namespace diffract::models
