#pragma once
// What a passing twin instantiates: not only the Trainer's type but the
// members a training program calls, so a combination that constructs but
// cannot prepare, step or checkpoint fails here rather than in a user's build.
#include <ATen/ops/zeros.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <accel/trainer.hpp>  // a twin includes the strategy headers it uses first

namespace accel_test {

template <class Trainer>
void exercise_training(Trainer& trainer) {
  torch::nn::Sequential net(torch::nn::Linear(4, 4));
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  trainer.prepare(net, optimizer);
  auto loader = trainer.prepare(accel::data::TensorDataset(at::zeros({8, 4}), at::zeros({8})), {.batch_size = 2});
  for (auto batch : loader) {
    trainer.step([&] { return net->forward(batch.data).sum(); });
    {
      auto micro = trainer.accumulate();
      at::Tensor loss;
      {
        [[maybe_unused]] auto scope = trainer.autocast();
        loss = net->forward(batch.data).sum();
      }
      trainer.backward(loss);
      trainer.clip_grad_norm(1.0);
      trainer.optimizer_step();
      trainer.zero_grad();
    }
    // The calls naming a model or an optimizer (several models: README "Several models").
    trainer.clip_grad_norm(net, 1.0);
    trainer.clip_grad_value(net, 1.0);
    trainer.optimizer_step(optimizer);
    trainer.zero_grad(optimizer);
    (void)trainer.gather_for_metrics(batch.target);
  }
  (void)trainer.model_state_bytes();
  trainer.wait_for_everyone();
}

/// Everything, checkpoints included.
template <class Trainer>
void exercise(Trainer& trainer) {
  exercise_training(trainer);
  trainer.save_state("checkpoint");
  trainer.load_state("checkpoint");
  trainer.unwrap_model();
}

}  // namespace accel_test
