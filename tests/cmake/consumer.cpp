// Built by CMake against an installed accel (tests/cmake/run.sh): trains a
// linear model for a few steps and checks that the loss fell.
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <accel/trainer.hpp>

#include <cstdio>
#include <cstdlib>

int main() {
  accel::Trainer<accel::DDP> trainer;  // one process here: DDP runs as a plain loop
  trainer.set_seed(0);
  torch::nn::Linear model(4, 1);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  trainer.prepare(model, optimizer);
  const auto x = at::randn({64, 4});
  const auto y = x.sum(1, true);
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    last = trainer.step([&] { return at::mse_loss(model->forward(x), y); }).item<double>();
    if (step == 0) first = last;
  }
  std::printf("consumer: loss %.4f -> %.4f on %d process(es)\n", first, last, trainer.num_processes());
  return last < first / 10 ? EXIT_SUCCESS : EXIT_FAILURE;
}
