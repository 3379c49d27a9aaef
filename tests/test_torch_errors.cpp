// LibTorch's exceptions as a user reads them (core/util/torch_errors.h): running out of memory
// recognised from the CPU allocator's real failure, the GPU allocator's error type and
// std::bad_alloc; other errors not taken for it; messages without LibTorch's backtrace.
#include <QtTest>

#include <new>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "core/util/error.h"
#include "core/util/torch_errors.h"

using namespace diffract;

class TestTorchErrors : public QObject {
  Q_OBJECT

 private slots:
  void cpuAllocatorFailureIsOutOfMemory() {
    // A petabyte: the CPU allocator refuses it at once (no memory is touched).
    try {
      (void)at::empty({std::int64_t(1) << 50}, at::kByte);
      QSKIP("this machine's allocator granted a petabyte");
    } catch (const std::exception& e) {
      const auto why = out_of_memory_reason(e);
      QVERIFY2(why.has_value(), message_of(e).c_str());
      QVERIFY2(why->rfind("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes", 0) == 0,
               why->c_str());
      QVERIFY(why->find('\n') == std::string::npos && why->size() <= 300);
    }
  }

  void gpuAllocatorErrorAndBadAllocAreOutOfMemory() {
    try {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines");
    } catch (const std::exception& e) {
      QCOMPARE(out_of_memory_reason(e).value_or(""), std::string("CUDA out of memory. Tried to allocate 2.00 GiB"));
    }
    QVERIFY(out_of_memory_reason(std::bad_alloc()).has_value());
  }

  void otherErrorsAreNotOutOfMemory() {
    try {
      TORCH_CHECK(false, "shapes [2, 3] and [4] cannot be multiplied");
    } catch (const std::exception& e) {
      QVERIFY(!out_of_memory_reason(e).has_value());
      QCOMPARE(message_of(e), std::string("shapes [2, 3] and [4] cannot be multiplied"));
      QVERIFY(std::string(e.what()).size() > message_of(e).size());  // what() carries the backtrace
    }
    QVERIFY(!out_of_memory_reason(Error("out of memory in the name only")).has_value());
    QVERIFY(!out_of_memory_reason(std::runtime_error("DefaultCPUAllocator: can't allocate memory")).has_value());
    QCOMPARE(message_of(std::runtime_error("plain")), std::string("plain"));
  }
};

QTEST_GUILESS_MAIN(TestTorchErrors)
#include "test_torch_errors.moc"
