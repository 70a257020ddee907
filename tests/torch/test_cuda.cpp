// CUDA device tests. Without a CUDA LibTorch and a visible GPU the binary
// exits 77, which meson reports as SKIP (never as a pass).
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <filesystem>
#include <unistd.h>

// A crash on a GPU machine must say where: doctest's own handler only names
// the test case, so this binary prints the crashing thread's stack instead.
#define DOCTEST_CONFIG_NO_POSIX_SIGNALS
#define DOCTEST_CONFIG_IMPLEMENT
#include "doctest_torch.hpp"

#include <execinfo.h>

#include <csignal>

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

TEST_CASE("CUDA: NCCL's adapter connects a process group, and host tensors travel through the GPU") {
  const auto& nccl = accel::comm::adapter_for(accel::comm::BackendKind::nccl);
  const auto host = at::arange(4, at::TensorOptions().dtype(at::kFloat));
  const auto wire = nccl.on_wire(host);
  CHECK(wire.is_cuda());
  CHECK(wire.cpu().equal(host));
  // A group of one over a store of its own: the adapter's process group all-reduces on the GPU.
  auto backend = nccl.connect(c10::make_intrusive<c10d::HashStore>(), 0, 1, accel::comm::WorldInfo{},
                              std::chrono::seconds(60));
  std::vector<at::Tensor> tensors{wire.clone()};
  backend->allreduce(tensors)->wait();
  CHECK(tensors[0].cpu().equal(host));
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

TEST_CASE("CUDA: the GPU's generator is checkpointed: draws after load_state repeat those after save_state") {
  const auto dir = std::filesystem::temp_directory_path() / ("accel_cuda_rng_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto net = tiny_mlp(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  accel::Trainer<accel::SingleProcess, accel::FP32, accel::CUDA> trainer;
  trainer.prepare(net, opt);
  trainer.set_seed(5);
  (void)at::randn({16}, at::TensorOptions().device(trainer.device()));  // move the GPU stream off its seed
  trainer.save_state(dir);
  const auto after_save = at::randn({16}, at::TensorOptions().device(trainer.device()));
  (void)at::randn({16}, at::TensorOptions().device(trainer.device()));  // and further on
  trainer.load_state(dir);
  const auto after_load = at::randn({16}, at::TensorOptions().device(trainer.device()));
  CHECK(after_load.equal(after_save));
  std::filesystem::remove_all(dir);
}

namespace {

// `steps` Adam steps on the GPU under Strategy (one rank), and the same plain.
template <class Strategy>
std::pair<torch::nn::Sequential, torch::nn::Sequential> strategy_and_plain(Strategy strategy, int steps,
                                                                          accel::ModelStateBytes* bytes = nullptr,
                                                                          bool* stepped_on_host = nullptr) {
  auto net = tiny_mlp(0), plain = tiny_mlp(0);
  accel::Trainer<Strategy, accel::FP32, accel::CUDA> trainer(strategy);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  trainer.prepare(net, opt);
  plain->to(trainer.device());
  torch::optim::Adam plain_opt(plain->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < steps; ++step) {
    auto batch = global_batch(step, 16);
    auto x = batch.x.to(trainer.device()), y = batch.y.to(trainer.device());
    trainer.step([&] { return loss_of(net, x, y); });
    plain_opt.zero_grad();
    loss_of(plain, x, y).backward();
    plain_opt.step();
  }
  if (bytes != nullptr) *bytes = trainer.model_state_bytes();
  if (stepped_on_host != nullptr) {
    const auto& p = opt.param_groups()[0].params().front();
    *stepped_on_host = p.is_cpu() && p.is_pinned();
  }
  trainer.unwrap_model();
  return {net, plain};
}

}  // namespace

TEST_CASE("CUDA: ZeRO-3 with one unit per Linear (gathered and freed on the GPU, its backward seen on autograd's "
          "device thread) trains like plain Adam, to 1e-5") {
  auto [net, plain] = strategy_and_plain(accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP,
                                                        .transformer_layer_cls_to_wrap = {"LinearImpl"}},
                                         5);
  CHECK(max_param_diff(*net, *plain) < 1e-5);
}

TEST_CASE("CUDA: cpu_offload steps pinned host twins; the GPU holds no optimizer state; results equal plain Adam") {
  accel::ModelStateBytes bytes;
  bool on_host = false;
  auto [z2, plain2] = strategy_and_plain(accel::ZeRO<2>{.cpu_offload = true}, 5, &bytes, &on_host);
  CHECK(on_host);
  CHECK(bytes.optimizer_state == 0);
  CHECK(bytes.offloaded_optimizer_state > 0);
  CHECK(max_param_diff(*z2, *plain2) < 1e-5);
  auto [z3, plain3] = strategy_and_plain(accel::ZeRO<3>{.cpu_offload = true}, 5, &bytes, &on_host);
  CHECK(on_host);
  CHECK(bytes.optimizer_state == 0);
  CHECK(max_param_diff(*z3, *plain3) < 1e-5);
}

namespace {
extern "C" void print_stack_and_die(int signal) {
  static const char header[] = "test_cuda: fatal signal; the crashing thread's stack:\n";
  (void)!::write(2, header, sizeof header - 1);
  void* frames[64];
  ::backtrace_symbols_fd(frames, ::backtrace(frames, 64), 2);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}
}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGSEGV, print_stack_and_die);
  std::signal(SIGBUS, print_stack_and_die);
  at::set_num_threads(1);
  if (!at::hasCUDA()) {
    std::puts("no CUDA LibTorch or no visible GPU: skipping the CUDA tests");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
