#pragma once
// `Trainer::autocast()`: the forward pass under LibTorch autocast in the
// precision policy's dtype; parameters stay fp32 (master weights), as in
// PyTorch AMP. FP32's scope is an empty object the optimiser removes.

#include "accel/compat/torch_compat.hpp"
#include "accel/core/policies.hpp"

namespace accel::precision {

template <class Precision>
inline constexpr bool uses_autocast = false;
template <>
inline constexpr bool uses_autocast<BF16> = true;
template <>
inline constexpr bool uses_autocast<FP16> = true;

template <class Precision>
inline constexpr at::ScalarType autocast_dtype_of = at::kFloat;
template <>
inline constexpr at::ScalarType autocast_dtype_of<BF16> = at::kBFloat16;
template <>
inline constexpr at::ScalarType autocast_dtype_of<FP16> = at::kHalf;

/// RAII: autocast on for the device in the precision's dtype, restored on exit
/// (nesting-safe: the cast cache is cleared when the outermost scope ends).
template <class Precision>
class AutocastScope {
 public:
  explicit AutocastScope(c10::DeviceType device)
      : device_(device),
        was_enabled_(compat::autocast_enabled(device)),
        previous_dtype_(compat::autocast_dtype(device)) {
    compat::set_autocast_enabled(device_, true);
    compat::set_autocast_dtype(device_, autocast_dtype_of<Precision>);
    compat::enter_autocast();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  ~AutocastScope() {
    compat::leave_autocast();
    compat::set_autocast_enabled(device_, was_enabled_);
    compat::set_autocast_dtype(device_, previous_dtype_);
  }

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  at::ScalarType previous_dtype_;
};

template <>
class AutocastScope<FP32> {
 public:
  explicit AutocastScope(c10::DeviceType) {}
  // User-provided, as the other scopes' is: `auto scope = trainer.autocast();`
  // then reads as RAII under FP32 too, not as a variable set but never used
  // (g++ -Wall warned on the README's own loop, examples/gan.cpp).
  ~AutocastScope() {}
};

}  // namespace accel::precision
