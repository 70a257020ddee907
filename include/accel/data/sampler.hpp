#pragma once
// Which sample indices each rank reads in an epoch: PyTorch's
// DistributedSampler, bit for bit (same permutation for the same seed and
// epoch, padding by wrapping around, rank r takes positions r, r+n, ...).

#include <ATen/core/Tensor.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randperm.h>

#include <cstdint>
#include <stdexcept>

namespace accel::data {

struct SamplerOptions {
  bool shuffle = true;
  std::uint64_t seed = 0;  ///< shared by all ranks; the epoch is added to it
  bool drop_last = false;  ///< drop the tail instead of padding with repeats
};

class DistributedSampler {
 public:
  DistributedSampler(std::int64_t dataset_size, int num_replicas, int rank, SamplerOptions options)
      : size_(dataset_size), replicas_(num_replicas), rank_(rank), options_(options) {
    if (dataset_size <= 0) throw std::invalid_argument("accel: cannot shard an empty dataset");
    if (options.drop_last && dataset_size < num_replicas)
      throw std::invalid_argument("accel: drop_last with " + std::to_string(dataset_size) +
                                  " samples leaves nothing for " + std::to_string(num_replicas) + " ranks");
  }

  void set_epoch(std::int64_t epoch) { epoch_ = epoch; }
  std::int64_t epoch() const { return epoch_; }
  std::int64_t dataset_size() const { return size_; }

  /// Samples per rank (after padding or dropping).
  std::int64_t per_rank() const {
    return options_.drop_last ? size_ / replicas_ : (size_ + replicas_ - 1) / replicas_;
  }
  std::int64_t padded_size() const { return per_rank() * replicas_; }

  /// This rank's indices for the current epoch, int64, in reading order.
  at::Tensor indices() const { return global_order().slice(0, rank_, padded_size(), replicas_); }

  /// How many of `rank`'s first `count` local positions past `start` are
  /// real samples rather than padding (padding sits at the global tail).
  std::int64_t real_in(int rank, std::int64_t start, std::int64_t count) const {
    std::int64_t real = 0;
    for (std::int64_t local = start; local < start + count; ++local)
      if (local * replicas_ + rank < size_) ++real;
    return real;
  }

 private:
  at::Tensor global_order() const {
    at::Tensor order;
    if (options_.shuffle) {
      auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed + static_cast<std::uint64_t>(epoch_));
      order = at::randperm(size_, generator, at::TensorOptions().dtype(at::kLong));
    } else {
      order = at::arange(size_, at::TensorOptions().dtype(at::kLong));
    }
    const std::int64_t total = padded_size();
    if (total <= size_) return order.slice(0, 0, total);
    // Pad by repeating the head, as many times as needed (tiny datasets).
    std::vector<at::Tensor> parts{order};
    std::int64_t have = size_;
    while (have < total) {
      const std::int64_t take = std::min<std::int64_t>(size_, total - have);
      parts.push_back(order.slice(0, 0, take));
      have += take;
    }
    return at::cat(parts);
  }

  std::int64_t size_;
  int replicas_;
  int rank_;
  SamplerOptions options_;
  std::int64_t epoch_ = 0;
};

}  // namespace accel::data
