#pragma once
// DDP: every rank holds the whole model; gradients are averaged over ranks by
// bucketed all-reduces that start during backward (NOTE [Gradient buckets]).
// `synchronize_gradients` waits for them all before the optimizer step.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <string>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/core/policies.hpp"
#include "accel/strategy/buckets.hpp"

namespace accel::strategy {

class DDPEngine final : public BucketedEngineBase {
 public:
  using settings_type = DDP;
  static constexpr bool shards_optimizer_state = false;

  DDPEngine(const DDP& settings, comm::Communicator& comm);

  void prepare_model(torch::nn::Module& model);
  void prepare_optimizer(torch::optim::Optimizer&) {}

  void before_backward(const at::Tensor& loss) { mark_unused_ready(loss); }

  void synchronize_gradients();

  void after_optimizer_step() {}

  void zero_grad(torch::optim::Optimizer&);

  /// The tensors the optimizer steps (here: the model's parameters).
  const std::vector<at::Tensor>& optimizer_parameters() const override;

 private:
  void launch(std::size_t b);

  // Gloo in LibTorch 1.13 cannot reduce bf16 (newer ones and NCCL can): ask
  // the backend once, at prepare, rather than fail in the middle of backward.
  void check_comm_hook_supported();

  CommHook comm_hook_;
  std::vector<at::Tensor> wire_;  // per bucket: the fp16/bf16 copy sent under a comm hook
  std::vector<comm::Pending> work_;
};

}  // namespace accel::strategy

// The engine's code, compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <stdexcept>

namespace accel::strategy {

ACCEL_COMPILED_ONCE DDPEngine::DDPEngine(const DDP& settings, comm::Communicator& comm)
    : BucketedEngineBase(BucketSettings{settings.bucket_cap_mb, settings.first_bucket_cap_mb,
                                        settings.find_unused_parameters, settings.static_graph, 1, "DDP"},
                         comm),
      comm_hook_(settings.comm_hook) {
  static_assert(complete_engine<DDPEngine>);
  state_->launch = [this](std::size_t b) { launch(b); };
}

ACCEL_COMPILED_ONCE void DDPEngine::prepare_model(torch::nn::Module& model) {
  collect_and_plan(model, [](const at::Tensor&) { return 0; });
  allocate_gradients();
  if (comm_hook_ != CommHook::none) {
    for (auto& bucket : state_->buckets)
      wire_.push_back(at::empty({bucket.padded}, bucket.grad.options().dtype(
                                                     comm_hook_ == CommHook::fp16 ? at::kHalf : at::kBFloat16)));
  }
  work_.resize(state_->buckets.size());
  check_comm_hook_supported();
  register_hooks();
}

ACCEL_COMPILED_ONCE void DDPEngine::synchronize_gradients() {
  wait_for_buckets(work_, [&](std::size_t b) {
    if (!wire_.empty() && state_->comm->distributed()) state_->buckets[b].grad.copy_(wire_[b]);
  });
}

ACCEL_COMPILED_ONCE void DDPEngine::zero_grad(torch::optim::Optimizer&) {
  for (auto& bucket : state_->buckets) bucket.grad.zero_();
  state_->attach_grad_views();
}

ACCEL_COMPILED_ONCE const std::vector<at::Tensor>& DDPEngine::optimizer_parameters() const { return state_->params; }

ACCEL_COMPILED_ONCE void DDPEngine::launch(std::size_t b) {
  auto& s = *state_;
  if (!s.comm->distributed()) return;
  auto& grad = s.buckets[b].grad;
  pre_divide(grad);
  at::Tensor& sent = wire_.empty() ? grad : wire_[b].copy_(grad);
  work_[b] = s.comm->all_reduce_async(sent, "all-reduce of DDP gradient bucket " + std::to_string(b) + " (" +
                                                std::to_string(sent.numel() * sent.element_size()) + " bytes)");
}

ACCEL_COMPILED_ONCE void DDPEngine::check_comm_hook_supported() {
  auto& s = *state_;
  if (comm_hook_ != CommHook::bf16 || !s.comm->distributed()) return;
  auto probe = at::zeros({1}, s.params.front().options().dtype(at::kBFloat16).requires_grad(false));
  try {
    // The asynchronous form, as the buckets use it: the blocking one sums bf16 in fp32 on Gloo.
    s.comm->all_reduce_async(probe, "bf16 support probe").wait();
  } catch (const comm::CollectiveError& e) {
    throw std::runtime_error(std::string("accel DDP: comm_hook = CommHook::bf16, but this backend cannot all-reduce "
                                         "bf16 tensors (Gloo before LibTorch 2.x): use CommHook::fp16 or "
                                         "CommHook::none. Backend said: ") + e.what());
  }
}

}  // namespace accel::strategy
#endif  // ACCEL_DEFINE_COMPILED_ONCE
