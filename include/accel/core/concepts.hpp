#pragma once
// Concepts that check what goes into each policy slot of the Trainer. Each
// is built on an opt-in variable (stdexec's `enable_sender` idiom), so a user
// who writes a policy of their own says so explicitly:
//   template <> inline constexpr bool accel::enable_strategy_policy<MyDP> = true;

#include <concepts>
#include <type_traits>

#include "accel/core/policies.hpp"

namespace at {
class Tensor;  // the step function's result is checked without LibTorch
}

namespace accel {

template <class T>
inline constexpr bool enable_strategy_policy = false;
template <>
inline constexpr bool enable_strategy_policy<SingleProcess> = true;
template <>
inline constexpr bool enable_strategy_policy<DDP> = true;
template <int Stage>
inline constexpr bool enable_strategy_policy<ZeRO<Stage>> = true;
template <class Data>
inline constexpr bool enable_strategy_policy<Parallel<Data>> = true;
template <>
inline constexpr bool enable_strategy_policy<HybridShard> = true;

template <class T>
inline constexpr bool enable_precision_policy = false;
template <>
inline constexpr bool enable_precision_policy<FP32> = true;
template <>
inline constexpr bool enable_precision_policy<BF16> = true;
template <>
inline constexpr bool enable_precision_policy<FP16> = true;

template <class T>
inline constexpr bool enable_device_policy = false;
template <>
inline constexpr bool enable_device_policy<CPU> = true;
template <>
inline constexpr bool enable_device_policy<CUDA> = true;

/// A strategy tag: opted in, default-constructible settings, says whether it
/// communicates, and names its engine (one class, whatever the precision and device).
template <class S>
concept strategy_policy =
    enable_strategy_policy<S> && std::is_aggregate_v<S> && std::default_initializable<S> &&
    requires {
      { S::distributed } -> std::convertible_to<bool>;
      typename S::engine;
    };

template <class P>
concept precision_policy = enable_precision_policy<P> && std::default_initializable<P> &&
                           requires { { P::name } -> std::convertible_to<const char*>; };

template <class D>
concept device_policy = enable_device_policy<D> && std::default_initializable<D> &&
                        requires { { D::name } -> std::convertible_to<const char*>; };

/// What `Trainer::step` accepts: a callable taking nothing that runs the
/// forward pass and returns the loss as an `at::Tensor` (= `torch::Tensor`).
template <class F>
concept step_function =
    std::invocable<F&> && std::same_as<std::remove_cvref_t<std::invoke_result_t<F&>>, at::Tensor>;

}  // namespace accel
