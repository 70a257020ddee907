#pragma once
// HybridShard (FSDP HYBRID_SHARD): ZeRO-3 inside each group of
// `shard_group_size` consecutive ranks, the groups replicas of each other.
// The parameter all-gathers and gradient reduce-scatters stay inside a
// group (a machine, by default); after them the gradient shards are
// averaged across the groups with one all-reduce per bucket.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <utility>

#include "accel/comm/communicator.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/core/policies.hpp"
#include "accel/strategy/engine.hpp"
#include "accel/strategy/zero3.hpp"

namespace accel::strategy {

// Base-from-member: the groups exist before the ZeRO-3 engine built on one.
struct HybridGroups {
  std::pair<comm::Communicator, comm::Communicator> groups;  // (shard group, replicate group)
};

class HybridShardEngine final : private HybridGroups, public ForwardingEngine<ZeRO3Engine> {
  using inner_type = ZeRO3Engine;
  using forwarding = ForwardingEngine<inner_type>;

 public:
  using settings_type = HybridShard;
  static constexpr bool shards_optimizer_state = true;

  static void check_world(const HybridShard& settings, int world_size);

  HybridShardEngine(const HybridShard& settings, comm::Communicator& world);

  void prepare_model(torch::nn::Module& model);
  /// Built on meta: every rank replays the first rank's initialisers.
  void prepare_meta_model(torch::nn::Module& model, at::Device device);

  /// The shard group's reduce-scatter, then the average over the replicas.
  void synchronize_gradients();

  /// Shards are cut over the shard group; the first group's ranks write them.
  std::optional<ShardLayout> shard_layout() const override;
  /// The replicas hold equal shards: the norm is the shard group's.
  NormReduction norm_reduction() { return {&shard_group(), {}}; }

  inner_type& shard_engine() { return inner(); }

 private:
  inner_type& inner() { return this->inner_; }
  comm::Communicator& shard_group() { return groups.first; }
  comm::Communicator& replicate_group() { return groups.second; }
};

}  // namespace accel::strategy

// The engine's code, compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/environment.hpp"
#include "accel/strategy/deferred_init.hpp"

namespace accel::strategy {

namespace detail {
inline int shard_group_size_for(const HybridShard& settings, int world) {
  const int size = settings.shard_group_size > 0 ? settings.shard_group_size
                                                 : comm::world_from_environment().local_world_size;
  if (size < 1 || world % size != 0)
    throw std::invalid_argument("accel HybridShard: shard groups of " + std::to_string(size) +
                                " ranks do not divide the world size " + std::to_string(world));
  return size;
}

// This rank's shard group (consecutive ranks) and replicate group (the
// ranks at the same place in every shard group).
inline std::pair<comm::Communicator, comm::Communicator> hybrid_groups(const comm::Communicator& world, int shard) {
  const int group = world.rank() / shard, place = world.rank() % shard;
  std::vector<int> shard_members, replica_members;
  for (int i = 0; i < shard; ++i) shard_members.push_back(group * shard + i);
  for (int g = 0; g < world.size() / shard; ++g) replica_members.push_back(g * shard + place);
  auto shard_group = world.subgroup("hybrid/shard/" + std::to_string(group), shard_members);
  auto replica_group = world.subgroup("hybrid/replicate/" + std::to_string(place), replica_members);
  return {std::move(shard_group), std::move(replica_group)};
}
}  // namespace detail

ACCEL_COMPILED_ONCE void HybridShardEngine::check_world(const HybridShard& settings, int world_size) {
  detail::shard_group_size_for(settings, world_size);
}

ACCEL_COMPILED_ONCE HybridShardEngine::HybridShardEngine(const HybridShard& settings, comm::Communicator& world)
    : HybridGroups{detail::hybrid_groups(world, detail::shard_group_size_for(settings, world.size()))},
      forwarding(settings.zero, shard_group()) {
  static_assert(complete_engine<HybridShardEngine>);
}

ACCEL_COMPILED_ONCE void HybridShardEngine::prepare_model(torch::nn::Module& model) {
  inner().prepare_model(model);  // equal within the shard group: its first rank's weights
  // ... and across the replicas: the first group's (buffers too).
  detail::broadcast_module_state(model, replicate_group(), "broadcast of the first replica's parameters at prepare");
}

ACCEL_COMPILED_ONCE void HybridShardEngine::prepare_meta_model(torch::nn::Module& model, at::Device device) {
  inner().prepare_meta_model(model, device);  // the shard group's first rank's generator states
  agree_on_initialisers(model, replicate_group(), "HybridShard");  // ... and the first group's
}

ACCEL_COMPILED_ONCE void HybridShardEngine::synchronize_gradients() {
  inner().reduce_gradients();
  auto& replicas = replicate_group();
  if (replicas.distributed()) {
    std::vector<comm::Pending> pending;
    for (at::Tensor grad : inner().device_gradient_shards()) {
      grad.div_(replicas.size());
      pending.push_back(replicas.all_reduce_async(grad, "all-reduce of HybridShard gradient shards across replicas"));
    }
    for (auto& p : pending) p.wait();
  }
  inner().offload_gradients();  // the averaged shards, under cpu_offload
}

ACCEL_COMPILED_ONCE std::optional<ShardLayout> HybridShardEngine::shard_layout() const {
  auto layout = this->inner_.layout();
  layout.writer = groups.second.rank() == 0;
  return layout;
}

}  // namespace accel::strategy
#endif  // ACCEL_DEFINE_COMPILED_ONCE
