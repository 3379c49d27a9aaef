#include "core/parallel/device_group.h"

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>

#include "core/job/job.h"
#include "core/util/options.h"
#include "core/util/torch_errors.h"

#ifdef DIFFRACT_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace diffract::parallel {

// Rank 0 runs on the calling thread (the job's, whose OpenMP team, cuDNN handles and tuned
// plans are warm: a second OpenMP team on a worker made a one-device strategy's UNet steps 2.3x
// slower on a 2-core CPU); one thread per further rank, bound to its device, runs the tasks
// run_all() hands out, with the caller's job-scope options.
struct DeviceGroup::Workers {
  explicit Workers(const std::vector<c10::Device>& devices) : first(devices.front()) {
    for (std::size_t r = 1; r < devices.size(); ++r)
      threads.emplace_back([this, r, d = devices[r]] { loop(static_cast<int>(r), d); });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    wake.notify_all();
    for (auto& t : threads) t.join();
  }
  // task(rank) on every rank; returns when all are done. `task` must not throw.
  void run_all(const std::function<void(int)>& t) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      task = &t;
      overrides = options::current_overrides();
      pending = static_cast<int>(threads.size());
      ++generation;
    }
    wake.notify_all();
    {
      at::NoGradGuard no_grad;
#ifdef DIFFRACT_HAS_CUDA
      std::optional<c10::cuda::CUDAGuard> bind;
      if (first.is_cuda()) bind.emplace(first);
#endif
      t(0);
    }
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [&] { return pending == 0; });
    task = nullptr;
    overrides = nullptr;
  }
  void loop(int rank, const c10::Device& device) {
    at::NoGradGuard no_grad;
#ifdef DIFFRACT_HAS_CUDA
    std::optional<c10::cuda::CUDAGuard> bind;
    if (device.is_cuda()) bind.emplace(device);
#else
    (void)device;
#endif
    std::uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* t = nullptr;
      const options::Overrides* job_options = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
        t = task;
        job_options = overrides;
      }
      {
        std::optional<options::JobOptionsScope> scope;
        if (job_options) scope.emplace(*job_options);
        (*t)(rank);
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (--pending == 0) done.notify_all();
    }
  }

  c10::Device first;
  std::mutex mutex;
  std::condition_variable wake, done;
  const std::function<void(int)>* task = nullptr;
  const options::Overrides* overrides = nullptr;
  std::uint64_t generation = 0;
  int pending = 0;
  bool stop = false;
  std::vector<std::thread> threads;
};

DeviceGroup::DeviceGroup(std::vector<c10::Device> devices, std::function<Comms()> make, bool keep)
    : devices_(std::move(devices)), make_comms_(std::move(make)), keep_comms_(keep),
      workers_(std::make_unique<Workers>(devices_)) {}

DeviceGroup::~DeviceGroup() = default;

