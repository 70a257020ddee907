// The baseline of bench/compile_time.sh: a training loop with only the
// LibTorch headers it needs (what a user TU costs without accel).
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

int main() {
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  for (int step = 0; step < 10; ++step) {
    auto x = at::randn({32, 8});
    auto y = at::randn({32, 4});
    optimizer.zero_grad();
    auto loss = torch::nn::functional::mse_loss(model->forward(x), y);
    loss.backward();
    optimizer.step();
  }
}
