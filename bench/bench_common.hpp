#pragma once
// Shared by the benchmark programs: the MLP, synthetic batches and the
// one-thread setup. Narrow LibTorch includes only (no <torch/torch.h>).

#include <ATen/Context.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

#include "accel/device/threads.hpp"

namespace bench {

/// An MLP of Linear layers with ReLU between them: widths {512, 1024, 1024,
/// 1024, 10} is the 2.6 M-parameter model of the DDP side-by-side.
struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const std::vector<std::int64_t>& widths) {
    for (std::size_t i = 0; i + 1 < widths.size(); ++i)
      layers.push_back(register_module("fc" + std::to_string(i),
                                       torch::nn::Linear(widths[i], widths[i + 1])));
  }
  at::Tensor forward(at::Tensor x) {
    for (std::size_t i = 0; i < layers.size(); ++i) {
      x = layers[i]->forward(x);
      if (i + 1 < layers.size()) x = at::relu(x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(MLP);

struct Batch {
  at::Tensor data, target;
};

/// `count` fixed random batches (the same for every program given the seed).
inline std::vector<Batch> make_batches(std::int64_t count, std::int64_t batch, std::int64_t features,
                                       std::int64_t classes, std::uint64_t seed) {
  at::manual_seed(seed);
  std::vector<Batch> out;
  for (std::int64_t i = 0; i < count; ++i)
    out.push_back({at::randn({batch, features}), at::randint(classes, {batch}, at::TensorOptions().dtype(at::kLong))});
  return out;
}

inline at::Tensor loss_of(MLP& model, const Batch& b) { return at::cross_entropy_loss(model->forward(b.data), b.target); }

/// One intra-op thread, and one OpenBLAS thread even when OPENBLAS_NUM_THREADS
/// was not set.
inline void one_thread() { accel::device::limit_cpu_threads(1); }

}  // namespace bench
