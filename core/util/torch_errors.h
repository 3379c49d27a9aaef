#pragma once
// LibTorch's exceptions as a user reads them: without the C++ backtrace LibTorch appends, and
// running out of memory told apart from other failures (the CPU allocator throws a plain
// c10::Error for it).
#include <exception>
#include <optional>
#include <string>

namespace diffract {

// e.what(), or for LibTorch's errors their message without the backtrace.
std::string message_of(const std::exception& e);

// The allocator's words, on one line of at most 300 characters, when `e` is running out of
// memory: a GPU's caching allocator (c10::OutOfMemoryError), the CPU allocator ("can't allocate
// memory"), or std::bad_alloc; nothing for any other error.
std::optional<std::string> out_of_memory_reason(const std::exception& e);

}  // namespace diffract
