#pragma once
// ZeRO stages 1 and 2: the optimizer state (stage 1) and the gradients
// (stage 2) are sharded over the ranks.
//
// NOTE [ZeRO shards]
// The gradient buckets of NOTE [Gradient buckets] are padded to a multiple of
// the world size, and the model's parameters are moved into flat buffers of
// the same layout (each parameter becomes a view of its bucket's buffer).
// Rank r owns elements [r*S, (r+1)*S) of every bucket, S = padded/world.
// The user's optimizer is rewired to step those shards (one leaf tensor per
// bucket, a view of the flat parameter buffer, whose .grad is the reduced
// gradient shard), so optimizer state exists for 1/world of the elements;
// this is exact for elementwise optimizers (SGD, Adam, AdamW, RMSprop, ...).
//   stage 1: each bucket's gradients are all-reduced (as DDP), the shard is a view;
//   stage 2: each bucket is reduce-scattered as soon as it is ready
//            (comm::reduce_scatter_rows_async: NCCL's native one; Gloo's
//            all-to-all among the other ranks + a local sum, (n-1)/n of the
//            bytes and of a bucket received);
//            the full gradient buffers are released after the step, so only
//            the shard stays between steps.
// After the optimizer step every bucket's shards are all-gathered back into
// the flat parameter buffers, so every rank again holds the whole model, in
// place (comm::all_gather_rows_async: nothing staged beside the buckets).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/core/errors.hpp"
#include "accel/core/policies.hpp"
#include "accel/strategy/buckets.hpp"
#include "accel/strategy/offload.hpp"
#include "accel/strategy/sharded_engine.hpp"

namespace accel::strategy {

// Stages 1 and 2 only: ZeRO<3>'s engine is ZeRO3Engine (strategy/zero3.hpp),
// a class of its own, so no program can run this code for stage 3.
template <int Stage>
class ZeROEngine final : public ShardedEngineBase {
  static_assert(Stage == 1 || Stage == 2,
                "accel: ZeROEngine is the engine of ZeRO<1> and ZeRO<2>; ZeRO<3>'s is ZeRO3Engine, in "
                "<accel/strategy/zero3.hpp>");

 public:
  using settings_type = ZeRO<Stage>;

  ZeROEngine(const ZeRO<Stage>& settings, comm::Communicator& comm);

  void prepare_model(torch::nn::Module& model);

  /// Plans the buckets by the optimizer's parameter groups, moves the
  /// parameters into flat buffers and points the optimizer at this rank's shards.
  void prepare_optimizer(torch::optim::Optimizer& optimizer);

  void before_backward(const at::Tensor& loss);
  void synchronize_gradients();
  /// The updated shards, all-gathered back into every rank's full parameters.
  void after_optimizer_step();
  void zero_grad(torch::optim::Optimizer&);

  /// The tensors the optimizer steps: this rank's shard of each bucket (or
  /// their host twins under cpu_offload).
  const std::vector<at::Tensor>& optimizer_parameters() const override { return stepped(shards_); }
  /// This rank's parameter shards in device memory (the optimizer's own
  /// tensors unless cpu_offload), whose .grad are the reduced gradient shards.
  const std::vector<at::Tensor>& device_shards() const { return shards_; }
  /// A checkpoint was loaded into the model: the host twins take it over.
  void parameters_loaded() override;

 private:
  void require_optimizer_prepared() const;
  void attach_shard_gradients();
  void launch(std::size_t b);

  std::vector<at::Tensor> param_flat_;   // per bucket: (padded,) full parameters
  std::vector<at::Tensor> shards_;       // per bucket: (shard,) this rank's parameters, stepped by the optimizer
  ZeRO<Stage> settings_;
};

// Compiled once, for both stages (NOTE [Compiled once]).
#if defined(ACCEL_SEPARATE_COMPILATION) && !defined(ACCEL_BUILDING_COMPILED_ONCE)
extern template class ZeROEngine<1>;
extern template class ZeROEngine<2>;
#endif

}  // namespace accel::strategy

#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "accel/comm/collectives.hpp"
#include "accel/strategy/module_tree.hpp"
#include "accel/strategy/unit_checkpointing.hpp"

