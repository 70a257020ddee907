#pragma once
// NOTE [LibTorch versions]
// Every difference between LibTorch 1.13 (Debian's) and 2.x that accel meets
// lives in this header, behind names of accel's own; nothing else in the
// library tests TORCH_VERSION_*.

#include <c10/core/Allocator.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>
// The collective base class only: the Gloo and NCCL process groups are
// needed where one is made (comm/communicator.hpp, compiled once).
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "accel/core/compiled_once.hpp"

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

/// Whether Gloo reduces bf16 (all-reduce, all-to-all): not in 1.13 ("Invalid
/// scalar type"); yes in 2.11 and 2.15, the versions
/// bench/gloo_capabilities.py was run on (README, "LibTorch 2.x").
inline constexpr bool gloo_reduces_bf16 = ACCEL_TORCH_AT_LEAST(2, 11);

/// Whether Gloo bounds each operation by the timeout in its options: 2.x's
/// AsyncWork carries one (checked on 2.11 and 2.15); 1.13's bounds every
/// operation by the timeout the process group was created with.
inline constexpr bool gloo_has_per_operation_timeout = ACCEL_TORCH_AT_LEAST(2, 11);

// ---------------------------------------------------------------- autocast
// 1.13 has per-device entry points (set_cpu_enabled, set_autocast_cpu_dtype,
// set_enabled for CUDA); 2.4 folded them into (device_type, ...) overloads.
// Compiled once: in 2.x <ATen/autocast_mode.h> brings every operator's
// declaration (ATen/Operators.h), seconds of parsing in each user TU.
ACCEL_COMPILED_ONCE bool autocast_enabled(c10::DeviceType device);
ACCEL_COMPILED_ONCE void set_autocast_enabled(c10::DeviceType device, bool enabled);
ACCEL_COMPILED_ONCE at::ScalarType autocast_dtype(c10::DeviceType device);
ACCEL_COMPILED_ONCE void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype);

/// Entering and leaving an autocast region (nesting-safe: the cast cache is
/// cleared when the outermost one ends).
ACCEL_COMPILED_ONCE void enter_autocast();
ACCEL_COMPILED_ONCE void leave_autocast();

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

/// An owning handle to an autograd node: std::shared_ptr<Node> in 1.13,
/// c10::intrusive_ptr<Node> in recent 2.x.
using NodeHandle = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// ---------------------------------------------------------------- optimizers
/// The key of `parameter` in `optimizer.state()`: 1.13 keys the map by the
/// printed TensorImpl address (a std::string), recent 2.x by the TensorImpl*.
template <class Optimizer>
auto optimizer_state_key(const Optimizer& optimizer, const at::Tensor& parameter) {
  using Key = typename std::remove_cvref_t<decltype(optimizer.state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream address;
    address << parameter.unsafeGetTensorImpl();
    return address.str();
  } else {
    return Key(parameter.unsafeGetTensorImpl());
  }
}

/// The dtype a Gloo list all-gather carries `dtype` in where Gloo refuses it
/// as it is (measured: bool and int16 in 1.13 and 2.15, bf16 in 1.13, with
/// "Invalid scalar type"); nullopt where Gloo takes it. Each carrier holds
/// every value exactly.
inline std::optional<at::ScalarType> gloo_all_gather_carrier(at::ScalarType dtype) {
  if (dtype == at::kBool) return at::kByte;
  if (dtype == at::kShort) return at::kInt;
  if (dtype == at::kBFloat16 && !ACCEL_TORCH_AT_LEAST(2, 0)) return at::kFloat;
  return std::nullopt;
}

// ---------------------------------------------------------------- profiler
/// Opens a profiler range under a name accel built. 1.13 takes the name as a
/// std::string and keeps it; 2.x takes a std::string_view, so the caller
/// keeps `name` alive for as long as the range (profiling::Range does).
inline void begin_record_function(at::RecordFunction& guard, const std::string& name) {
#if ACCEL_TORCH_AT_LEAST(2, 0)
  guard.before(std::string_view(name));
#else
  guard.before(std::string(name));
#endif
}

// ---------------------------------------------------------------- CUDA memory
/// Peak bytes the caching allocator has handed out on GPU `index` since the
/// last reset (torch.cuda.max_memory_allocated); 0 without CUDA.
ACCEL_COMPILED_ONCE std::int64_t cuda_peak_allocated_bytes(int index);

ACCEL_COMPILED_ONCE void reset_cuda_peak(int index);

/// Returns the caching allocator's unused blocks to the driver
/// (torch.cuda.empty_cache), after an out-of-memory error; nothing without CUDA.
ACCEL_COMPILED_ONCE void cuda_empty_cache();

// ---------------------------------------------------------------- allocators
/// A c10::Allocator written once for both versions: 2.3 made `allocate`
/// non-const and added `copy_data`; a derived allocator implements
/// `allocate_bytes` and copies with memcpy (host memory).
class HostAllocatorBase : public c10::Allocator {
 public:
#if ACCEL_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(std::size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
#else
  c10::DataPtr allocate(std::size_t n) const override { return const_cast<HostAllocatorBase*>(this)->allocate_bytes(n); }
#endif

 protected:
  virtual c10::DataPtr allocate_bytes(std::size_t n) = 0;
};

}  // namespace accel::compat

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/autocast_mode.h>
#if ACCEL_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace accel::compat {

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE bool autocast_enabled(c10::DeviceType device) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

ACCEL_COMPILED_ONCE void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CPU) at::autocast::set_cpu_enabled(enabled);
  else at::autocast::set_enabled(enabled);
#endif
}

ACCEL_COMPILED_ONCE at::ScalarType autocast_dtype(c10::DeviceType device) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
#endif
}

ACCEL_COMPILED_ONCE void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
#if ACCEL_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CPU) at::autocast::set_autocast_cpu_dtype(dtype);
  else at::autocast::set_autocast_gpu_dtype(dtype);
#endif
}

ACCEL_COMPILED_ONCE void enter_autocast() { at::autocast::increment_nesting(); }

ACCEL_COMPILED_ONCE void leave_autocast() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
}

ACCEL_COMPILED_ONCE std::int64_t cuda_peak_allocated_bytes([[maybe_unused]] int index) {
#if ACCEL_WITH_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return stats.allocated_bytes[0].peak;  // [0]: StatType::AGGREGATE (the enum moved namespaces in 2.x)
#else
  return 0;
#endif
}

ACCEL_COMPILED_ONCE void reset_cuda_peak([[maybe_unused]] int index) {
#if ACCEL_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
#endif
}

ACCEL_COMPILED_ONCE void cuda_empty_cache() {
#if ACCEL_WITH_CUDA
  c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

}  // namespace accel::compat

#endif
