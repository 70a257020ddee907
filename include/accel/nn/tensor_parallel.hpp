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
//
// NOTE [Sequence parallelism]
// Megatron's sequence parallelism: between a row-parallel layer and the next
// column-parallel one (norms, dropout, residual adds), activations are split
// along their first dimension (the sequence, or the rows of a batch) instead
// of replicated, so each rank holds and computes 1/T of them. The all-reduce
// of a pair becomes an all-gather before the column layer and a
// reduce-scatter after the row layer (the same bytes):
//   scatter_to_sequence_parallel:  forward this rank's rows,  backward all-gather of rows
//   gather_from_sequence_parallel: forward all-gather of rows, backward this rank's rows
//   column layer's input (inside):  forward all-gather of rows, backward reduce-scatter of rows
//                                    (keeping only this rank's rows, gathered again in backward)
//   row layer's output (inside):    forward reduce-scatter of rows, backward all-gather of rows
// Parameters applied to the split rows (a norm's, the row layer's bias) get
// only this rank's part of their gradient: sequence_parallel_gradients (and
// the row layer itself, for its bias) all-reduce it over the tensor group.

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

#include "accel/comm/collectives.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/nn/tensor_parallel_layer.hpp"

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

// The rows of `x` (its first dimension) that rank r of `group` holds under
// sequence parallelism; the row count must divide by the group size.
inline std::int64_t rows_per_rank(const at::Tensor& x, const comm::Communicator& group) {
  if (x.dim() == 0 || x.size(0) % group.size() != 0)
    throw std::invalid_argument("accel sequence parallel: " + std::to_string(x.dim() == 0 ? 0 : x.size(0)) +
                                " rows do not divide by the tensor-parallel size " + std::to_string(group.size()));
  return x.size(0) / group.size();
}

// This rank's rows of a replicated `x`, in a tensor of their own.
inline at::Tensor rows_of_this_rank(const at::Tensor& x, const comm::Communicator& group) {
  const std::int64_t rows = rows_per_rank(x, group);
  return x.narrow(0, group.rank() * rows, rows).clone(at::MemoryFormat::Contiguous);
}

inline at::Tensor all_gather_equal_rows(comm::Communicator& group, const at::Tensor& x, const std::string& what) {
  return at::cat(group.all_gather(x.contiguous(), what), 0);
}

// This rank's rows of the sum over the group of `x` (every rank's full rows).
inline at::Tensor reduce_scatter_rows(comm::Communicator& group, const at::Tensor& x, const std::string& what) {
  const std::int64_t rows = rows_per_rank(x, group);
  std::vector<std::int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] = rows;
  return comm::reduce_scatter(group, x.contiguous().reshape({-1}), what).reshape(shape);
}

struct ScatterToSequenceParallel : torch::autograd::Function<ScatterToSequenceParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    return rows_of_this_rank(x, *reinterpret_cast<comm::Communicator*>(group));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {all_gather_equal_rows(int_to_group(ctx->saved_data["group"]), grads[0], "sequence-parallel all-gather (backward of scatter)"),
            at::Tensor()};
  }
};

// Leaving the split: replicated computation follows, so every rank's
// gradient is whole and backward takes this rank's rows of it.
struct GatherFromSequenceParallel : torch::autograd::Function<GatherFromSequenceParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    return all_gather_equal_rows(*reinterpret_cast<comm::Communicator*>(group), x, "sequence-parallel all-gather");
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {rows_of_this_rank(grads[0], int_to_group(ctx->saved_data["group"])), at::Tensor()};
  }
};

