#pragma once
// The Trainer's loss-scaling slot: FP16 scales dynamically (GradScaler);
// FP32 and BF16 need no scaling, and their slot is an empty object whose
// calls compile away.

#include <ATen/core/Tensor.h>

#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/core/policies.hpp"
#include "accel/precision/grad_scaler.hpp"

namespace accel::precision {

template <class Precision>
class LossScaling {
 public:
  explicit LossScaling(const Precision&) {}
  const at::Tensor& scale_loss(const at::Tensor& loss) const { return loss; }
  bool unscale(const std::vector<at::Tensor>&, comm::Communicator&) { return false; }
  void update() {}
  double scale() const { return 1.0; }
  ScalerState state() const { return {1.0, 0}; }
  void load_state(const ScalerState&) {}
};

template <>
class LossScaling<FP16> {
 public:
  explicit LossScaling(const FP16& settings) : scaler_(settings) {}
  at::Tensor scale_loss(const at::Tensor& loss) const { return scaler_.scale_loss(loss); }
  bool unscale(const std::vector<at::Tensor>& params, comm::Communicator& comm) { return scaler_.unscale(params, comm); }
  void update() { scaler_.update(); }
  double scale() const { return scaler_.scale(); }
  ScalerState state() const { return scaler_.state(); }
  void load_state(const ScalerState& state) { scaler_.load_state(state); }
  GradScaler& scaler() { return scaler_; }

 private:
  GradScaler scaler_;
};

}  // namespace accel::precision