namespace accel::strategy {

template <int Stage>
ACCEL_COMPILED_ONCE ZeROEngine<Stage>::ZeROEngine(const ZeRO<Stage>& settings, comm::Communicator& comm)
    : ShardedEngineBase(BucketSettings{.bucket_cap_mb = settings.bucket_cap_mb,
                                        .first_bucket_cap_mb = settings.first_bucket_cap_mb,
                                        .find_unused_parameters = settings.find_unused_parameters,
                                        .pad_to_multiple = comm.size(),
                                        .strategy_name = Stage == 1 ? "ZeRO<1>" : "ZeRO<2>",
                                        .lazy_gradients = Stage == 2},
                        comm, settings.cpu_offload),
      settings_(settings) {
  static_assert(complete_engine<ZeROEngine>);
  check_unit_checkpointing(settings, state_->settings.strategy_name);
  if (settings.state_dict_type == StateDictType::SHARDED_STATE_DICT)
    throw ConfigurationError(std::string("accel ") + state_->settings.strategy_name +
                             ": state_dict_type SHARDED_STATE_DICT is for ZeRO<3> and HybridShard, which hold only "
                             "shards; this stage keeps the whole model on every rank and saves it whole "
                             "(FULL_STATE_DICT)");
  state_->launch = [this](std::size_t b) { launch(b); };
  if constexpr (Stage == 2) state_->before_allocating = [this] { retire_launched(); };
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::prepare_model(torch::nn::Module& model) {
  collect(model);
  checkpoint_wrapped_units(model, settings_, state_->settings.strategy_name);
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  auto& s = *state_;
  if (s.params.empty()) throw std::logic_error("accel ZeRO: prepare the model before (or with) the optimizer");
  if (!shards_.empty()) throw std::logic_error("accel ZeRO: prepare() takes one optimizer per Trainer");
  if (!optimizer.state().empty())
    throw std::logic_error("accel ZeRO: prepare the optimizer before its first step (its state would be lost)");
  auto& groups = optimizer.param_groups();
  plan_buckets([&](const at::Tensor& p) { return optimizer_group_of(groups, p); });
  const int world = s.comm->size(), rank = s.comm->rank();
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const auto& bucket = s.buckets[b];
    at::Tensor flat = flatten_parameters(b);  // (padded,)
    const std::int64_t shard = bucket.padded / world;
    // (shard,) this rank's slice of the flat parameters: what the optimizer steps
    c10::NoGradGuard no_grad;
    at::Tensor mine = flat.narrow(0, rank * shard, shard).detach().requires_grad_(true);
    param_flat_.push_back(flat);
    shards_.push_back(mine);
    if constexpr (Stage == 2) allocate_gradient_shards(shard, flat.options());
  }
  offload_.attach(shards_);
  point_optimizer_at(groups, optimizer_parameters());
  if constexpr (Stage == 1) allocate_gradients();  // stage 2's exist only within backward
  attach_shard_gradients();
  size_collectives();
  register_hooks();
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::before_backward(const at::Tensor& loss) {
  require_optimizer_prepared();
  mark_unused_ready(loss);
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::synchronize_gradients() {
  wait_for_buckets(work_, [&](std::size_t b) {
    if constexpr (Stage == 2) finish_reduce_scatter(b, grad_shards_[b], received_[b]);
  });
  offload_.gradients_to_host(shards_);
  if constexpr (Stage == 2) {
    release_full_gradients();
    set_shards_hold_reduced(true);
  }
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::after_optimizer_step() {
  auto& s = *state_;
  offload_.parameters_to_device(shards_);
  if (!s.comm->distributed()) return;
  // In place, every bucket at once: each shard is its own row of the flat
  // parameters, and nothing is staged beside them (comm/collectives.hpp).
  std::vector<comm::Pending> gathers;
  for (std::size_t b = 0; b < shards_.size(); ++b)
    for (auto& g : comm::all_gather_rows_async(*s.comm, param_flat_[b],
                                               "all-gather of ZeRO parameter bucket " + std::to_string(b)))
      gathers.push_back(std::move(g));
  for (auto& g : gathers) g.wait();
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::zero_grad(torch::optim::Optimizer&) {
  offload_.zero_grad();
  if constexpr (Stage == 1) {
    for (auto& bucket : state_->buckets) bucket.grad.zero_();
    state_->attach_grad_views();
  } else {
    for (auto& g : grad_shards_) g.zero_();
    set_shards_hold_reduced(false);
    for (auto& bucket : state_->buckets)  // those a no_sync micro-step left
      if (bucket.grad.defined()) bucket.grad.zero_();
    state_->attach_grad_views();
  }
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::parameters_loaded() {
  offload_.parameters_from_device(shards_);
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::require_optimizer_prepared() const {
  if (shards_.empty())
    throw std::logic_error("accel ZeRO: no optimizer was prepared: call trainer.prepare(model, optimizer) first");
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::attach_shard_gradients() {
  auto& s = *state_;
  for (std::size_t b = 0; b < shards_.size(); ++b) {
    if constexpr (Stage == 1) {
      const std::int64_t shard = shards_[b].numel();
      shards_[b].mutable_grad() = s.buckets[b].grad.narrow(0, s.comm->rank() * shard, shard);
    } else {
      shards_[b].mutable_grad() = grad_shards_[b];
    }
  }
}

template <int Stage>
ACCEL_COMPILED_ONCE void ZeROEngine<Stage>::launch(std::size_t b) {
  auto& s = *state_;
  auto& grad = s.buckets[b].grad;
  pre_divide(grad);
  const std::string what = std::string(Stage == 1 ? "all-reduce" : "reduce-scatter") + " of ZeRO gradient bucket " +
                           std::to_string(b) + " (" + std::to_string(grad.numel() * grad.element_size()) + " bytes)";
  if constexpr (Stage == 1) {
    work_[b] = s.comm->all_reduce_async(grad, what);
  } else {
    // Before this bucket's collective allocates its buffers (NOTE [Gradient buckets]).
    retire_launched();
    work_[b] = reduce_scatter_bucket(b, grad_shards_[b], received_[b], what);
  }
}

#if defined(ACCEL_BUILDING_COMPILED_ONCE)
template class ZeROEngine<1>;
template class ZeROEngine<2>;
#endif

}  // namespace accel::strategy
#endif  // ACCEL_DEFINE_COMPILED_ONCE