void DeviceGroup::run_on(int rank, const std::function<void()>& f) {
  if (rank < 0 || rank >= size()) throw Error("rank " + std::to_string(rank) + " is not in this group of " + std::to_string(size()));
  std::exception_ptr error;
  workers_->run_all([&](int r) {
    if (r != rank) return;
    try {
      f();
    } catch (...) {
      error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

std::unique_ptr<DeviceGroup> DeviceGroup::virtual_cpu(int n) {
  if (n < 1 || n > 64) throw Error("a device group needs 1 to 64 devices, not " + std::to_string(n));
  return std::unique_ptr<DeviceGroup>(new DeviceGroup(std::vector<c10::Device>(static_cast<std::size_t>(n), c10::Device(c10::kCPU)),
                                                      [n] { return make_in_process_group(n); }, false));
}

std::unique_ptr<DeviceGroup> DeviceGroup::cuda(const std::vector<int>& ids) {
  if (ids.empty()) throw Error("a GPU group needs at least one device");
#ifdef DIFFRACT_HAS_CUDA
  const int count = c10::cuda::device_count();
#else
  const int count = 0;
#endif
  std::vector<c10::Device> devices;
  for (int id : ids) {
    if (id < 0 || id >= count)
      throw Error("GPU group: cuda:" + std::to_string(id) + " does not exist (" + std::to_string(count) + " CUDA device(s))");
    for (const auto& d : devices)
      if (d.index() == id) throw Error("GPU group: cuda:" + std::to_string(id) + " is listed twice");
    devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(id));
  }
  if (!nccl_available()) make_nccl_group(ids);  // throws the reason
  return std::unique_ptr<DeviceGroup>(new DeviceGroup(std::move(devices), [ids] { return make_nccl_group(ids); }, true));
}

std::unique_ptr<DeviceGroup> DeviceGroup::parse(const std::string& spec) {
  for (const std::string prefix : {"cpu*", "virtual:"}) {
    if (spec.rfind(prefix, 0) == 0) {
      try {
        std::size_t used = 0;
        const int n = std::stoi(spec.substr(prefix.size()), &used);
        if (used == spec.size() - prefix.size()) return virtual_cpu(n);
      } catch (const std::logic_error&) {
      }
      throw Error("device group '" + spec + "': expected " + prefix + "N with N a number");
    }
  }
  if (spec.rfind("cuda", 0) == 0) {
    std::vector<int> ids;
    std::size_t pos = 0;
    while (pos <= spec.size()) {
      const auto end = std::min(spec.find(',', pos), spec.size());
      const auto item = spec.substr(pos, end - pos);
      try {
        std::size_t used = 0;
        if (item.rfind("cuda:", 0) != 0) throw std::invalid_argument(item);
        ids.push_back(std::stoi(item.substr(5), &used));
        if (used != item.size() - 5) throw std::invalid_argument(item);
      } catch (const std::logic_error&) {
        throw Error("device group '" + spec + "': '" + item + "' is not cuda:N");
      }
      pos = end + 1;
    }
    return cuda(ids);
  }
  throw Error("device group '" + spec + "' is not 'virtual:N', 'cpu*N' or 'cuda:0,cuda:1,...'");
}

std::string DeviceGroup::device_name(int rank) const {
  const auto& d = device(rank);
  return d.is_cpu() ? "cpu:virtual " + std::to_string(rank) : d.str();
}

namespace {
// cuDNN's autotuning of a convolution it has not timed yet calls cudaDeviceSynchronize and
// empties the allocator's cache (cudaFree, which synchronises too). On a rank whose device holds
// an NCCL receive waiting for a peer whose thread is blocked the same way, neither returns: the
// stacks of AsyncDiff's hang on two GPUs (docs/benchmarks.md) were exactly these two. While ranks
// run, convolutions take cuDNN's heuristic choice instead; graphs captured before keep theirs.
class NoCudnnAutotuning {
 public:
  explicit NoCudnnAutotuning(bool on) : on_(on), was_(at::globalContext().benchmarkCuDNN()) {
    if (on_) at::globalContext().setBenchmarkCuDNN(false);
  }
  ~NoCudnnAutotuning() {
    if (on_) at::globalContext().setBenchmarkCuDNN(was_);
  }

 private:
  bool on_, was_;
};
}  // namespace

void DeviceGroup::run(const std::function<void(int rank, Communicator& comm)>& fn) {
  if (!keep_comms_ || comms_.empty()) comms_ = make_comms_();
  const NoCudnnAutotuning no_autotuning(size() > 1 && device(0).is_cuda());
  auto& comms = comms_;
  std::mutex mutex;
  std::exception_ptr first;
  int first_rank = -1;
  workers_->run_all([&](int r) {
    Communicator& comm = *comms[static_cast<std::size_t>(r)];
    try {
      fn(r, comm);
    } catch (...) {
      std::string what = "unknown error";
      try {
        throw;
      } catch (const job::Cancelled&) {
        what = "cancelled";
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first) {
          first = std::current_exception();
          first_rank = r;
        }
      }
      // Cancellation reaches every rank at the same round (the strategies decide it once per
      // round), so only failures need the others released.
      if (what != "cancelled") comm.abort("device " + std::to_string(r) + " failed: " + what);
    }
  });
  if (!first) return;
  comms_.clear();  // an aborted or half-used set is not reused
  const std::string where = "device " + std::to_string(first_rank) + " (" + device_name(first_rank) + "): ";
  try {
    std::rethrow_exception(first);
  } catch (const job::Cancelled&) {
    throw;
  } catch (const std::exception& e) {
    if (const auto why = out_of_memory_reason(e)) throw DeviceOutOfMemory(device_name(first_rank), *why, where + *why);
    throw Error(where + message_of(e));
  } catch (...) {
    throw Error(where + "unknown error");
  }
}

}  // namespace diffract::parallel