// The column layer under sequence parallelism, as Megatron does it: the
// input's rows are all-gathered for the matmul, but only this rank's rows are
// kept for backward, which gathers them again (the whole input would
// otherwise stay allocated until backward, undoing the saving). Computes in
// the incoming gradient's dtype: under autocast that of the bf16 forward.
struct SequenceParallelColumnLinear : torch::autograd::Function<SequenceParallelColumnLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows, const at::Tensor& weight,
                            const at::Tensor& bias, std::int64_t group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["bias"] = bias.defined();
    ctx->save_for_backward({rows, weight});
    auto& g = *reinterpret_cast<comm::Communicator*>(group);
    return at::linear(all_gather_equal_rows(g, rows, "sequence-parallel all-gather (column layer)"), weight, bias);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& rows = saved[0];
    const at::Tensor& weight = saved[1];
    auto& g = int_to_group(ctx->saved_data["group"]);
    const at::Tensor grad = grads[0].contiguous();  // (N, ..., out/T)
    const auto dtype = grad.scalar_type();
    const at::Tensor whole =
        all_gather_equal_rows(g, rows, "sequence-parallel all-gather (column layer, again in backward)").to(dtype);
    const at::Tensor grad_2d = grad.reshape({-1, grad.size(-1)});
    const at::Tensor grad_weight = grad_2d.t().mm(whole.reshape({-1, whole.size(-1)})).to(weight.scalar_type());
    const at::Tensor grad_bias = ctx->saved_data["bias"].toBool() ? grad_2d.sum(0).to(weight.scalar_type()) : at::Tensor();
    const at::Tensor grad_rows = reduce_scatter_rows(g, grad.matmul(weight.to(dtype)),
                                                     "sequence-parallel reduce-scatter (column layer backward)");
    return {grad_rows.to(rows.scalar_type()), grad_weight, grad_bias, at::Tensor()};
  }
};

struct ReduceScatterToSequenceParallel : torch::autograd::Function<ReduceScatterToSequenceParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    return reduce_scatter_rows(*reinterpret_cast<comm::Communicator*>(group), x, "sequence-parallel reduce-scatter");
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {all_gather_equal_rows(int_to_group(ctx->saved_data["group"]), grads[0],
                            "sequence-parallel all-gather (backward of reduce-scatter)"),
            at::Tensor()};
  }
};

// Sums a parameter's gradient over the tensor group as backward produces it.
inline void all_reduce_gradient_over(at::Tensor& parameter, comm::Communicator& group) {
  comm::Communicator* g = &group;
  parameter.register_hook([g](at::Tensor grad) -> at::Tensor {
    at::Tensor sum = grad.contiguous().clone();
    g->all_reduce(sum, "sequence-parallel all-reduce of a parameter's gradient");
    return sum;
  });
}

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

/// Sequence parallelism (NOTE [Sequence parallelism]): enter it, taking this
/// rank's rows of a replicated `x`.
inline at::Tensor scatter_to_sequence_parallel(const at::Tensor& x, comm::Communicator& group) {
  return detail::ScatterToSequenceParallel::apply(x, detail::pointer_to_int(&group));
}
/// Leave sequence parallelism: every rank's rows, whole and replicated.
inline at::Tensor gather_from_sequence_parallel(const at::Tensor& x, comm::Communicator& group) {
  return detail::GatherFromSequenceParallel::apply(x, detail::pointer_to_int(&group));
}
/// For the parameters of modules applied to split rows (a LayerNorm between
/// sequence-parallel layers): their gradients are summed over the tensor
/// group during backward, so every rank steps the whole gradient.
inline void sequence_parallel_gradients(torch::nn::Module& module, comm::Communicator& group) {
  for (auto& p : module.parameters())
    if (p.requires_grad()) detail::all_reduce_gradient_over(p, group);
}

/// The tag that makes a column- or row-parallel layer sequence-parallel.
struct SequenceParallel {};
inline constexpr SequenceParallel sequence_parallel{};

