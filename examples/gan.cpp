// Tutorial: a GAN in one Trainer, its loop written as PyTorch's DCGAN
// example writes it.
//
// Two models and two optimizers go into one prepare, as in Accelerate's
// `accelerator.prepare(G, D, opt_G, opt_D)`. Each iteration:
//   1. the discriminator: backward on a real batch, backward on a fake one
//      (the generator's output, detached), its gradient norm clipped, a step;
//   2. the generator: backward through the discriminator, a step.
// A backward synchronises the models its loss reaches, so step 1 leaves the
// generator alone, and step 2 fills (and averages) the discriminator's
// gradients too, which its next zero_grad clears, as in PyTorch.
//
// The generator learns to draw points of a 2-D Gaussian. The strategy is a
// flag, the precision the launcher's:
//
//   ./build/examples/gan
//   ./build/tools/accel launch --num_processes 2 ./build/examples/gan --strategy zero3
//   ./build/tools/accel launch --num_processes 2 --mixed_precision bf16 ./build/examples/gan --strategy zero2
//
// It exits non-zero unless the generated points' mean and spread come within
// 0.25 of the real ones.

#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <accel/accel.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "flags.hpp"

namespace {

// The real data: points around (2, -1), spread 0.5 on each axis.
const double real_mean[2] = {2.0, -1.0};
constexpr double real_std = 0.5;

at::Tensor real_batch(std::int64_t n) {
  auto points = at::randn({n, 2}) * real_std;
  points.select(1, 0).add_(real_mean[0]);
  points.select(1, 1).add_(real_mean[1]);
  return points;
}

at::Tensor bce(const at::Tensor& logits, double target) {
  // In fp32 even under BF16 autocast: the loss is a reduction.
  auto l = logits.to(at::kFloat);
  return torch::nn::functional::binary_cross_entropy_with_logits(l, at::full_like(l, target));
}

template <class Strategy, class Precision>
int train(int argc, char** argv) {
  using example::flag;
  accel::Trainer<Strategy, Precision> trainer;  // accel: the one Trainer
  trainer.set_seed(0);                            // the same initial weights everywhere (rank 0's win anyway)
  torch::nn::Sequential generator(torch::nn::Linear(4, 32), torch::nn::ReLU(), torch::nn::Linear(32, 2));
  torch::nn::Sequential discriminator(torch::nn::Linear(2, 32), torch::nn::LeakyReLU(
                                          torch::nn::LeakyReLUOptions().negative_slope(0.2)), torch::nn::Linear(32, 1));
  const double lr = std::stod(flag(argc, argv, "lr", "1e-3"));
  torch::optim::Adam opt_g(generator->parameters(), torch::optim::AdamOptions(lr).betas({0.5, 0.999}));
  torch::optim::Adam opt_d(discriminator->parameters(), torch::optim::AdamOptions(lr).betas({0.5, 0.999}));
  trainer.prepare(generator, discriminator, opt_g, opt_d);  // accel: both models, both optimizers
  trainer.set_seed(1, /*device_specific=*/true);           // each rank its own samples and noise

  const std::int64_t batch = flag(argc, argv, "batch_size", std::int64_t{256});
  const std::int64_t iterations = flag(argc, argv, "iterations", std::int64_t{1000});
  for (std::int64_t it = 0; it < iterations; ++it) {
    // The learning rate falls linearly to 0 over the second half, so the two players settle instead of
    // circling the equilibrium (in BF16 the circle was wide enough to miss the real mean by 0.3).
    const double rate = lr * std::min(1.0, 2.0 * static_cast<double>(iterations - it) / static_cast<double>(iterations));
    for (auto* opt : {&opt_g, &opt_d})
      for (auto& group : opt->param_groups()) static_cast<torch::optim::AdamOptions&>(group.options()).lr(rate);
    // 1. The discriminator: real batch, then fake batch, then one step.
    trainer.zero_grad(opt_d);
    at::Tensor loss_d_real, loss_d_fake, fake;
    {
      auto scope = trainer.autocast();  // accel: the forward in the Trainer's precision
      loss_d_real = bce(discriminator->forward(real_batch(batch).to(trainer.device())), 1.0);
    }
    trainer.backward(loss_d_real);  // accel: was loss_d_real.backward()
    {
      auto scope = trainer.autocast();
      fake = generator->forward(at::randn({batch, 4}).to(trainer.device()));
      loss_d_fake = bce(discriminator->forward(fake.detach()), 0.0);
    }
    trainer.backward(loss_d_fake);
    trainer.clip_grad_norm(discriminator, 1.0);  // accel: per model
    trainer.optimizer_step(opt_d);               // accel: was opt_d.step()

    // 2. The generator: through the discriminator, then one step.
    trainer.zero_grad(opt_g);
    at::Tensor loss_g;
    {
      auto scope = trainer.autocast();
      loss_g = bce(discriminator->forward(fake), 1.0);
    }
    trainer.backward(loss_g);
    trainer.optimizer_step(opt_g);
    if ((it + 1) % 200 == 0)
      trainer.print("iteration", it + 1, "loss_d", (loss_d_real + loss_d_fake).template item<double>(), "loss_g",
                    loss_g.template item<double>());
  }

  // How close the generated points are to the real ones, over every rank's samples.
  trainer.unwrap_model();
  at::Tensor samples;
  {
    c10::NoGradGuard no_grad;
    samples = trainer.gather(generator->forward(at::randn({512, 4}).to(trainer.device())).to(at::kFloat));
  }
  const auto mean = samples.mean(0), spread = samples.std(0);
  double error = 0;
  for (int axis = 0; axis < 2; ++axis) {
    error = std::max(error, std::abs(mean[axis].template item<double>() - real_mean[axis]));
    error = std::max(error, std::abs(spread[axis].template item<double>() - real_std));
  }
  trainer.print("generated mean", mean[0].template item<double>(), mean[1].template item<double>(), "spread",
                spread[0].template item<double>(), spread[1].template item<double>(), "; worst error", error);
  return error <= 0.25 ? EXIT_SUCCESS : EXIT_FAILURE;
}

template <class Precision>
int with_strategy(const std::string& strategy, int argc, char** argv) {
  if (strategy == "ddp") return train<accel::DDP, Precision>(argc, argv);
  if (strategy == "zero2") return train<accel::ZeRO<2>, Precision>(argc, argv);
  if (strategy == "zero3") return train<accel::ZeRO<3>, Precision>(argc, argv);
  std::fprintf(stderr, "gan: --strategy %s: choose ddp, zero2 or zero3\n", strategy.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string strategy = example::flag(argc, argv, "strategy", "ddp");
    const std::string precision =
        accel::comm::process_environment(accel::launch::variables::mixed_precision).value_or("no");
    if (precision == "no") return with_strategy<accel::FP32>(strategy, argc, argv);
    if (precision == "bf16") return with_strategy<accel::BF16>(strategy, argc, argv);
    std::fprintf(stderr, "gan: mixed_precision %s: this example runs no or bf16 (fp16 needs a GPU)\n",
                 precision.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gan: %s\n", e.what());
    return EXIT_FAILURE;
  }
}
