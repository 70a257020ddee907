#pragma once
// What the pure plans (bucket_plan.hpp, unit_plan.hpp) need of a LibTorch
// model and optimizer: the module tree with parameters named by index, and
// the optimizer group of a parameter. Shared by the engines and the estimate.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <vector>

#include "accel/strategy/unit_plan.hpp"

namespace accel::strategy {

/// The module tree of unit_plan.hpp, parameters named by their index in
/// `params` (the trained ones; others are left out, as no engine shards them).
inline ModuleNode module_tree(const torch::nn::Module& m, const std::vector<at::Tensor>& params) {
  ModuleNode node{.class_name = m.name()};
  for (const auto& p : m.named_parameters(/*recurse=*/false))
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].is_same(p.value())) {
        node.params.push_back(i);
        break;
      }
  for (const auto& child : m.named_children()) node.children.emplace_back(child.key(), module_tree(*child.value(), params));
  return node;
}

/// The index of the optimizer group that holds `p`; -1 if none does (its
/// gradient is reduced but never stepped).
inline int optimizer_group_of(const std::vector<torch::optim::OptimizerParamGroup>& groups, const at::Tensor& p) {
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& q : groups[g].params())
      if (q.is_same(p)) return static_cast<int>(g);
  return -1;
}

}  // namespace accel::strategy
