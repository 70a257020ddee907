// Built by CMake against an installed accel (tests/cmake/run.sh): trains a
// linear model for a few steps and checks that the loss fell, and that
// std::filesystem binds to libstdc++ (NOTE [libstdc++ before LibTorch]).
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <accel/strategy/ddp.hpp>
#include <accel/trainer.hpp>

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

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
  Dl_info where{};
  void* remove_all = dlsym(RTLD_DEFAULT, "_ZNSt10filesystem10remove_allERKNS_7__cxx114pathE");
  const bool from_libstdcxx = remove_all != nullptr && dladdr(remove_all, &where) != 0 &&
                              std::strstr(where.dli_fname, "libstdc++") != nullptr;
  std::printf("consumer: std::filesystem::remove_all from %s\n", remove_all ? where.dli_fname : "nowhere");
  return last < first / 10 && from_libstdcxx ? EXIT_SUCCESS : EXIT_FAILURE;
}
