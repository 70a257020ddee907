#pragma once
// What every ZeRO stage's engine shares, written once: rank r holds shard r
// of every bucket (NOTE [ZeRO shards]), the optimizer steps those shards or,
// under cpu_offload, their host twins (NOTE [CPU offload]), and a stage that
// reduce-scatters keeps each bucket's reduced gradient shard and its
// collective in flight. ZeROEngine<1>, ZeROEngine<2> (zero.hpp) and
// ZeRO3Engine (zero3.hpp) derive from it; where this rank keeps its shards
// is theirs (ZeRO-3's observer reads them too).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/strategy/buckets.hpp"
#include "accel/strategy/engine.hpp"
#include "accel/strategy/offload.hpp"

namespace accel::strategy {

class ShardedEngineBase : public BucketedEngineBase {
 public:
  static constexpr bool shards_optimizer_state = true;

  /// Host-memory tensors the optimizer steps instead of device shards (empty without cpu_offload).
  const std::vector<at::Tensor>& offloaded_parameters() const { return offload_.parameters(); }

  /// Rank r holds shard r of every bucket (NOTE [ZeRO shards]).
  std::optional<ShardLayout> shard_layout() const override { return layout(); }
  ShardLayout layout() const { return {state_->comm->size(), state_->comm->rank(), true, bucket_numels()}; }
  /// Each rank holds a shard of the gradients the optimizer sees.
  NormReduction norm_reduction() { return {state_->comm, {}}; }

  /// Elements per bucket (without padding): the checkpoint's resharding map.
  std::vector<std::int64_t> bucket_numels() const {
    std::vector<std::int64_t> out;
    for (const auto& bucket : state_->buckets) out.push_back(bucket.numel);
    return out;
  }

 protected:
  ShardedEngineBase(const BucketSettings& settings, comm::Communicator& comm, bool cpu_offload)
      : BucketedEngineBase(settings, comm), offload_(cpu_offload) {}

  /// The tensors the optimizer steps: `device_shards`, or their host twins under cpu_offload.
  const std::vector<at::Tensor>& stepped(const std::vector<at::Tensor>& device_shards) const {
    return offload_.enabled() ? offload_.parameters() : device_shards;
  }

  /// One reduced-gradient shard per bucket, and the bookkeeping of its reduce-scatter.
  void allocate_gradient_shards(std::int64_t shard, const at::TensorOptions& options) {
    grad_shards_.push_back(at::zeros({shard}, options));
  }
  void size_collectives() {
    work_.resize(state_->buckets.size());
    received_.resize(state_->buckets.size());
  }

  // Lazy buckets: the launched ones' reduce-scatters landed, summed, their full gradients dropped.
  void retire_launched() {
    retire_launched_buckets(work_, [&](std::size_t b) { finish_reduce_scatter(b, grad_shards_[b], received_[b]); });
  }

  std::vector<at::Tensor> grad_shards_;  // per bucket: (shard,) the reduced gradient shard (not ZeRO-1's)
  std::vector<at::Tensor> received_;     // on Gloo: (padded,) chunks from every rank, until summed
  std::vector<comm::Pending> work_;      // per bucket: its gradient collective in flight
  HostOffload offload_;
};

}  // namespace accel::strategy
