#pragma once
// The estimate of NOTE [Memory estimate] for a user's own LibTorch model:
// its shape read from the module (which may have been built on the meta
// device by build_shapes_on_meta, deferred_init/meta.hpp, so that no weight was ever allocated), the
// optimizer's state count read from its type and options, and activations
// measured by running the user's own step once under a counting allocator.
//
//   auto model = accel::device::build_shapes_on_meta([] { return MyModel(cfg); });
//   torch::optim::Adam adam(model->parameters());
//   auto shape = accel::estimate::shape_of(*model, &adam);
//   auto zero3 = accel::estimate::model_state(shape, accel::ZeRO<3>{}, 8, accel::estimate::optimizer_shape(adam));

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include "accel/device/allocation_counter.hpp"
#include "accel/estimate/model_state.hpp"
#include "accel/strategy/module_tree.hpp"

namespace accel::estimate {

/// The shape of `model` as the engines collect it: the parameters that
/// require gradients, in registration order, by (dtype, device) kind and,
/// given the optimizer, its parameter group.
inline ModelShape shape_of(const torch::nn::Module& model, const torch::optim::Optimizer* optimizer = nullptr) {
  std::vector<at::Tensor> params;
  for (const auto& item : model.named_parameters())
    if (item.value().requires_grad()) params.push_back(item.value());
  ModelShape shape;
  shape.params = strategy::parameter_slots(params, [&](const at::Tensor& p) {
    return optimizer != nullptr ? strategy::optimizer_group_of(optimizer->param_groups(), p) : 0;
  });
  shape.tree = strategy::module_tree(model, params);
  return shape;
}

/// How many tensors per parameter `optimizer` keeps, from its type and its
/// first group's options; an optimizer accel does not know is refused.
inline OptimizerShape optimizer_shape(const torch::optim::Optimizer& optimizer) {
  if (optimizer.param_groups().empty()) throw std::invalid_argument("accel estimate: the optimizer has no parameter groups");
  const auto& options = optimizer.param_groups().front().options();
  if (const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&options)) return {adam->amsgrad() ? 3 : 2};
  if (const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return {adamw->amsgrad() ? 3 : 2};
  if (const auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(&options)) return {sgd->momentum() != 0 ? 1 : 0};
  if (const auto* rms = dynamic_cast<const torch::optim::RMSpropOptions*>(&options))
    return {1 + (rms->momentum() > 0 ? 1 : 0) + (rms->centered() ? 1 : 0)};
  if (dynamic_cast<const torch::optim::AdagradOptions*>(&options) != nullptr) return {1};
  throw std::invalid_argument(
      "accel estimate: an optimizer other than Adam, AdamW, SGD, RMSprop or Adagrad; give its tensors per parameter as "
      "OptimizerShape{k}");
}

/// The most host memory `step` allocates above what is live when it starts
/// (a CPU model's activations and temporaries, when `step` runs a forward
/// and backward whose gradients already exist).
template <class Step>
std::int64_t peak_bytes_during(Step&& step) {
  device::HostAllocationCounter counter;
  std::forward<Step>(step)();
  return counter.peak_bytes();
}

}  // namespace accel::estimate
