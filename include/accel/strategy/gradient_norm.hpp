#pragma once
// Global gradient-norm clipping over whatever each rank holds: the whole
// gradients (DDP), a shard of them (ZeRO), a slice of a layer (tensor
// parallel) or a stage (pipeline). The engine says how the partial norms
// combine (NormReduction); this is the same code for all of them.

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/strategy/engine.hpp"

namespace accel::strategy {

/// Scales `params`' gradients so that their global `norm_type` norm is at
/// most `max_norm` (torch's clip_grad_norm_ formula); returns the norm before.
inline double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, double norm_type,
                             const NormReduction& reduction) {
  // Every rank holds every gradient: exactly what a one-process loop computes.
  if (reduction.group == nullptr && reduction.masks.empty())
    return torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type);
  const bool inf_norm = std::isinf(norm_type);
  double local = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    at::Tensor grad = params[i].grad();
    if (!grad.defined()) continue;
    if (!reduction.masks.empty()) grad = grad * reduction.masks[i].to(grad.device(), grad.scalar_type());
    const double n = grad.norm(norm_type).item<double>();
    local = inf_norm ? std::max(local, n) : local + std::pow(n, norm_type);
  }
  double total = local;
  if (reduction.group != nullptr && reduction.group->distributed()) {
    auto t = at::full({1}, local, at::TensorOptions().dtype(at::kDouble));
    if (inf_norm) {
      for (auto& part : reduction.group->all_gather(t, "all-gather of gradient norm parts"))
        total = std::max(total, part.item<double>());
    } else {
      reduction.group->all_reduce(t, "all-reduce of gradient norm parts");
      total = t.item<double>();
    }
  }
  if (!inf_norm) total = std::pow(total, 1.0 / norm_type);
  const double coefficient = max_norm / (total + 1e-6);
  if (coefficient < 1)
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(coefficient);
  return total;
}

}  // namespace accel::strategy
