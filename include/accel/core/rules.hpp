#pragma once
// The rules a Trainer's policies must obey, as static_asserts with a sentence
// that names the fix (CUTLASS style: a message, not a template backtrace).
// `Trainer` instantiates `check_policies` first thing, so these are the
// messages a user sees.

#include <type_traits>

#include "accel/core/concepts.hpp"

namespace accel::detail {

// Parallel<Data>: the data dimension takes DDP or ZeRO<1|2|3>.
template <class S>
struct check_data_strategy {
  static constexpr bool value = true;
};
template <class Data>
struct check_data_strategy<Parallel<Data>> {
  static_assert(std::is_same_v<Data, DDP> || std::is_same_v<Data, ZeRO<1>> || std::is_same_v<Data, ZeRO<2>> ||
                    std::is_same_v<Data, ZeRO<3>>,
                "accel: Parallel<Data> takes accel::DDP or accel::ZeRO<1|2|3> over the data dimension (for "
                "HybridShard's replicas of shard groups, use Parallel<ZeRO<3>> within a machine and DDP-style "
                "replicas, or accel::HybridShard alone)");
  static constexpr bool value = true;
};

template <class S, class P, class D>
struct check_policies {
  static_assert(enable_strategy_policy<S>,
                "accel: the first Trainer parameter must be a strategy policy "
                "(accel::SingleProcess, accel::DDP, accel::ZeRO<1|2|3>, accel::FSDP<...>); for a policy of your own, "
                "specialise accel::enable_strategy_policy<T> = true");
  static_assert(enable_precision_policy<P>,
                "accel: the second Trainer parameter must be a precision policy "
                "(accel::FP32, accel::BF16, accel::FP16)");
  static_assert(enable_device_policy<D>,
                "accel: the third Trainer parameter must be a device policy (accel::CPU, accel::CUDA)");
  static_assert(check_data_strategy<S>::value);
  static_assert(!(std::is_same_v<P, FP16> && std::is_same_v<D, CPU>),
                "accel: FP16 autocast does not run on CPU (LibTorch's CPU autocast is bf16-only): "
                "use accel::BF16 on CPU, or accel::FP16 with accel::CUDA");
  static constexpr bool value = true;
};

template <class F>
struct check_step_function {
  static_assert(std::invocable<F&>,
                "accel: the step function must take no arguments: capture the batch in the lambda, "
                "e.g. trainer.step([&] { return loss_fn(model(x), y); })");
  static_assert(step_function<F>,
                "accel: the step function must return the loss as a torch::Tensor "
                "(return the loss tensor itself, not loss.item<float>())");
  static constexpr bool value = true;
};

}  // namespace accel::detail
