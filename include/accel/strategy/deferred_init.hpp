#pragma once
// A model built by device::build_on_meta, given its values by a sharding
// engine a unit at a time (NOTE [Models built on meta], deferred_init/meta.hpp):
// ZeRO-3 and HybridShard materialise each unit's parameters, cut this rank's
// shard and free the unit before the next, so no rank ever holds the whole
// model. For a model built whole, prepare broadcasts rank 0's weights; for
// one built on meta, every rank replays the initialisers from rank 0's
// generator states (agree_on_initialisers), which gives the same values.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <torch/nn/module.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/deferred_init/meta.hpp"

namespace accel::strategy {

/// Every rank of `group` takes its first rank's generator states for the
/// initialisers of `model` (a model built on meta): what the broadcast of
/// rank 0's weights is to a model built whole.
inline void agree_on_initialisers(const torch::nn::Module& model, comm::Communicator& group,
                                  const std::string& strategy_name) {
  if (!group.distributed()) return;
  auto states = deferred_init::initialiser_states(deferred_init::meta_tensors_of(model));
  std::int64_t bytes = 0;
  for (const auto& s : states) bytes += s.numel();
  const auto mine = at::tensor({static_cast<std::int64_t>(states.size()), bytes});
  const auto all = group.all_gather(mine, "initialiser check of a model built on meta");
  for (int r = 0; r < group.size(); ++r)
    if (!all[r].equal(all[0]))
      throw std::runtime_error("accel " + strategy_name + ": rank " + std::to_string(r) + "'s model built on meta draws " +
                               std::to_string(all[r][0].item<std::int64_t>()) + " random initialisers, rank 0's " +
                               std::to_string(all[0][0].item<std::int64_t>()) +
                               ": every rank must build the same model the same way");
  if (states.empty()) return;
  std::vector<at::Tensor> flat_states;
  for (const auto& s : states) flat_states.push_back(s.reshape({-1}));
  auto joined = at::cat(flat_states);
  group.broadcast(joined, 0, "broadcast of rank 0's initialiser states at prepare");
  std::int64_t offset = 0;
  for (auto& s : states) {
    s.copy_(joined.narrow(0, offset, s.numel()).view(s.sizes()));
    offset += s.numel();
  }
}

}  // namespace accel::strategy
