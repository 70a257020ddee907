#pragma once
// The model state one rank holds, in bytes: what Trainer::model_state_bytes
// counts from the tensors and `accel estimate-memory` predicts from the
// shapes. Torch-free.

#include <cstdint>

namespace accel {

/// Bytes of model state this rank holds (the ZeRO paper's accounting):
/// parameter storage, gradient storage, and the optimizer's per-element state
/// (scalar counters such as Adam's step are not counted).
struct ModelStateBytes {
  // Held on the training device (for a CPU device: all of it, except what
  // the offload fields below count).
  std::int64_t parameters = 0;
  std::int64_t gradients = 0;
  std::int64_t optimizer_state = 0;
  // Held in host memory by cpu_offload (NOTE [CPU offload]): the shards'
  // host twins the optimizer steps, their gradients, and the optimizer state.
  std::int64_t offloaded_parameters = 0;
  std::int64_t offloaded_gradients = 0;
  std::int64_t offloaded_optimizer_state = 0;
  std::int64_t total() const { return parameters + gradients + optimizer_state; }
  std::int64_t offloaded_total() const { return offloaded_parameters + offloaded_gradients + offloaded_optimizer_state; }
  bool operator==(const ModelStateBytes&) const = default;
  /// Several models' state together (a Trainer with several models).
  ModelStateBytes& operator+=(const ModelStateBytes& more) {
    parameters += more.parameters;
    gradients += more.gradients;
    optimizer_state += more.optimizer_state;
    offloaded_parameters += more.offloaded_parameters;
    offloaded_gradients += more.offloaded_gradients;
    offloaded_optimizer_state += more.offloaded_optimizer_state;
    return *this;
  }
};

}  // namespace accel
