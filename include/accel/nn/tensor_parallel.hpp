#pragma once
// Megatron-LM tensor parallelism as LibTorch modules (TORCH_MODULE style).
//
// NOTE [Tensor-parallel conjugate operators]
// A column-parallel linear layer splits its output features over the tensor
// group, a row-parallel one its input features; a pair of them (MLP, or the
// attention projections) needs one all-reduce forward and one backward:
//   copy_to_tensor_parallel:     forward identity,   backward all-reduce (Megatron's f)
//   reduce_from_tensor_parallel: forward all-reduce, backward identity   (Megatron's g)
//   gather_from_tensor_parallel: forward all-gather of the last dim, backward its slice
// They are custom autograd functions; the group travels in the autograd
// context as a pointer (the module that owns it outlives the graph).
// Each rank's slice comes from the same full initialisation (same seed on
// every rank, or `from_full`), so a tensor-parallel model starts from
// exactly the weights of its unsharded twin.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/nn/tensor_parallel_layer.hpp"
#include "accel/comm/communicator.hpp"

namespace accel::nn {

namespace detail {

inline std::int64_t pointer_to_int(comm::Communicator* group) { return reinterpret_cast<std::int64_t>(group); }
inline comm::Communicator& int_to_group(const c10::IValue& value) {
  return *reinterpret_cast<comm::Communicator*>(value.toInt());
}

struct CopyToTensorParallel : torch::autograd::Function<CopyToTensorParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor g = grads[0].contiguous().clone();
    int_to_group(ctx->saved_data["group"]).all_reduce(g, "tensor-parallel all-reduce (backward of copy)");
    return {g, at::Tensor()};
  }
};

struct ReduceFromTensorParallel : torch::autograd::Function<ReduceFromTensorParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x, std::int64_t group) {
    at::Tensor y = x.contiguous().clone();
    reinterpret_cast<comm::Communicator*>(group)->all_reduce(y, "tensor-parallel all-reduce (forward of reduce)");
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

struct GatherFromTensorParallel : torch::autograd::Function<GatherFromTensorParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, std::int64_t group) {
    auto& g = *reinterpret_cast<comm::Communicator*>(group);
    ctx->saved_data["group"] = group;
    ctx->saved_data["width"] = x.size(-1);
    return at::cat(g.all_gather(x.contiguous(), "tensor-parallel all-gather"), -1);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& g = int_to_group(ctx->saved_data["group"]);
    const std::int64_t width = ctx->saved_data["width"].toInt();
    return {grads[0].narrow(-1, g.rank() * width, width).contiguous(), at::Tensor()};
  }
};

inline std::int64_t slice_of(std::int64_t total, const comm::Communicator& group, const char* what) {
  if (total % group.size() != 0)
    throw std::invalid_argument(std::string("accel tensor parallel: ") + what + " " + std::to_string(total) +
                                " does not divide by the tensor-parallel size " + std::to_string(group.size()));
  return total / group.size();
}

}  // namespace detail

/// Megatron's f: identity forward, all-reduce of the gradient backward.
inline at::Tensor copy_to_tensor_parallel(const at::Tensor& x, comm::Communicator& group) {
  return detail::CopyToTensorParallel::apply(x, detail::pointer_to_int(&group));
}
/// Megatron's g: all-reduce forward, identity backward.
inline at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, comm::Communicator& group) {
  return detail::ReduceFromTensorParallel::apply(x, detail::pointer_to_int(&group));
}
/// Concatenates every rank's last dimension (backward: this rank's slice).
inline at::Tensor gather_from_tensor_parallel(const at::Tensor& x, comm::Communicator& group) {
  return detail::GatherFromTensorParallel::apply(x, detail::pointer_to_int(&group));
}

