#pragma once
// What `Trainer::prepare` accepts as a dataset: anything with `size()` and a
// batched `get(indices)`; `TensorDataset` is the in-memory one.

#include <ATen/core/Tensor.h>
#include <ATen/ops/index_select.h>

#include <concepts>
#include <cstdint>
#include <stdexcept>

namespace accel::data {

/// One mini-batch: inputs and targets, first dimension = batch.
struct Batch {
  at::Tensor data;
  at::Tensor target;
};

/// A dataset the loader can batch: `size()` samples, and `get(idx)` returning
/// the samples at the int64 indices `idx` stacked along dimension 0.
template <class D>
concept batched_dataset = requires(const D& d, const at::Tensor& idx) {
  { d.size() } -> std::convertible_to<std::int64_t>;
  { d.get(idx) } -> std::same_as<Batch>;
};

/// Inputs and targets held in two tensors with the same first dimension.
class TensorDataset {
 public:
  TensorDataset(at::Tensor data, at::Tensor target) : data_(std::move(data)), target_(std::move(target)) {
    if (data_.size(0) != target_.size(0))
      throw std::invalid_argument("accel: TensorDataset: data has " + std::to_string(data_.size(0)) +
                                  " samples but target has " + std::to_string(target_.size(0)));
  }
  std::int64_t size() const { return data_.size(0); }
  Batch get(const at::Tensor& idx) const { return {data_.index_select(0, idx), target_.index_select(0, idx)}; }

 private:
  at::Tensor data_;
  at::Tensor target_;
};

}  // namespace accel::data
