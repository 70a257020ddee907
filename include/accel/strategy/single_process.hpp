#pragma once
// SingleProcess: nothing to communicate. Every hook is an empty inline
// function, so Trainer<SingleProcess, FP32, CPU>::step compiles to the
// hand-written loop (bench/bench_trainer.cpp measures it).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "accel/comm/communicator.hpp"
#include "accel/core/policies.hpp"

namespace accel::strategy {

template <class Precision, class Device>
class SingleProcessEngine {
 public:
  using settings_type = SingleProcess;

  template <class Settings>
  SingleProcessEngine(const Settings&, comm::Communicator&) {}

  void prepare_model(torch::nn::Module&) {}
  void before_backward(const at::Tensor&) {}
  void synchronize_gradients() {}
  void set_gradient_sync(bool) {}
  void zero_grad(torch::optim::Optimizer& optimizer) { optimizer.zero_grad(); }
};

}  // namespace accel::strategy
