#pragma once
// Parallel<Data>: data x tensor x pipeline on a device mesh. The mesh's
// data group runs the Data strategy's engine (DDP or ZeRO) over this rank's
// part of the model; the tensor group is what the model's tensor-parallel
// layers communicate over; the pipeline group carries a Pipeline over the
// model's stages.
//
// Under ZeRO-3 with a pipeline, the stage's units stay gathered for the
// whole schedule of a step (pipeline_step). Under pipeline parallelism the stage's backward runs once per
// micro-batch, so the data-parallel engine accumulates without
// communicating and launches all its buckets once the last micro-batch is
// done (the pipeline's schedule already leaves no idle time to overlap into).

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/comm/mesh.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/core/policies.hpp"
#include "accel/core/strategy_traits.hpp"
#include "accel/pipeline/pipeline.hpp"
#include "accel/strategy/engine.hpp"
#include "accel/strategy/ddp.hpp"
#include "accel/strategy/zero.hpp"

namespace accel::strategy {

// Base-from-member: the mesh exists before the data engine built on its data group.
struct ParallelMesh {
  comm::DeviceMesh mesh_;
};

template <class Data>
class ParallelEngine final : private ParallelMesh, public ForwardingEngine<typename Data::engine> {
 public:
  using settings_type = Parallel<Data>;
  using data_engine_type = typename Data::engine;
  static constexpr bool shards_optimizer_state = data_engine_type::shards_optimizer_state;

  static void check_world(const Parallel<Data>& settings, int world_size);

  ParallelEngine(const Parallel<Data>& settings, comm::Communicator& world);

  void prepare_model(torch::nn::Module& model);

  /// Tensor and pipeline ranks hold different parts; data replicas the same.
  ModelPart model_part(const comm::Communicator& world) const override;

  /// The global norm over the whole mesh: every pipeline stage's and every
  /// tensor slice's gradients count, a parameter replicated over the tensor
  /// group only on tensor rank 0, and an unsharded data engine's only on
  /// its first replica.
  NormReduction norm_reduction();

  /// One pipelined step's forwards and backwards (NOTE [Pipeline schedules])
  /// of the loss times `loss_multiplier`; on a micro-step that synchronises
  /// (`sync`), the data-parallel reduction is launched at its end. Returns
  /// the loss.
  /// Under ZeRO-3 the stage's units are gathered once for the whole
  /// schedule and freed after it (as torchtitan runs FSDP under a pipeline,
  /// without resharding after each micro-batch's forward): a unit's gather
  /// and free per micro-batch would repeat its all-gather m times, and the
  /// forwards and backwards of different micro-batches interleave.
  template <class LossFn>
  double pipeline_step(const at::Tensor& inputs, const at::Tensor& targets, LossFn&& loss_fn, double loss_multiplier,
                       bool sync) {
    this->inner_.set_gradient_sync(false);
    this->inner_.before_backward(at::Tensor());
    this->inner_.gather_full_parameters();  // ZeRO-3: the stage's units; others hold them already
    const double loss = pipeline_->train_step(inputs, targets, std::forward<LossFn>(loss_fn), loss_multiplier);
    this->inner_.release_full_parameters(FullParameters::unchanged);
    if (sync) this->inner_.launch_all_buckets();
    return loss;
  }
  bool pipelined() const { return pipeline_.has_value(); }

  comm::Communicator* tensor_group() { return &mesh_.group(comm::MeshDim::tensor); }
  comm::Communicator* data_group() { return &mesh_.group(comm::MeshDim::data); }
  comm::DeviceMesh& mesh() { return mesh_; }
  data_engine_type& data_engine() { return this->inner_; }
  pipeline::Pipeline& pipeline() { return *pipeline_; }

 private:
  Parallel<Data> settings_;
  std::optional<pipeline::Pipeline> pipeline_;
  torch::nn::Sequential stage_{nullptr};
  std::unordered_set<const void*> split_;  // TensorImpls of tensor-split parameters
  std::optional<std::vector<at::Tensor>> norm_masks_;

  // NormReduction::masks for this rank (empty: everything counts).
  std::vector<at::Tensor> count_masks();
};

// Compiled once, for every data strategy (NOTE [Compiled once]).
#if defined(ACCEL_SEPARATE_COMPILATION) && !defined(ACCEL_BUILDING_COMPILED_ONCE)
extern template class ParallelEngine<DDP>;
extern template class ParallelEngine<ZeRO<1>>;
extern template class ParallelEngine<ZeRO<2>>;
extern template class ParallelEngine<ZeRO<3>>;
#endif

}  // namespace accel::strategy

#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/scalar_tensor.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "accel/nn/tensor_parallel_layer.hpp"
#include "accel/strategy/unit_checkpointing.hpp"

