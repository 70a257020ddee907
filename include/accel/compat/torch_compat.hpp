#pragma once
// NOTE [LibTorch versions]
// Every difference between LibTorch 1.13 (Debian's) and 2.x that accel meets
// lives in this header, behind names of accel's own; nothing else in the
// library tests TORCH_VERSION_*.

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/version.h>

#define ACCEL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace accel::compat {

// ---------------------------------------------------------------- c10d
// LibTorch 2.0 split ProcessGroup into a dispatching front and per-backend
// `Backend`s; ProcessGroupGloo/NCCL derive from the latter. Both expose the
// same collective methods, which is all accel calls.
#if ACCEL_TORCH_AT_LEAST(2, 0)
using CollectiveBackend = c10d::Backend;
#else
using CollectiveBackend = c10d::ProcessGroup;
#endif
using Work = c10d::Work;

// ---------------------------------------------------------------- autocast
// 1.13 has per-device entry points (set_cpu_enabled, set_autocast_cpu_dtype,
// set_enabled for CUDA); 2.4 folded them into (device_type, ...) overloads.
inline bool autocast_enabled(c10::DeviceType device) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CPU) at::autocast::set_cpu_enabled(enabled);
  else at::autocast::set_enabled(enabled);
#endif
}

inline at::ScalarType autocast_dtype(c10::DeviceType device) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CPU) at::autocast::set_autocast_cpu_dtype(dtype);
  else at::autocast::set_autocast_gpu_dtype(dtype);
#endif
}

// ---------------------------------------------------------------- loss scaling
/// Whether `_amp_foreach_non_finite_check_and_unscale_` / `_amp_update_scale_`
/// have kernels for this device: CUDA always, CPU from 2.3.
inline bool fused_amp_ops_available(c10::DeviceType device) {
  if (device == c10::DeviceType::CUDA) return true;
  return ACCEL_TORCH_AT_LEAST(2, 3);
}

// ---------------------------------------------------------------- autograd
/// The post-hook interface of autograd nodes (same signature in 1.13 and 2.x).
using PostHook = torch::autograd::FunctionPostHook;

}  // namespace accel::compat
