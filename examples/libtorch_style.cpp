// Tutorial: a program written in LibTorch's own style, ported to accel.
//
// Everything here is what LibTorch's examples write: a `struct Net :
// torch::nn::Module`, a `torch::data` dataset with `.map(Normalize)` and
// `.map(Stack)`, an explicit loop. The lines marked `accel:` are the port
// (README, "Porting"): the Trainer, prepare, and trainer.step instead of
// zero_grad / backward / step. Run it alone or under the launcher:
//
//   ./build/examples/libtorch_style
//   ./build/tools/accel launch --num_processes 2 ./build/examples/libtorch_style
//
// It exits non-zero unless it learns (accuracy >= 0.9 on its own test set).

#include <ATen/ops/argmax.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/sin.h>
#include <torch/data/datasets.h>
#include <torch/data/transforms.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <accel/accel.hpp>

#include <cstdio>
#include <cstdlib>

// Two interleaved spirals, one per class: sample i is computed from i alone,
// so every rank has the same dataset without reading a file.
class Spirals : public torch::data::datasets::Dataset<Spirals> {
 public:
  explicit Spirals(std::size_t size, double noise_seed = 0) : size_(size), seed_(noise_seed) {}
  torch::data::Example<> get(std::size_t index) override {
    const double t = 0.5 + 3.0 * static_cast<double>(index / 2) / static_cast<double>(size_ / 2);
    const std::int64_t label = static_cast<std::int64_t>(index % 2);
    const double sign = label == 0 ? 1.0 : -1.0;
    const double wobble = 0.05 * std::sin(37.0 * static_cast<double>(index) + seed_);
    auto point = at::empty({2});
    point[0] = sign * t * std::cos(2.5 * t) + wobble;
    point[1] = sign * t * std::sin(2.5 * t) - wobble;
    return {point, at::full({}, label, at::TensorOptions().dtype(at::kLong))};
  }
  c10::optional<std::size_t> size() const override { return size_; }

 private:
  std::size_t size_;
  double seed_;
};

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(2, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 2));
  }
  at::Tensor forward(at::Tensor x) {
    x = x.view({x.size(0), 2});  // Normalize<> makes each sample (1, 1, 2): it is meant for images
    x = torch::relu(fc1->forward(x));
    x = torch::relu(fc2->forward(x));
    return torch::log_softmax(fc3->forward(x), 1);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

int main() {
  accel::Trainer<accel::DDP> trainer;                                   // accel: the Trainer
  trainer.set_seed(0);
  Net model;
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  trainer.prepare(model, optimizer);                                    // accel: by reference, Net stays yours

  auto train_set = Spirals(2000).map(torch::data::transforms::Normalize<>(0.0, 2.0))
                                .map(torch::data::transforms::Stack<>());
  auto loader = trainer.prepare(std::move(train_set), {.batch_size = 32, .shuffle = true});  // accel: sharded

  for (int epoch = 0; epoch < 30; ++epoch) {
    double loss_sum = 0;
    std::int64_t batches = 0;
    for (auto& batch : loader) {                                         // reshuffled every epoch
      auto loss = trainer.step([&] { return torch::nll_loss(model.forward(batch.data), batch.target); });
      loss_sum += loss.item<double>();
      ++batches;
    }
    if (epoch % 10 == 9) trainer.print("epoch", epoch + 1, "loss", loss_sum / static_cast<double>(batches));
  }

  // Evaluation: every test sample counted once across the ranks.
  auto test_set = Spirals(400, 1.0).map(torch::data::transforms::Normalize<>(0.0, 2.0))
                                   .map(torch::data::transforms::Stack<>());
  auto test_loader = trainer.prepare(std::move(test_set), {.batch_size = 50});
  std::int64_t correct = 0, seen = 0;
  for (const auto& batch : test_loader) {
    auto predicted = trainer.gather_for_metrics(model.forward(batch.data).argmax(1));
    auto target = trainer.gather_for_metrics(batch.target);
    correct += predicted.eq(target).sum().item<std::int64_t>();
    seen += target.size(0);
  }
  const double accuracy = static_cast<double>(correct) / static_cast<double>(seen);
  trainer.print("accuracy", accuracy, "on", seen, "test samples");
  return accuracy >= 0.9 ? EXIT_SUCCESS : EXIT_FAILURE;
}
