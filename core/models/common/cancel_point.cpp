#include "core/models/common/cancel_point.h"

namespace diffract::models {

namespace {
thread_local const job::CancelToken* t_token = nullptr;
}  // namespace

CancelScope::CancelScope(const job::CancelToken* token) : previous_(t_token) { t_token = token; }
CancelScope::~CancelScope() { t_token = previous_; }

void cancel_point() {
  if (t_token && t_token->cancelled()) throw job::Cancelled{};
}

}  // namespace diffract::models
