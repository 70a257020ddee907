#pragma once
// Which parameters a loss reaches, found before its backward runs: DDP's
// find_unused_parameters, and a Trainer with several models, which
// synchronises only the models a backward reaches (NOTE [Several models] in
// <accel/trainer.hpp>).

#include <ATen/core/Tensor.h>

#include <unordered_set>
#include <vector>

#include "accel/core/compiled_once.hpp"

namespace accel::strategy {

/// Every autograd node reachable from `loss`'s gradient function, by address
/// (the leaves' AccumulateGrad nodes among them).
ACCEL_COMPILED_ONCE std::unordered_set<const void*> reachable_nodes(const at::Tensor& loss);

/// Whether `parameter`'s gradient sink is among `nodes`: the backward from
/// that loss writes its gradient.
ACCEL_COMPILED_ONCE bool reaches(const std::unordered_set<const void*>& nodes, const at::Tensor& parameter);

}  // namespace accel::strategy

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

namespace accel::strategy {

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE std::unordered_set<const void*> reachable_nodes(const at::Tensor& loss) {
  std::unordered_set<const void*> seen;
  std::vector<torch::autograd::Node*> stack;
  if (auto root = loss.grad_fn()) stack.push_back(root.get());
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  return seen;
}

ACCEL_COMPILED_ONCE bool reaches(const std::unordered_set<const void*>& nodes, const at::Tensor& parameter) {
  // A parameter no graph was ever built through has no sink yet: none reaches it.
  const auto sink = torch::autograd::impl::try_get_grad_accumulator(parameter);
  return sink != nullptr && nodes.count(sink.get()) > 0;
}

}  // namespace accel::strategy
#endif
