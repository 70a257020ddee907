#pragma once
// What model state a rank holds, counted from the tensors themselves
// (distinct storages), for Trainer::model_state_bytes. Compiled once: the
// engine enters only through the tensors it names.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cstdint>
#include <memory>
#include <sstream>
#include <unordered_set>
#include <vector>

#include "accel/compat/torch_compat.hpp"
#include "accel/core/model_state.hpp"

namespace accel {

namespace strategy {

namespace detail {

// The state tensors of LibTorch's own optimizers, read where they live: no
// copy, so counting costs no memory. Empty for another optimizer's state.
inline std::vector<at::Tensor> known_state_tensors(const torch::optim::OptimizerParamState& state) {
  if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state))
    return {s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()};
  if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state))
    return {s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()};
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) return {s->momentum_buffer()};
  if (const auto* s = dynamic_cast<const torch::optim::AdagradParamState*>(&state)) return {s->sum()};
  if (const auto* s = dynamic_cast<const torch::optim::RMSpropParamState*>(&state))
    return {s->square_avg(), s->momentum_buffer(), s->grad_avg()};
  return {};
}

// The optimizer state tensors shaped like their parameter. LibTorch's own
// optimizers' are read in place; any other torch::optim optimizer's through
// its state's own serialisation, which copies them (a transient peak of about
// twice the state of the largest parameter: with Adam's state read that way,
// a 2-rank ZeRO-2 run's resident peak rose by tens of MiB, bench/memory_peaks.sh).
inline std::vector<at::Tensor> per_element_state(const torch::optim::OptimizerParamState& state,
                                                 const at::Tensor& param) {
  std::vector<at::Tensor> tensors;
  auto keep = [&](const at::Tensor& t) {
    if (t.defined() && t.sizes() == param.sizes()) tensors.push_back(t);
  };
  const auto known = known_state_tensors(state);
  if (!known.empty()) {
    for (const auto& t : known) keep(t);
    return tensors;
  }
  torch::serialize::OutputArchive out;
  state.serialize(out);
  std::stringstream buffer;
  out.save_to(buffer);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  for (const auto& key : in.keys()) {
    at::Tensor t;
    if (in.try_read(key, t)) keep(t);
  }
  return tensors;
}

}  // namespace detail

/// What this rank holds now: distinct storages of the prepared models'
/// parameters, of every gradient (the model's and the optimizer's, shared
/// storage counted once), and of the optimizer's per-element state.
/// `optimizer_parameters`: what the optimizer steps (ZeRO: shards); `offloaded`:
/// cpu_offload's host twins; `device_shards`: the device shards they mirror.
inline ModelStateBytes model_state_bytes(const std::vector<std::shared_ptr<torch::nn::Module>>& models,
                                         torch::optim::Optimizer* optimizer,
                                         const std::vector<at::Tensor>& optimizer_parameters,
                                         const std::vector<at::Tensor>& offloaded,
                                         const std::vector<at::Tensor>& device_shards) {
  ModelStateBytes bytes;
  std::unordered_set<const void*> seen;
  auto count = [&](const at::Tensor& t, std::int64_t& into) {
    if (!t.defined() || !t.has_storage()) return;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) into += static_cast<std::int64_t>(t.storage().nbytes());
  };
  std::unordered_set<const void*> host;  // the tensors cpu_offload steps in host memory
  for (const auto& p : offloaded) {
    host.insert(p.unsafeGetTensorImpl());
    count(p, bytes.offloaded_parameters);
    count(p.grad(), bytes.offloaded_gradients);
  }
  for (const auto& model : models)
    for (const auto& p : model->parameters()) count(p, bytes.parameters);
  for (const auto& p : optimizer_parameters) count(p, bytes.parameters);  // ZeRO-3's own shards
  for (const auto& p : device_shards) count(p, bytes.parameters);
  for (const auto& model : models)
    for (const auto& p : model->parameters()) count(p.grad(), bytes.gradients);
  for (const auto& p : optimizer_parameters) count(p.grad(), bytes.gradients);
  for (const auto& p : device_shards) count(p.grad(), bytes.gradients);
  if (optimizer != nullptr)
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params()) {
        auto it = optimizer->state().find(compat::optimizer_state_key(*optimizer, p));
        if (it == optimizer->state().end()) continue;
        // Sized, not deduplicated (another optimizer's state is read back as copies).
        auto& into = host.contains(p.unsafeGetTensorImpl()) ? bytes.offloaded_optimizer_state : bytes.optimizer_state;
        for (const auto& t : detail::per_element_state(*it->second, p))
          into += static_cast<std::int64_t>(t.numel() * t.element_size());
      }
  return bytes;
}

}  // namespace strategy
}  // namespace accel
