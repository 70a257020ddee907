#pragma once
// Parallel<Data>: data x tensor x pipeline on a device mesh. The mesh's
// data group runs the Data strategy's engine (DDP or ZeRO) over this rank's
// part of the model; the tensor group is what the model's tensor-parallel
// layers communicate over; the pipeline group carries a Pipeline over the
// model's stages.
//
// Under pipeline parallelism the stage's backward runs once per
// micro-batch, so the data-parallel engine accumulates without
// communicating and launches all its buckets once the last micro-batch is
// done (the pipeline's schedule already leaves no idle time to overlap into).

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "accel/comm/communicator.hpp"
#include "accel/comm/mesh.hpp"
#include "accel/core/policies.hpp"
#include "accel/pipeline/pipeline.hpp"
#include "accel/strategy/ddp.hpp"
#include "accel/strategy/zero.hpp"

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

template <class Data, class Precision, class Device>
class ParallelEngine {
 public:
  using settings_type = Parallel<Data>;
  using data_engine_type = typename Data::template engine<Precision, Device>;
  static constexpr bool shards_gradients = data_engine_type::shards_gradients;

  /// Checked before any rank connects, so every rank fails alike and at once.
  static void check_world(const Parallel<Data>& settings, int world_size) {
    detail::mesh_shape_for(world_size, settings.tensor, settings.pipeline);
  }

  ParallelEngine(const Parallel<Data>& settings, comm::Communicator& world)
      : settings_(settings),
        mesh_(world, detail::mesh_shape_for(world.size(), settings.tensor, settings.pipeline)),
        data_(settings.data, mesh_.group(comm::MeshDim::data)) {}

  void prepare_model(torch::nn::Module& model) {
    if (settings_.pipeline == 1) {
      data_.prepare_model(model);
      return;
    }
    auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model.shared_from_this());
    if (!sequential)
      throw std::invalid_argument("accel Parallel: pipeline parallelism splits a torch::nn::Sequential; this model is a " +
                                  model.name());
    pipeline_.emplace(torch::nn::Sequential(sequential), mesh_.group(comm::MeshDim::pipeline),
                      pipeline::PipelineOptions{settings_.micro_batches, settings_.schedule});
    stage_ = pipeline_->stage_module();
    data_.prepare_model(*stage_.ptr());  // this rank's stage only: the other stages are other ranks'
  }
  void prepare_optimizer(torch::optim::Optimizer& optimizer) { data_.prepare_optimizer(optimizer); }
  void before_backward(const at::Tensor& loss) { data_.before_backward(loss); }
  void synchronize_gradients() { data_.synchronize_gradients(); }
  void after_optimizer_step() { data_.after_optimizer_step(); }
  void set_gradient_sync(bool sync) { data_.set_gradient_sync(sync); }
  void zero_grad(torch::optim::Optimizer& optimizer) { data_.zero_grad(optimizer); }
  const std::vector<at::Tensor>& optimizer_parameters() const { return data_.optimizer_parameters(); }
  const std::vector<at::Tensor>& offloaded_parameters() const
    requires requires(const data_engine_type& d) { d.offloaded_parameters(); }
  {
    return data_.offloaded_parameters();
  }
  const std::vector<at::Tensor>& device_shards() const
    requires requires(const data_engine_type& d) { d.device_shards(); }
  {
    return data_.device_shards();
  }
  void parameters_loaded()
    requires requires(data_engine_type& d) { d.parameters_loaded(); }
  {
    data_.parameters_loaded();
  }

  /// One pipelined step's forwards and backwards (NOTE [Pipeline schedules]);
  /// the data-parallel reduction is launched at its end. Returns the loss.
  template <class LossFn>
  double pipeline_step(const at::Tensor& inputs, const at::Tensor& targets, LossFn&& loss_fn) {
    data_.set_gradient_sync(false);
    data_.before_backward(at::Tensor());
    const double loss = pipeline_->train_step(inputs, targets, std::forward<LossFn>(loss_fn));
    data_.launch_all_buckets();
    return loss;
  }
  bool pipelined() const { return pipeline_.has_value(); }

  comm::DeviceMesh& mesh() { return mesh_; }
  comm::Communicator& tensor_group() { return mesh_.group(comm::MeshDim::tensor); }
  comm::Communicator& data_group() { return mesh_.group(comm::MeshDim::data); }
  data_engine_type& data_engine() { return data_; }
  pipeline::Pipeline& pipeline() { return *pipeline_; }

 private:
  Parallel<Data> settings_;
  comm::DeviceMesh mesh_;
  data_engine_type data_;
  std::optional<pipeline::Pipeline> pipeline_;
  torch::nn::Sequential stage_{nullptr};
};

}  // namespace accel::strategy
