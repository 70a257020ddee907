#pragma once
// Accelerate's fsdp_activation_checkpointing: every unit of the auto-wrap
// policy runs under accel::nn::checkpoint.
//
// NOTE [Checkpointing wrapped units]
// PyTorch replaces each unit in its parent by a CheckpointWrapper. LibTorch
// modules have no forward hooks, and a parent calls its children through
// its own C++ members, which nothing outside can redirect, with one
// exception: a torch::nn::Sequential calls its entries from a list that its
// iterators expose. So a unit is checkpointed through the Sequential entry
// that holds it: the unit itself when it is an entry (a transformer block of
// a Sequential model), else its outermost ancestor that is one (a
// size-based unit inside a block checkpoints the block). The entry is
// replaced in the call list only, by a module that runs it under
// accel::nn::checkpoint; the registered module tree stays as it was, so the
// parameters' names, the checkpoints and ZeRO-3's units do not change. A
// unit under no Sequential entry is refused by name, with what to do
// instead. An entry must take and return one tensor, as Sequential passes
// one value from entry to entry.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "accel/core/errors.hpp"
#include "accel/core/policies.hpp"
#include "accel/nn/activation_checkpoint.hpp"
#include "accel/strategy/module_tree.hpp"

namespace accel::strategy {

namespace detail {

// The Sequential entry through which the unit at `path` ("a.b.c", from
// `root`) is called: its Sequential and its path; none when no ancestor of
// the unit, the unit included, is an entry of a Sequential.
struct EntryOfUnit {
  torch::nn::SequentialImpl* sequential = nullptr;
  std::shared_ptr<torch::nn::Module> module;
  std::string path;
};

inline EntryOfUnit entry_of_unit(torch::nn::Module& root, const std::string& path) {
  torch::nn::Module* current = &root;
  std::string walked;
  for (std::size_t begin = 0; begin <= path.size();) {
    const auto end = std::min(path.find('.', begin), path.size());
    const std::string name = path.substr(begin, end - begin);
    walked += (walked.empty() ? "" : ".") + name;
    auto children = current->named_children();
    const auto* child = children.find(name);
    if (child == nullptr) return {};
    if (auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(current)) return {sequential, *child, walked};
    current = child->get();
    begin = end + 1;
  }
  return {};
}

}  // namespace detail

/// Refuses activation_checkpointing without units to checkpoint (at construction).
template <int Stage>
void check_unit_checkpointing(const ZeRO<Stage>& settings, const std::string& strategy_name) {
  if (settings.activation_checkpointing && settings.auto_wrap_policy == AutoWrapPolicy::NO_WRAP)
    throw ConfigurationError("accel " + strategy_name +
                             ": activation_checkpointing checkpoints the auto-wrap policy's units, and "
                             "auto_wrap_policy is NO_WRAP: set TRANSFORMER_BASED_WRAP with "
                             "transformer_layer_cls_to_wrap (e.g. {\"BlockImpl\"}) or SIZE_BASED_WRAP");
}

/// Checkpoints every unit that `settings`' auto-wrap policy picks in `model`
/// through the Sequential entry holding it (NOTE [Checkpointing wrapped
/// units]). Entries already checkpointed stay as they are.
template <int Stage>
void checkpoint_wrapped_units(torch::nn::Module& model, const ZeRO<Stage>& settings, const std::string& strategy_name) {
  if (!settings.activation_checkpointing) return;
  check_unit_checkpointing(settings, strategy_name);
  std::vector<at::Tensor> params;
  std::vector<std::int64_t> numels;
  for (const auto& p : model.parameters())
    if (p.requires_grad()) {
      params.push_back(p);
      numels.push_back(p.numel());
    }
  std::vector<std::string> units;
  assign_units(module_tree(model, params), numels, settings.auto_wrap_policy, settings.min_num_params,
               settings.transformer_layer_cls_to_wrap, units);
  units.pop_back();  // the root's unit: the whole model is not one entry
  for (const auto& unit : units) {
    const auto entry = detail::entry_of_unit(model, unit);
    if (entry.sequential == nullptr)
      throw ConfigurationError("accel " + strategy_name + ": activation_checkpointing cannot reach the unit '" + unit +
                               "': it is in no torch::nn::Sequential, and LibTorch modules have no forward hooks "
                               "(its parent calls it from its own forward); put the units in a Sequential, or call "
                               "accel::nn::checkpoint around them in the parent's forward and leave "
                               "activation_checkpointing off");
    // An entry holding several units, or already checkpointed, runs the wrapper: left as it is.
    for (auto& held : *entry.sequential)
      if (held.ptr() == entry.module) held = torch::nn::AnyModule(std::make_shared<nn::CheckpointedEntryImpl>(held, entry.path));
  }
}

}  // namespace accel::strategy
