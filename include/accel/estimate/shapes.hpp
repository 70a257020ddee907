#pragma once
// Common model shapes for `accel estimate-memory` without building a model:
// their parameters and module tree (for the model state, model_state.hpp)
// and the activation bytes of one training step at a batch size.
//
// Activations here are the peak bytes a forward and backward allocate above
// the model state (gradients already allocated, as from the second step on),
// temporaries included: what a counting allocator measures
// (device/allocation_counter.hpp), within 2% on the shapes tests/torch/
// test_estimate.cpp measures. They are derived for fp32 from what LibTorch's
// autograd saves and frees op by op; under BF16/FP16 autocast the casts it
// caches change them, and no formula here claims those: measure instead
// (estimate::peak_bytes_during, estimate/module.hpp). Torch-free.

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/estimate/model_state.hpp"

namespace accel::estimate {

/// A multi-layer perceptron: Linear layers of these widths (input first,
/// classes last) with a ReLU between each two, trained with cross-entropy,
/// as torch::nn::Sequential builds it (examples/mlp.cpp).
struct MlpShape {
  std::vector<std::int64_t> widths{};
};

/// The decoder-only transformer of examples/gpt_model.hpp (GPT-2's layout):
/// token and position embeddings; `layers` pre-norm blocks of causal
/// self-attention (fused QKV, `heads` heads) and a 4x MLP with GELU; a final
/// norm and an untied LM head without bias; cross-entropy over `vocab`.
/// Sequences are `context` tokens long. No tensor parallelism.
struct GptShape {
  std::int64_t vocab = 64, context = 16, width = 32, heads = 4, layers = 2;
};

namespace detail {

inline void check_positive(std::int64_t value, const std::string& what) {
  if (value < 1) throw std::invalid_argument("accel estimate: " + what + " must be at least 1, got " + std::to_string(value));
}

// A module with parameters of these shapes' element counts, appended to `shape`.
inline strategy::ModuleNode module_with(ModelShape& shape, std::string class_name, std::vector<std::int64_t> numels) {
  strategy::ModuleNode node{.class_name = std::move(class_name)};
  for (auto n : numels) {
    node.params.push_back(shape.params.size());
    shape.params.push_back({.numel = n, .element_size = 4});
  }
  return node;
}

inline strategy::ModuleNode layer_norm(ModelShape& shape, std::int64_t width) {
  return module_with(shape, "torch::nn::LayerNormImpl", {width, width});
}

}  // namespace detail

inline ModelShape model_shape(const MlpShape& mlp) {
  if (mlp.widths.size() < 2) throw std::invalid_argument("accel estimate: an MLP needs at least two widths (input, output)");
  for (auto w : mlp.widths) detail::check_positive(w, "every MLP width");
  ModelShape shape;
  shape.tree.class_name = "torch::nn::SequentialImpl";
  int index = 0;
  for (std::size_t i = 0; i + 1 < mlp.widths.size(); ++i) {
    const auto in = mlp.widths[i], out = mlp.widths[i + 1];
    shape.tree.children.emplace_back(std::to_string(index++),
                                     detail::module_with(shape, "torch::nn::LinearImpl", {out * in, out}));
    if (i + 2 < mlp.widths.size())
      shape.tree.children.emplace_back(std::to_string(index++), strategy::ModuleNode{.class_name = "torch::nn::ReLUImpl"});
  }
  return shape;
}

inline ModelShape model_shape(const GptShape& gpt) {
  for (auto [value, what] : {std::pair{gpt.vocab, "vocab"}, {gpt.context, "context"}, {gpt.width, "width"},
                             {gpt.heads, "heads"}, {gpt.layers, "layers"}})
    detail::check_positive(value, what);
  if (gpt.width % gpt.heads != 0)
    throw std::invalid_argument("accel estimate: the width (" + std::to_string(gpt.width) + ") must divide by the heads (" +
                                std::to_string(gpt.heads) + ")");
  const std::int64_t h = gpt.width;
  ModelShape shape;
  shape.tree.class_name = "torch::nn::SequentialImpl";
  strategy::ModuleNode embed{.class_name = "gpt::EmbedImpl"};
  embed.children.emplace_back("tokens", detail::module_with(shape, "accel::nn::VocabParallelEmbeddingImpl", {gpt.vocab * h}));
  embed.children.emplace_back("positions", detail::module_with(shape, "torch::nn::EmbeddingImpl", {gpt.context * h}));
  shape.tree.children.emplace_back("0", std::move(embed));
  for (std::int64_t l = 0; l < gpt.layers; ++l) {
    strategy::ModuleNode block{.class_name = "gpt::BlockImpl"};
    block.children.emplace_back("norm1", detail::layer_norm(shape, h));
    block.children.emplace_back("qkv", detail::module_with(shape, "accel::nn::ColumnParallelLinearImpl", {3 * h * h, 3 * h}));
    block.children.emplace_back("out", detail::module_with(shape, "accel::nn::RowParallelLinearImpl", {h * h, h}));
    block.children.emplace_back("norm2", detail::layer_norm(shape, h));
    block.children.emplace_back("up", detail::module_with(shape, "accel::nn::ColumnParallelLinearImpl", {4 * h * h, 4 * h}));
    block.children.emplace_back("down", detail::module_with(shape, "accel::nn::RowParallelLinearImpl", {4 * h * h, h}));
    shape.tree.children.emplace_back(std::to_string(l + 1), std::move(block));
  }
  strategy::ModuleNode head{.class_name = "gpt::HeadImpl"};
  head.children.emplace_back("norm", detail::layer_norm(shape, h));
  head.children.emplace_back("logits", detail::module_with(shape, "accel::nn::ColumnParallelLinearImpl", {gpt.vocab * h}));
  shape.tree.children.emplace_back(std::to_string(gpt.layers + 1), std::move(head));
  return shape;
}

/// Peak activation bytes of one fp32 step of the MLP at `batch` rows,
/// followed allocation by allocation: forward, each hidden layer's output
/// and its ReLU's (saved); the logits and log-softmax; backward, from the
/// top, each layer's input gradient, weight and bias gradients (then added
/// into .grad and freed) and the ReLU's gradient, freeing what it consumed.
inline std::int64_t activation_bytes(const MlpShape& mlp, std::int64_t batch) {
  model_shape(mlp);  // checks the widths
  detail::check_positive(batch, "the batch size");
  constexpr std::int64_t e = 4;
  const auto& w = mlp.widths;
  const std::size_t layers = w.size() - 1;
  const std::int64_t n = batch, classes = w.back();
  std::int64_t live = 0, peak = 0;
  auto alloc = [&](std::int64_t bytes) { peak = std::max(peak, live += bytes); };
  auto free = [&](std::int64_t bytes) { live -= bytes; };
  for (std::size_t i = 1; i < layers; ++i) {
    alloc(e * n * w[i]);  // the linear's output
    alloc(e * n * w[i]);  // the ReLU's, saved for both backwards
    free(e * n * w[i]);
  }
  alloc(e * n * classes);  // logits
  alloc(e * n * classes);  // log-softmax, saved
  alloc(e * n);            // the loss per row
  free(e * n * classes);
  alloc(e * n * classes);  // gradient of the log-softmax
  alloc(e * n * classes);  // gradient of the logits
  free(2 * e * n * classes);
  std::int64_t gradient = e * n * classes;
  for (std::size_t i = layers; i >= 1; --i) {
    const std::int64_t in = w[i - 1], out = w[i];
    if (i > 1) alloc(e * n * in);  // gradient of the layer's input
    alloc(e * in * out);           // weight gradient, before it is added into .grad
    alloc(e * out);
    free(e * in * out + e * out);
    free(gradient);
    if (i > 1) {
      gradient = e * n * in;
      alloc(gradient);          // the ReLU's gradient
      free(2 * gradient);       // frees its input gradient and the saved output
    }
  }
  return peak;
}

/// Peak activation bytes of one fp32 step of the GPT at `batch` sequences.
/// With n = batch x context tokens, H the width, A = batch x heads x
/// context^2 the attention scores, each block saves 16nH values (the norms'
/// outputs, Q, K and V made contiguous, the mixed heads, the residual, the
/// MLP's 4H hidden twice), A attention probabilities, a context^2 causal
/// mask and the norms' statistics. The peak is the largest of three
/// moments: inside the last block's forward (its scores and Q/K/V chunks
/// still live: A + 6nH); in the loss (logits, shifted and exponentiated:
/// 3nV, beside the head's 2nH); or in the last block's MLP backward (the
/// 4H x H weight gradient and its input gradient: 4H^2 + 4nH).
inline std::int64_t activation_bytes(const GptShape& gpt, std::int64_t batch) {
  model_shape(gpt);  // checks the shape
  detail::check_positive(batch, "the batch size");
  constexpr std::int64_t e = 4;
  const std::int64_t s = gpt.context, h = gpt.width, n = batch * s, nh = n * h;
  const std::int64_t scores = batch * gpt.heads * s * s;
  const std::int64_t embedding = e * nh + 8 * s + 8 * n;  // its output; positions and index masks (int64)
  const std::int64_t block = e * (16 * nh + scores + 4 * n) + s * s;
  const std::int64_t in_block = e * (scores + 6 * nh);
  const std::int64_t in_loss = e * (2 * nh + 2 * n) + 3 * e * n * gpt.vocab;
  const std::int64_t in_backward = e * (4 * h * h + 4 * nh);
  return embedding + gpt.layers * block + std::max({in_block, in_loss, in_backward});
}

}  // namespace accel::estimate
