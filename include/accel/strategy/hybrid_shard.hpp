#pragma once
// HybridShard (FSDP HYBRID_SHARD): ZeRO-3 inside each group of
// `shard_group_size` consecutive ranks, the groups replicas of each other.
// The parameter all-gathers and gradient reduce-scatters stay inside a
// group (a machine, by default); after them the gradient shards are
// averaged across the groups with one all-reduce per bucket.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/comm/environment.hpp"
#include "accel/core/policies.hpp"
#include "accel/strategy/zero3.hpp"

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

template <class Precision, class Device>
class HybridShardEngine {
 public:
  using settings_type = HybridShard;
  using inner_type = ZeROEngine<3, Precision, Device>;
  static constexpr bool shards_gradients = true;

  static void check_world(const HybridShard& settings, int world_size) {
    detail::shard_group_size_for(settings, world_size);
  }

  HybridShardEngine(const HybridShard& settings, comm::Communicator& world)
      : groups_(detail::hybrid_groups(world, detail::shard_group_size_for(settings, world.size()))),
        inner_(settings.zero, groups_.first) {}

  void prepare_model(torch::nn::Module& model) {
    inner_.prepare_model(model);  // equal within the shard group: its first rank's weights
    // ... and across the replicas: the first group's (buffers too).
    detail::broadcast_module_state(model, groups_.second, "broadcast of the first replica's parameters at prepare");
  }
  void prepare_optimizer(torch::optim::Optimizer& optimizer) { inner_.prepare_optimizer(optimizer); }
  void before_forward() { inner_.before_forward(); }
  void after_forward() { inner_.after_forward(); }
  void before_backward(const at::Tensor& loss) { inner_.before_backward(loss); }

  /// The shard group's reduce-scatter, then the average over the replicas.
  void synchronize_gradients() {
    inner_.reduce_gradients();
    auto& replicas = groups_.second;
    if (replicas.distributed()) {
      std::vector<comm::Pending> pending;
      for (at::Tensor grad : inner_.device_gradient_shards()) {
        grad.div_(replicas.size());
        pending.push_back(replicas.all_reduce_async(grad, "all-reduce of HybridShard gradient shards across replicas"));
      }
      for (auto& p : pending) p.wait();
    }
    inner_.offload_gradients();  // the averaged shards, under cpu_offload
  }
  void after_optimizer_step() { inner_.after_optimizer_step(); }
  void set_gradient_sync(bool sync) { inner_.set_gradient_sync(sync); }
  void zero_grad(torch::optim::Optimizer& optimizer) { inner_.zero_grad(optimizer); }
  const std::vector<at::Tensor>& optimizer_parameters() const { return inner_.optimizer_parameters(); }
  const std::vector<at::Tensor>& offloaded_parameters() const { return inner_.offloaded_parameters(); }
  const std::vector<at::Tensor>& device_shards() const { return inner_.device_shards(); }
  void parameters_loaded() { inner_.parameters_loaded(); }
  std::vector<std::int64_t> bucket_numels() const { return inner_.bucket_numels(); }
  int shard_count() const { return groups_.first.size(); }
  int shard_rank() const { return groups_.first.rank(); }
  void gather_full_parameters() { inner_.gather_full_parameters(); }
  void release_full_parameters(bool loaded) { inner_.release_full_parameters(loaded); }
  void unshard_permanently() { inner_.unshard_permanently(); }
  inner_type& shard_engine() { return inner_; }

 private:
  std::pair<comm::Communicator, comm::Communicator> groups_;  // (shard group, replicate group)
  inner_type inner_;
};

}  // namespace accel::strategy
