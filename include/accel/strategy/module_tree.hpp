#pragma once
// What the pure plans (bucket_plan.hpp, unit_plan.hpp) need of a LibTorch
// model and optimizer: the module tree with parameters named by index, and
// the optimizer group of a parameter. Shared by the engines and the estimate.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "accel/core/compiled_once.hpp"
#include "accel/strategy/bucket_plan.hpp"
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

/// The bucket planner's view of `params`, in order: size, element size,
/// kind (each distinct dtype and device numbered as first seen), optimizer
/// group (`group_of`) and unit (`unit_of`, by index; 0 without).
std::vector<ParameterSlot> parameter_slots(const std::vector<at::Tensor>& params,
                                                  const std::function<int(const at::Tensor&)>& group_of,
                                                  const std::function<int(std::size_t)>& unit_of = nullptr);

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE std::vector<ParameterSlot> parameter_slots(const std::vector<at::Tensor>& params, const std::function<int(const at::Tensor&)>& group_of, const std::function<int(std::size_t)>& unit_of) {
  std::vector<std::pair<at::ScalarType, at::Device>> kinds;
  std::vector<ParameterSlot> slots;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const std::pair<at::ScalarType, at::Device> kind{p.scalar_type(), p.device()};
    auto found = std::find(kinds.begin(), kinds.end(), kind);
    if (found == kinds.end()) found = kinds.insert(kinds.end(), kind);
    slots.push_back({.numel = p.numel(),
                     .element_size = static_cast<std::int64_t>(p.element_size()),
                     .kind = static_cast<int>(found - kinds.begin()),
                     .group = group_of(p),
                     .unit = unit_of ? unit_of(i) : 0});
  }
  return slots;
}

#endif

}  // namespace accel::strategy
