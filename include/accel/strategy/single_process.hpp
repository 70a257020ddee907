#pragma once
// SingleProcess: nothing to communicate. Every hook is an empty inline
// function, so Trainer<SingleProcess, FP32, CPU>::step compiles to the
// hand-written loop (bench/bench_trainer.cpp measures it).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/core/policies.hpp"
#include "accel/strategy/engine.hpp"

namespace accel::strategy {

class SingleProcessEngine final : public EngineDefaults {
 public:
  using settings_type = SingleProcess;

  static constexpr bool shards_optimizer_state = false;

  template <class Settings>
  SingleProcessEngine(const Settings&, comm::Communicator&) {
    static_assert(complete_engine<SingleProcessEngine>);
  }

  void prepare_model(torch::nn::Module& model) {
    for (auto& p : model.parameters())
      if (p.requires_grad()) params_.push_back(p);
  }
  void prepare_optimizer(torch::optim::Optimizer&) {}
  void before_backward(const at::Tensor&) {}
  void synchronize_gradients() {}
  void after_optimizer_step() {}
  void set_gradient_sync(bool) {}
  void zero_grad(torch::optim::Optimizer& optimizer) { optimizer.zero_grad(); }
  const std::vector<at::Tensor>& optimizer_parameters() const override { return params_; }

 private:
  std::vector<at::Tensor> params_;
};

}  // namespace accel::strategy
