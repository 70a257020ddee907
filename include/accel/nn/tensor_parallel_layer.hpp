#pragma once
// The mark of a tensor-parallel layer: which of its parameters are cut over
// the tensor group. The others are replicated on every tensor rank, so a
// global gradient norm must count them once (Megatron's
// `tensor_model_parallel` attribute). Torch-light so that strategies can ask
// without including the layers.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace accel::nn {

/// Where a split parameter's slice lies in the whole parameter (what
/// save_model and load_safetensors write and read): the whole one cut along
/// `dim` into `stride` equal blocks (a fused Q, K, V projection's three),
/// each block into `parts` equal slices; this rank holds slice `index` of
/// every block, the blocks' slices stacked in order.
struct ParameterCut {
  std::string name;  ///< the parameter's name within the layer ("weight")
  std::int64_t dim = 0;
  std::int64_t stride = 1;
  std::int64_t parts = 1;
  std::int64_t index = 0;
};

class TensorParallelLayer {
 public:
  virtual ~TensorParallelLayer() = default;
  /// This layer's parameters that hold only this rank's slice.
  virtual std::vector<at::Tensor> split_parameters() const = 0;
  /// How each split parameter is cut from the whole one. Empty: not said,
  /// and whole-model files (save_model, load_safetensors) refuse the layer.
  virtual std::vector<ParameterCut> cuts() const { return {}; }
};

}  // namespace accel::nn
