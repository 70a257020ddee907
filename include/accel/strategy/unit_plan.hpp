#pragma once
// ZeRO-3's units as a pure function of the module tree (FSDP's auto-wrap
// policies, applied bottom-up): which parameters are gathered together.
// Torch-free, so that the engine (from a torch::nn::Module) and
// `accel estimate-memory` (from a shape description) plan the same units.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "accel/core/policies.hpp"

namespace accel::strategy {

/// One module of the tree: its class (nn::Module::name(), e.g.
/// "gpt::BlockImpl"), the parameters registered on it directly, as indices
/// into the trained parameters, and its children by registration name.
struct ModuleNode {
  std::string class_name;
  std::vector<std::size_t> params{};
  std::vector<std::pair<std::string, ModuleNode>> children{};
};

/// The unit of each of the `numels.size()` parameters. Children are wrapped
/// before their parents; a module becomes a unit when the parameters not yet
/// taken below it pass the policy (SIZE_BASED_WRAP: at least min_num_params
/// elements; TRANSFORMER_BASED_WRAP: its class, by full or short name, is
/// listed). What no module takes is the root unit, always last; `unit_names`
/// receives each unit's module path.
inline std::vector<std::size_t> assign_units(const ModuleNode& root, const std::vector<std::int64_t>& numels,
                                             AutoWrapPolicy policy, std::int64_t min_num_params,
                                             const std::vector<std::string>& classes,
                                             std::vector<std::string>& unit_names) {
  constexpr auto none = static_cast<std::size_t>(-1);
  std::vector<std::size_t> unit(numels.size(), none);
  auto class_matches = [&](const std::string& name) {
    const auto colon = name.rfind("::");
    const std::string short_name = colon == std::string::npos ? name : name.substr(colon + 2);
    return std::find(classes.begin(), classes.end(), name) != classes.end() ||
           std::find(classes.begin(), classes.end(), short_name) != classes.end();
  };
  // The subtree's parameters in nn::Module::parameters() order: own, then each child's.
  std::function<void(const ModuleNode&, std::vector<std::size_t>&)> subtree = [&](const ModuleNode& m,
                                                                                  std::vector<std::size_t>& out) {
    out.insert(out.end(), m.params.begin(), m.params.end());
    for (const auto& child : m.children) subtree(child.second, out);
  };
  std::function<void(const ModuleNode&, const std::string&)> visit = [&](const ModuleNode& m, const std::string& path) {
    for (const auto& [name, child] : m.children) visit(child, path.empty() ? name : path + "." + name);
    if (path.empty() || policy == AutoWrapPolicy::NO_WRAP) return;
    std::vector<std::size_t> all, unwrapped;
    subtree(m, all);
    std::int64_t count = 0;
    for (auto i : all)
      if (unit[i] == none) {
        unwrapped.push_back(i);
        count += numels[i];
      }
    if (unwrapped.empty()) return;
    const bool wrap = policy == AutoWrapPolicy::SIZE_BASED_WRAP ? count >= min_num_params : class_matches(m.class_name);
    if (!wrap) return;
    for (auto i : unwrapped) unit[i] = unit_names.size();
    unit_names.push_back(path);
  };
  visit(root, "");
  const std::size_t root_unit = unit_names.size();
  unit_names.push_back("(root)");
  for (auto& u : unit)
    if (u == none) u = root_unit;
  return unit;
}

}  // namespace accel::strategy
