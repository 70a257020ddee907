#pragma once
// NOTE [CPU offload]
// ZeRO<N>{.cpu_offload = true} (Accelerate's fsdp_offload_params, DeepSpeed's
// offload_optimizer_device: cpu): the optimizer never sees device memory.
// For each bucket shard the device holds, a host twin (pinned when the device
// is CUDA) is what the optimizer steps, so its per-element state (Adam's two
// moments: 2x the shard) lives in host memory too. Per optimizer step:
//   after the gradient reduction: device gradient shard -> host twin's .grad
//     (asynchronous copies; the last one is blocking, which on one stream
//     means all of them are done before the CPU reads them);
//   the optimizer (and FP16 unscaling, clipping) runs on the host twins;
//   after the step: host twin -> device shard (asynchronous from pinned
//     memory; the host is not written again before the next gradient copy,
//     which waits for the stream), then the strategy's usual all-gather.
// On a CPU device the twins are plain host copies: the same code path, which
// is how it is tested without a GPU, at the cost of one more shard in memory.
//
// A layer of the sharded engine (ShardedEngine holds it): every stage and
// HybridShard calls the same five operations at the same points of its step
// (shards made, gradients reduced, step taken, checkpoint loaded, gradients
// zeroed) with its device shards, whose .grad are the reduced gradient
// shards; without cpu_offload each operation does nothing (attach makes no
// twins, and the others loop over the twins).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include <cstddef>
#include <vector>

namespace accel::strategy {

class HostOffload {
 public:
  HostOffload() = default;
  explicit HostOffload(bool enabled) : enabled_(enabled) {}

  bool enabled() const { return enabled_; }

  /// Makes a host twin of every device shard (same values), each with a zero
  /// gradient: the tensors to give the optimizer instead of the shards.
  void attach(const std::vector<at::Tensor>& device_shards) {
    if (!enabled_) return;
    c10::NoGradGuard no_grad;
    for (const auto& shard : device_shards) {
      auto options = shard.options().device(at::kCPU).pinned_memory(shard.is_cuda()).requires_grad(false);
      at::Tensor host = at::empty(shard.sizes(), options);
      host.copy_(shard.detach());
      at::Tensor grad = at::empty(shard.sizes(), options);
      grad.zero_();
      host.requires_grad_(true);
      host.mutable_grad() = grad;
      twins_.push_back(host);
    }
  }

  /// The optimizer's tensors: the host twins.
  const std::vector<at::Tensor>& parameters() const { return twins_; }

  /// The device shards' reduced gradients, copied into the twins' gradients.
  void gradients_to_host(const std::vector<at::Tensor>& device_shards) {
    c10::NoGradGuard no_grad;
    for (std::size_t b = 0; b < twins_.size(); ++b) {
      const bool last = b + 1 == twins_.size();
      twins_[b].mutable_grad().copy_(device_shards[b].grad(), /*non_blocking=*/!last);
    }
  }

  /// The stepped twins, copied back into the device shards.
  void parameters_to_device(const std::vector<at::Tensor>& device_shards) {
    c10::NoGradGuard no_grad;
    for (std::size_t b = 0; b < twins_.size(); ++b)
      device_shards[b].detach().copy_(twins_[b].detach(), /*non_blocking=*/true);
  }

  /// After a checkpoint was loaded into the device shards: take them over.
  void parameters_from_device(const std::vector<at::Tensor>& device_shards) {
    c10::NoGradGuard no_grad;
    for (std::size_t b = 0; b < twins_.size(); ++b) twins_[b].detach().copy_(device_shards[b].detach());
  }

  void zero_grad() {
    for (auto& twin : twins_) twin.mutable_grad().zero_();
  }

 private:
  bool enabled_ = false;
  std::vector<at::Tensor> twins_;
};

}  // namespace accel::strategy