/// Output features split over the tensor group: weight (out/T, in), bias (out/T).
class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  std::vector<at::Tensor> split_parameters() const override {
    return bias.defined() ? std::vector<at::Tensor>{weight, bias} : std::vector<at::Tensor>{weight};
  }
  /// Rows [r*out/T, (r+1)*out/T) of `full`'s weight and bias. With `stride`
  /// k the outputs are k stacked blocks (e.g. a fused Q, K, V projection)
  /// and each block is split separately, so every rank gets its slice of
  /// each (Megatron's stride).
  ColumnParallelLinearImpl(const torch::nn::Linear& full, comm::Communicator& group, bool gather_output = false,
                           std::int64_t stride = 1)
      : group_(&group), gather_output_(gather_output) {
    if (stride < 1 || full->weight.size(0) % stride != 0)
      throw std::invalid_argument("accel tensor parallel: " + std::to_string(full->weight.size(0)) +
                                  " output features do not form " + std::to_string(stride) + " equal blocks");
    const auto block = full->weight.size(0) / stride;
    const auto rows = detail::slice_of(block, group, "output features");
    auto take = [&](const at::Tensor& t) {  // (out, ...) -> (stride*rows, ...): this rank's rows of each block
      std::vector<at::Tensor> parts;
      for (std::int64_t b = 0; b < stride; ++b) parts.push_back(t.detach().narrow(0, b * block + group.rank() * rows, rows));
      return at::cat(parts).clone();
    };
    weight = register_parameter("weight", take(full->weight));
    if (full->bias.defined()) bias = register_parameter("bias", take(full->bias));
  }
  /// A fresh `torch::nn::Linear(in, out)` sliced (every rank must be seeded alike).
  ColumnParallelLinearImpl(std::int64_t in, std::int64_t out, comm::Communicator& group, bool gather_output = false,
                           std::int64_t stride = 1)
      : ColumnParallelLinearImpl(torch::nn::Linear(in, out), group, gather_output, stride) {}

  /// (..., in) replicated -> (..., out/T) split, or (..., out) with gather_output.
  at::Tensor forward(const at::Tensor& x) {
    auto y = at::linear(copy_to_tensor_parallel(x, *group_), weight, bias);
    return gather_output_ ? gather_from_tensor_parallel(y, *group_) : y;
  }

  at::Tensor weight, bias;

 private:
  comm::Communicator* group_;
  bool gather_output_;
};
TORCH_MODULE(ColumnParallelLinear);

/// Input features split over the tensor group: weight (out, in/T); the bias
/// is whole and added once, after the all-reduce.
class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  /// The bias is whole: replicated.
  std::vector<at::Tensor> split_parameters() const override { return {weight}; }
  RowParallelLinearImpl(const torch::nn::Linear& full, comm::Communicator& group) : group_(&group) {
    const auto cols = detail::slice_of(full->weight.size(1), group, "input features");
    weight = register_parameter("weight", full->weight.detach().narrow(1, group.rank() * cols, cols).clone());
    if (full->bias.defined()) bias = register_parameter("bias", full->bias.detach().clone());
  }
  RowParallelLinearImpl(std::int64_t in, std::int64_t out, comm::Communicator& group)
      : RowParallelLinearImpl(torch::nn::Linear(in, out), group) {}

  /// (..., in/T) split -> (..., out) replicated.
  at::Tensor forward(const at::Tensor& x) {
    auto y = reduce_from_tensor_parallel(at::linear(x, weight), *group_);
    return bias.defined() ? y + bias : y;
  }

  at::Tensor weight, bias;

 private:
  comm::Communicator* group_;
};
TORCH_MODULE(RowParallelLinear);

/// The vocabulary split over the tensor group: rows [r*V/T, (r+1)*V/T).
class VocabParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  std::vector<at::Tensor> split_parameters() const override { return {weight}; }
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, comm::Communicator& group) : group_(&group) {
    rows_ = detail::slice_of(full->weight.size(0), group, "vocabulary size");
    first_ = group.rank() * rows_;
    weight = register_parameter("weight", full->weight.detach().narrow(0, first_, rows_).clone());
  }
  VocabParallelEmbeddingImpl(std::int64_t vocab, std::int64_t dim, comm::Communicator& group)
      : VocabParallelEmbeddingImpl(torch::nn::Embedding(vocab, dim), group) {}

  /// (...,) token ids -> (..., dim) replicated: each rank looks up the ids
  /// in its range, zeros the rest, and the all-reduce adds them up.
  at::Tensor forward(const at::Tensor& tokens) {
    auto mine = (tokens >= first_) & (tokens < first_ + rows_);
    auto local = (tokens - first_).clamp(0, rows_ - 1);
    auto rows = at::embedding(weight, local) * mine.unsqueeze(-1).to(weight.scalar_type());
    return reduce_from_tensor_parallel(rows, *group_);
  }

  at::Tensor weight;

 private:
  comm::Communicator* group_;
  std::int64_t rows_ = 0, first_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

/// Mean cross-entropy over logits whose vocabulary is split over the tensor
/// group ((N, V/T) here, V in all), without ever gathering (N, V): the max,
/// the sum of exponentials and the target's logit are all-reduced instead.
inline at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                               comm::Communicator& group) {
  const std::int64_t rows = logits.size(-1), first = group.rank() * rows;
  // (N, 1) the global max per row: a constant for the gradient
  at::Tensor max = std::get<0>(logits.detach().max(-1, true)).contiguous();
  group.all_reduce_max(max, "tensor-parallel max of logits");
  auto shifted = logits - max;
  // (N,) sum over the whole vocabulary of exp(logit - max)
  auto sum_exp = reduce_from_tensor_parallel(shifted.exp().sum(-1), group);
  // (N,) the target's shifted logit, from the rank that holds it
  auto mine = (targets >= first) & (targets < first + rows);
  auto local = (targets - first).clamp(0, rows - 1);
  auto picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine.to(logits.scalar_type());
  auto target_logit = reduce_from_tensor_parallel(picked, group);
  return (sum_exp.log() - target_logit).mean();
}

}  // namespace accel::nn