/// Output features split over the tensor group: weight (out/T, in), bias (out/T).
class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  std::vector<at::Tensor> split_parameters() const override {
    return bias.defined() ? std::vector<at::Tensor>{weight, bias} : std::vector<at::Tensor>{weight};
  }
  std::vector<ParameterCut> cuts() const override {
    std::vector<ParameterCut> out{{"weight", 0, stride_, group_->size(), group_->rank()}};
    if (bias.defined()) out.push_back({"bias", 0, stride_, group_->size(), group_->rank()});
    return out;
  }
  /// Rows [r*out/T, (r+1)*out/T) of `full`'s weight and bias. With `stride`
  /// k the outputs are k stacked blocks (e.g. a fused Q, K, V projection)
  /// and each block is split separately, so every rank gets its slice of
  /// each (Megatron's stride).
  ColumnParallelLinearImpl(const torch::nn::Linear& full, comm::Communicator& group, bool gather_output = false,
                           std::int64_t stride = 1)
      : group_(&group), gather_output_(gather_output), stride_(stride) {
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
  /// Sequence-parallel: the input arrives as this rank's rows (N/T, ..., in)
  /// and is all-gathered; the output is (N, ..., out/T) as without it.
  ColumnParallelLinearImpl(const torch::nn::Linear& full, comm::Communicator& group, SequenceParallel,
                           std::int64_t stride = 1)
      : ColumnParallelLinearImpl(full, group, false, stride) {
    sequence_parallel_ = true;
  }

  /// (..., in) replicated -> (..., out/T) split, or (..., out) with gather_output.
  at::Tensor forward(const at::Tensor& x) {
    auto y = sequence_parallel_
                 ? detail::SequenceParallelColumnLinear::apply(x, weight, bias, detail::pointer_to_int(group_))
                 : at::linear(copy_to_tensor_parallel(x, *group_), weight, bias);
    return gather_output_ ? gather_from_tensor_parallel(y, *group_) : y;
  }

  at::Tensor weight, bias;

 private:
  comm::Communicator* group_;
  bool gather_output_;
  std::int64_t stride_ = 1;
  bool sequence_parallel_ = false;
};
TORCH_MODULE(ColumnParallelLinear);

/// Input features split over the tensor group: weight (out, in/T); the bias
/// is whole and added once, after the all-reduce.
class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  /// The bias is whole: replicated.
  std::vector<at::Tensor> split_parameters() const override { return {weight}; }
  std::vector<ParameterCut> cuts() const override { return {{"weight", 1, 1, group_->size(), group_->rank()}}; }
  RowParallelLinearImpl(const torch::nn::Linear& full, comm::Communicator& group) : group_(&group) {
    const auto cols = detail::slice_of(full->weight.size(1), group, "input features");
    weight = register_parameter("weight", full->weight.detach().narrow(1, group.rank() * cols, cols).clone());
    if (full->bias.defined()) bias = register_parameter("bias", full->bias.detach().clone());
  }
  RowParallelLinearImpl(std::int64_t in, std::int64_t out, comm::Communicator& group)
      : RowParallelLinearImpl(torch::nn::Linear(in, out), group) {}
  /// Sequence-parallel: the output is reduce-scattered into this rank's rows
  /// (N/T, ..., out); the bias, added to those rows, has its gradient summed
  /// over the tensor group.
  RowParallelLinearImpl(const torch::nn::Linear& full, comm::Communicator& group, SequenceParallel)
      : RowParallelLinearImpl(full, group) {
    sequence_parallel_ = true;
    if (bias.defined()) detail::all_reduce_gradient_over(bias, group);
  }

  /// (..., in/T) split -> (..., out) replicated, or this rank's rows of it.
  at::Tensor forward(const at::Tensor& x) {
    auto partial = at::linear(x, weight);
    auto y = sequence_parallel_ ? detail::ReduceScatterToSequenceParallel::apply(partial, detail::pointer_to_int(group_))
                                : reduce_from_tensor_parallel(partial, *group_);
    // The bias in the output's dtype: under autocast a whole Linear adds it
    // inside its bf16 matmul and returns bf16; fp32 + bf16 would promote.
    return bias.defined() ? y + bias.to(y.scalar_type()) : y;
  }

  at::Tensor weight, bias;

 private:
  comm::Communicator* group_;
  bool sequence_parallel_ = false;
};
TORCH_MODULE(RowParallelLinear);

/// The vocabulary split over the tensor group: rows [r*V/T, (r+1)*V/T).
class VocabParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  std::vector<at::Tensor> split_parameters() const override { return {weight}; }
  std::vector<ParameterCut> cuts() const override { return {{"weight", 0, 1, group_->size(), group_->rank()}}; }
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
