// CUDA device tests. Without a CUDA LibTorch and a visible GPU the binary
// exits 77, which meson reports as SKIP (never as a pass).
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <filesystem>
#include <unistd.h>

#define DOCTEST_CONFIG_IMPLEMENT
#include "doctest_torch.hpp"

using namespace accel::testing;

TEST_CASE("CUDA: Trainer<SingleProcess, BF16, CUDA> runs the forward in bf16 on the GPU") {
  auto net = tiny_mlp(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  accel::Trainer<accel::SingleProcess, accel::BF16, accel::CUDA> trainer;
  trainer.prepare(net, opt);
  CHECK(net->parameters().front().is_cuda());
  auto batch = global_batch(0, 8);
  auto x = batch.x.to(trainer.device()), y = batch.y.to(trainer.device());
  at::ScalarType inside = at::kFloat;
  trainer.step([&] {
    auto logits = net->forward(x);
    inside = logits.scalar_type();
    return torch::nn::functional::cross_entropy(logits, y);
  });
  CHECK((inside == at::kBFloat16));
  CHECK((net->parameters().front().scalar_type() == at::kFloat));
}

TEST_CASE("CUDA: FP16 with dynamic loss scaling trains, and an overflow is skipped") {
  auto net = tiny_mlp(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  accel::Trainer<accel::SingleProcess, accel::FP16, accel::CUDA> trainer(accel::SingleProcess{},
                                                                        accel::FP16{.init_scale = 1024});
  trainer.prepare(net, opt);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    auto x = global_batch(step, 32).x.to(trainer.device());
    auto y = x.narrow(1, 0, 4).argmax(1);
    last = trainer.step([&] { return loss_of(net, x, y); }).item<double>();
    if (step == 0) first = last;
  }
  CHECK(last < first);
  CHECK(trainer.loss_scale() == 1024);
  // A loss that overflows fp16 when scaled: the step is skipped, the scale backs off.
  auto before = net->parameters().front().detach().clone();
  auto x = global_batch(99, 32).x.to(trainer.device());
  trainer.step([&] { return loss_of(net, x, x.narrow(1, 0, 4).argmax(1)) * 1e30; });
  CHECK(trainer.optimizer_step_was_skipped());
  CHECK(trainer.loss_scale() == 512);
  CHECK(net->parameters().front().equal(before));
}

TEST_CASE("CUDA: the FP16 loss scaler's state survives save_state / load_state") {
  const auto dir = std::filesystem::temp_directory_path() / ("accel_cuda_scaler_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto net = tiny_mlp(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  accel::Trainer<accel::SingleProcess, accel::FP16, accel::CUDA> trainer(accel::SingleProcess{},
                                                                        accel::FP16{.init_scale = 1024, .growth_interval = 3});
  trainer.prepare(net, opt);
  auto x = global_batch(0, 8).x.to(trainer.device());
  trainer.step([&] { return loss_of(net, x, x.narrow(1, 0, 4).argmax(1)) * 1e30; });  // overflow: 512
  trainer.step([&] { return loss_of(net, x, x.narrow(1, 0, 4).argmax(1)); });         // one clean step
  REQUIRE(trainer.loss_scale() == 512);
  trainer.save_state(dir);
  auto net2 = tiny_mlp(1);
  torch::optim::SGD opt2(net2->parameters(), torch::optim::SGDOptions(0.1));
  accel::Trainer<accel::SingleProcess, accel::FP16, accel::CUDA> resumed(accel::SingleProcess{},
                                                                        accel::FP16{.init_scale = 1024, .growth_interval = 3});
  resumed.prepare(net2, opt2);
  resumed.load_state(dir);
  CHECK(resumed.loss_scale() == 512);
  // The growth tracker came back too: two more clean steps complete the interval of 3.
  for (int i = 0; i < 2; ++i) resumed.step([&] { return loss_of(net2, x, x.narrow(1, 0, 4).argmax(1)); });
  CHECK(resumed.loss_scale() == 1024);
  std::filesystem::remove_all(dir);
}

int main(int argc, char** argv) {
  at::set_num_threads(1);
  if (!at::hasCUDA()) {
    std::puts("no CUDA LibTorch or no visible GPU: skipping the CUDA tests");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
