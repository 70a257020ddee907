#pragma once
// The mark of a tensor-parallel layer: which of its parameters are cut over
// the tensor group. The others are replicated on every tensor rank, so a
// global gradient norm must count them once (Megatron's
// `tensor_model_parallel` attribute). Torch-light so that strategies can ask
// without including the layers.

#include <ATen/core/Tensor.h>

#include <vector>

namespace accel::nn {

class TensorParallelLayer {
 public:
  virtual ~TensorParallelLayer() = default;
  /// This layer's parameters that hold only this rank's slice.
  virtual std::vector<at::Tensor> split_parameters() const = 0;
};

}  // namespace accel::nn
