#pragma once
// Shared by the LibTorch tests: tiny models, deterministic data, comparisons.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace accel::testing {

/// A small MLP, identical for the same seed on every rank.
inline torch::nn::Sequential tiny_mlp(std::uint64_t seed, std::int64_t in = 8, std::int64_t hidden = 16,
                                      std::int64_t out = 4, int hidden_layers = 2) {
  at::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(in, hidden), torch::nn::Tanh());
  for (int i = 1; i < hidden_layers; ++i) {
    net->push_back(torch::nn::Linear(hidden, hidden));
    net->push_back(torch::nn::Tanh());
  }
  net->push_back(torch::nn::Linear(hidden, out));
  return net;
}

struct GlobalBatch {
  at::Tensor x, y;
};

/// The global batch of step `step`: the same on every rank.
inline GlobalBatch global_batch(std::int64_t step, std::int64_t size, std::int64_t in = 8, std::int64_t classes = 4) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randn({size, in}, gen), at::randint(classes, {size}, gen, at::TensorOptions().dtype(at::kLong))};
}

inline at::Tensor loss_of(torch::nn::Sequential& net, const at::Tensor& x, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(net->forward(x), y);
}

/// Largest absolute difference between two models' parameters.
inline double max_param_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  if (pa.size() != pb.size()) throw std::runtime_error("models differ in parameter count");
  double worst = 0;
  for (std::size_t i = 0; i < pa.size(); ++i)
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>());
  return worst;
}

/// Throws (failing the rank, hence the spawn) when `ok` is false.
inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

}  // namespace accel::testing
