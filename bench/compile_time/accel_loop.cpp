// The same loop as plain_loop.cpp under an accel::Trainer, including only
// what it uses (the Trainer and its strategy's engine), or with
// -DACCEL_UMBRELLA through <accel/accel.hpp>, which brings every strategy's
// engine. The strategy: DDP, or -DACCEL_LOOP_ZERO3, -DACCEL_LOOP_HYBRID_SHARD,
// -DACCEL_LOOP_PARALLEL_ZERO1 (Parallel<ZeRO<1>>).
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#if defined(ACCEL_UMBRELLA)
#include <accel/accel.hpp>
#elif defined(ACCEL_LOOP_ZERO3)
#include <accel/strategy/zero3.hpp>
#elif defined(ACCEL_LOOP_HYBRID_SHARD)
#include <accel/strategy/hybrid_shard.hpp>
#elif defined(ACCEL_LOOP_PARALLEL_ZERO1)
#include <accel/strategy/parallel.hpp>
#else
#include <accel/strategy/ddp.hpp>
#endif
#include <accel/trainer.hpp>

#if defined(ACCEL_LOOP_ZERO3)
using Strategy = accel::ZeRO<3>;
#elif defined(ACCEL_LOOP_HYBRID_SHARD)
using Strategy = accel::HybridShard;
#elif defined(ACCEL_LOOP_PARALLEL_ZERO1)
using Strategy = accel::Parallel<accel::ZeRO<1>>;
#else
using Strategy = accel::DDP;
#endif

int main() {
  accel::Trainer<Strategy> trainer;
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  trainer.prepare(model, optimizer);
  for (int step = 0; step < 10; ++step) {
    auto x = at::randn({32, 8});
    auto y = at::randn({32, 4});
    trainer.step([&] { return torch::nn::functional::mse_loss(model->forward(x), y); });
  }
}
