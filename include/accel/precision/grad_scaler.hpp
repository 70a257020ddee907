#pragma once
// Dynamic loss scaling for FP16: PyTorch's GradScaler algorithm and defaults.
// LibTorch's C++ API has no GradScaler; its fused `_amp_*` kernels exist for
// CUDA (and CPU from 2.3), so unscaling uses them where they exist and a
// plain per-tensor path elsewhere (compat::fused_amp_ops_available).
//
// NOTE [Loss scaling across ranks]
// The inf/NaN verdict is all-reduced before the step, so every rank skips
// together: with sharded gradients a rank may see an overflow the others
// cannot, and a step taken by some ranks only would desynchronise them.

#include <ATen/core/Tensor.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/policies.hpp"

namespace accel::precision {

/// What a checkpoint stores of the scaler (Accelerate's scaler.pt).
struct ScalerState {
  double scale = 65536.0;
  std::int64_t growth_tracker = 0;
};

class GradScaler {
 public:
  explicit GradScaler(const FP16& settings) : settings_(settings) { state_.scale = settings.init_scale; }

  double scale() const { return state_.scale; }
  const ScalerState& state() const { return state_; }
  void load_state(const ScalerState& state) {
    state_ = state;
    unscaled_.clear();
  }

  /// The loss to call backward on.
  at::Tensor scale_loss(const at::Tensor& loss) const { return loss * state_.scale; }

  /// Divides the gradients by the scale (once per optimizer and step:
  /// clipping calls it before the optimizer step does; `params` stands for
  /// its optimizer) and returns whether any rank found an inf or NaN.
  bool unscale(const std::vector<at::Tensor>& params, comm::Communicator& comm) {
    const void* key = params.empty() ? nullptr : params.front().unsafeGetTensorImpl();
    for (const auto& [seen, found] : unscaled_)
      if (seen == key) return found;
    std::vector<at::Tensor> grads;
    for (const auto& p : params)
      if (p.grad().defined()) grads.push_back(p.grad());
    bool found = false;
    if (!grads.empty() && compat::fused_amp_ops_available(grads.front().device().type())) {
      auto found_inf = at::zeros({1}, grads.front().options().dtype(at::kFloat));
      auto inv_scale = at::full({1}, 1.0 / state_.scale, grads.front().options().dtype(at::kFloat));
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
      found = found_inf.item<float>() != 0.0f;
    } else {
      const double inv = 1.0 / state_.scale;
      for (auto& g : grads) {
        // max|g| is inf for an inf and NaN for a NaN (max propagates NaN).
        if (!std::isfinite(g.abs().max().item<double>())) found = true;
        g.mul_(inv);
      }
    }
    if (comm.distributed()) {
      auto flag = at::full({1}, found ? 1.0f : 0.0f, at::TensorOptions().device(grads.empty() ? at::kCPU : grads.front().device()));
      comm.all_reduce(flag, "all-reduce of the fp16 overflow flag");
      found = flag.item<float>() != 0.0f;
    }
    unscaled_.emplace_back(key, found);
    return found;
  }

  /// The scale after a step: back off on overflow, grow after
  /// `growth_interval` clean steps in a row. As torch.amp.GradScaler.update,
  /// an inf or NaN in any optimizer unscaled since the last update counts,
  /// and each is unscaled anew afterwards.
  void update() {
    const bool found_inf = std::any_of(unscaled_.begin(), unscaled_.end(), [](const auto& u) { return u.second; });
    if (found_inf) {
      state_.scale *= settings_.backoff_factor;
      state_.growth_tracker = 0;
    } else if (++state_.growth_tracker == settings_.growth_interval) {
      state_.scale *= settings_.growth_factor;
      state_.growth_tracker = 0;
    }
    unscaled_.clear();
  }

 private:
  FP16 settings_;
  ScalerState state_;
  std::vector<std::pair<const void*, bool>> unscaled_;  // per optimizer unscaled since the last update: found an inf
};

}  // namespace accel::precision
