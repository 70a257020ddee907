// The same loop as plain_loop.cpp under accel::Trainer<accel::DDP>: including
// only what it uses (the Trainer and the DDP engine), or with -DACCEL_UMBRELLA
// through <accel/accel.hpp>, which brings every strategy's engine.
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#ifdef ACCEL_UMBRELLA
#include <accel/accel.hpp>
#else
#include <accel/strategy/ddp.hpp>
#include <accel/trainer.hpp>
#endif

int main() {
  accel::Trainer<accel::DDP> trainer;
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  trainer.prepare(model, optimizer);
  for (int step = 0; step < 10; ++step) {
    auto x = at::randn({32, 8});
    auto y = at::randn({32, 4});
    trainer.step([&] { return torch::nn::functional::mse_loss(model->forward(x), y); });
  }
}
