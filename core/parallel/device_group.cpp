#include "core/parallel/device_group.h"

#include <exception>
#include <mutex>
#include <thread>

#include <ATen/core/grad_mode.h>

#include "core/engine/generation.h"

namespace diffract::parallel {

std::unique_ptr<DeviceGroup> DeviceGroup::virtual_cpu(int n) {
  if (n < 1 || n > 64) throw Error("a device group needs 1 to 64 devices, not " + std::to_string(n));
  return std::unique_ptr<DeviceGroup>(new DeviceGroup(std::vector<c10::Device>(static_cast<std::size_t>(n), c10::Device(c10::kCPU))));
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
  if (spec.rfind("cuda", 0) == 0)
    throw Error("device group '" + spec + "': multi-GPU groups need the NCCL communicator, not built yet (use virtual:N)");
  throw Error("device group '" + spec + "' is not 'virtual:N' or 'cpu*N'");
}

std::string DeviceGroup::device_name(int rank) const {
  const auto& d = device(rank);
  return d.is_cpu() ? "cpu:virtual " + std::to_string(rank) : d.str();
}

void DeviceGroup::run(const std::function<void(int rank, Communicator& comm)>& fn) {
  auto comms = make_in_process_group(size());
  std::mutex mutex;
  std::exception_ptr first;
  int first_rank = -1;
  std::vector<std::thread> workers;
  workers.reserve(comms.size());
  for (int r = 0; r < size(); ++r) {
    workers.emplace_back([&, r] {
      Communicator& comm = *comms[static_cast<std::size_t>(r)];
      try {
        at::NoGradGuard no_grad;
        fn(r, comm);
      } catch (...) {
        std::string what = "unknown error";
        try {
          throw;
        } catch (const engine::Cancelled&) {
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
        comm.abort("device " + std::to_string(r) + " failed: " + what);
      }
    });
  }
  for (auto& w : workers) w.join();
  if (!first) return;
  try {
    std::rethrow_exception(first);
  } catch (const engine::Cancelled&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("device " + std::to_string(first_rank) + " (" + device_name(first_rank) + "): " + e.what());
  } catch (...) {
    throw Error("device " + std::to_string(first_rank) + " (" + device_name(first_rank) + "): unknown error");
  }
}

}  // namespace diffract::parallel
