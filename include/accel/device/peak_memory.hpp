#pragma once
// Peak memory as a user would measure it, between a reset and a read: on a
// GPU the caching allocator's peak of allocated bytes
// (torch.cuda.max_memory_allocated); on the CPU the process's peak resident
// set (VmHWM), which the kernel resets through /proc/self/clear_refs.

#include <c10/core/Device.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#include "accel/compat/torch_compat.hpp"

namespace accel::device {

namespace detail {
inline std::int64_t status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream value(line.substr(field.size() + 1));
      std::int64_t kib = 0;
      value >> kib;
      return kib;
    }
  return 0;
}
}  // namespace detail

/// Starts a new peak. On the CPU the peak restarts from the current resident
/// set; where /proc is missing it keeps the process's lifetime peak.
inline void reset_peak_memory(const at::Device& device) {
  if (device.is_cuda()) return compat::reset_cuda_peak(device.index());
  std::ofstream("/proc/self/clear_refs") << "5";  // 5: reset the peak RSS (proc(5))
}

/// Peak bytes since the last reset_peak_memory (see the header comment for
/// what each device counts); 0 where it cannot be read.
inline std::int64_t peak_memory_bytes(const at::Device& device) {
  if (device.is_cuda()) return compat::cuda_peak_allocated_bytes(device.index());
  return detail::status_kib("VmHWM") * 1024;
}

}  // namespace accel::device