namespace accel::strategy {

namespace detail {
inline comm::MeshShape mesh_shape_for(int world, int tensor, int pipeline) {
  if (tensor < 1 || pipeline < 1) throw std::invalid_argument("accel Parallel: tensor and pipeline must be at least 1");
  if (world % (tensor * pipeline) != 0)
    throw std::invalid_argument("accel Parallel: the world size " + std::to_string(world) +
                                " is not divisible by tensor " + std::to_string(tensor) + " x pipeline " +
                                std::to_string(pipeline) + " = " + std::to_string(tensor * pipeline));
  return {.pipeline = pipeline, .data = world / (tensor * pipeline), .tensor = tensor};
}
}  // namespace detail

template <class Data>
ACCEL_COMPILED_ONCE void ParallelEngine<Data>::check_world(const Parallel<Data>& settings, int world_size) {
  if (settings.pipeline > 1)
    pipeline::check_options({settings.micro_batches, settings.schedule, settings.virtual_stages}, settings.pipeline);
  else if (settings.virtual_stages != 1)
    throw std::invalid_argument("accel Parallel: virtual_stages = " + std::to_string(settings.virtual_stages) +
                                " without a pipeline (pipeline = 1)");
  detail::mesh_shape_for(world_size, settings.tensor, settings.pipeline);
}

template <class Data>
ACCEL_COMPILED_ONCE ParallelEngine<Data>::ParallelEngine(const Parallel<Data>& settings, comm::Communicator& world)
    : ParallelMesh{comm::DeviceMesh(world, detail::mesh_shape_for(world.size(), settings.tensor, settings.pipeline))},
      ForwardingEngine<data_engine_type>(settings.data, mesh_.group(comm::MeshDim::data)),
      settings_(settings) {
  static_assert(complete_engine<ParallelEngine>);
}

template <class Data>
ACCEL_COMPILED_ONCE void ParallelEngine<Data>::prepare_model(torch::nn::Module& model) {
  torch::nn::Module* part = &model;
  if (settings_.pipeline > 1) {
    auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model.shared_from_this());
    if (!sequential)
      throw std::invalid_argument("accel Parallel: pipeline parallelism splits a torch::nn::Sequential; this model is a " +
                                  model.name());
    // Before the split: the pipeline calls the layers it copies from the model.
    if constexpr (strategy_traits<Data>::zero_stage > 0)
      checkpoint_wrapped_units(model, settings_.data, "Parallel");
    pipeline_.emplace(torch::nn::Sequential(sequential), mesh_.group(comm::MeshDim::pipeline),
                      pipeline::PipelineOptions{settings_.micro_batches, settings_.schedule, settings_.virtual_stages});
    stage_ = pipeline_->stage_module();
    part = stage_.ptr().get();  // this rank's stage only: the other stages are other ranks'
  }
  for (const auto& module : part->modules())
    if (auto* layer = dynamic_cast<const nn::TensorParallelLayer*>(module.get()))
      for (const auto& p : layer->split_parameters()) split_.insert(p.unsafeGetTensorImpl());
  this->inner_.prepare_model(*part);
}

template <class Data>
ACCEL_COMPILED_ONCE ModelPart ParallelEngine<Data>::model_part(const comm::Communicator& world) const {
  const auto& m = mesh_;
  const int tensor = m.size(comm::MeshDim::tensor), pipeline = m.size(comm::MeshDim::pipeline);
  if (tensor * pipeline == 1) return CheckpointHooks::model_part(world);  // data parallel only: whole, as DDP's
  return {m.coordinate(comm::MeshDim::tensor) + tensor * m.coordinate(comm::MeshDim::pipeline), tensor * pipeline,
          m.coordinate(comm::MeshDim::data) == 0,
          "tensor " + std::to_string(tensor) + " x pipeline " + std::to_string(pipeline) +
              (settings_.virtual_stages > 1 ? " x virtual " + std::to_string(settings_.virtual_stages) : ""),
          pipeline, pipeline_ ? stage_.ptr().get() : nullptr};
}

template <class Data>
ACCEL_COMPILED_ONCE NormReduction ParallelEngine<Data>::norm_reduction() {
  if (!norm_masks_) norm_masks_ = count_masks();  // fixed once the optimizer is prepared
  return {&mesh_.world(), *norm_masks_};
}

template <class Data>
ACCEL_COMPILED_ONCE std::vector<at::Tensor> ParallelEngine<Data>::count_masks() {
  const bool first_tensor = mesh_.coordinate(comm::MeshDim::tensor) == 0;
  auto counted = [&](const at::Tensor& p) { return first_tensor || split_.contains(p.unsafeGetTensorImpl()); };
  std::vector<at::Tensor> masks;
  if constexpr (shards_optimizer_state) {
    if (settings_.tensor > 1) {
      const auto layout = *this->inner_.shard_layout();
      masks = this->inner_.shard_masks(counted, layout.count, layout.rank);
    }
  } else {
    const bool first_replica = mesh_.coordinate(comm::MeshDim::data) == 0;
    for (const auto& p : this->optimizer_parameters())
      masks.push_back(at::scalar_tensor(first_replica && counted(p) ? 1.0 : 0.0));
  }
  return masks;
}

#if defined(ACCEL_BUILDING_COMPILED_ONCE)
template class ParallelEngine<DDP>;
template class ParallelEngine<ZeRO<1>>;
template class ParallelEngine<ZeRO<2>>;
template class ParallelEngine<ZeRO<3>>;
#endif

}  // namespace accel::strategy
#endif  // ACCEL_DEFINE_COMPILED_ONCE
