#pragma once
// Which sample indices each rank reads in an epoch. Both orders start from
// the same epoch order (a permutation seeded by seed + epoch, or 0..n-1) and
// pad it by wrapping around, so every rank reads as many samples:
// - Sharding::batches: Accelerate's prepared DataLoader (BatchSamplerShard,
//   even_batches, with its SeedableRandomSampler when shuffling): the order is
//   cut into batches and rank r takes batches r, r+n, ... whole.
// - Sharding::samples: PyTorch's DistributedSampler, bit for bit: rank r
//   takes positions r, r+n, ... and batches its own share.
// Either way one step's global batch is the same set of samples; the split
// across ranks differs (which matters where partial sums round, as in bf16).
// A user's batch sampler (batches of its own sizes: EpochBatches) is dealt
// as Accelerate's BatchSamplerShard deals one: batch i to rank i mod n,
// whole; the last round filled with the epoch's first batches (even_batches)
// or left short, or dropped (drop_last).
// With even_batches off (Accelerate's DataLoaderConfiguration(even_batches=
// False)) nothing is padded: the order is dealt out the same way and the last
// ranks simply get less. The loader still runs as many batches on every rank
// (the most any rank has), the short ranks' last one smaller or empty, so
// that collectives such as gather_for_metrics pair up. Meant for evaluation:
// an empty batch has no mean loss to train on.

#include <ATen/core/Tensor.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randperm.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include <stdexcept>

namespace accel::data {

/// How an epoch's samples are split across ranks (see the top of this file).
enum class Sharding {
  batches,  ///< Accelerate's order: whole batches per rank, in turn (the default)
  samples,  ///< PyTorch's DistributedSampler: every n-th sample per rank
};

struct SamplerOptions {
  bool shuffle = true;
  std::uint64_t seed = 0;  ///< shared by all ranks; the epoch is added to it
  bool drop_last = false;  ///< drop the tail instead of padding with repeats
  Sharding sharding = Sharding::samples;
  std::int64_t batch_size = 1;  ///< the unit Sharding::batches deals out
  bool even_batches = true;     ///< pad the tail so every rank reads as many samples
};

/// A user's order of the samples for an epoch (int64 indices, the same on
/// every rank and of the same length each epoch): what a wrapped LibTorch
/// sampler yields. It replaces the shuffled or sequential order; the
/// sharding, padding and dropping stay the loader's (Accelerate's
/// BatchSamplerShard around the user's sampler).
using EpochOrder = std::function<at::Tensor(std::int64_t epoch)>;

/// A user's batch sampler's epoch: its batches of indices, each of its own
/// size (the same number of batches every epoch), dealt to the ranks whole.
using EpochBatches = std::function<std::vector<at::Tensor>(std::int64_t epoch)>;

class DistributedSampler {
 public:
  DistributedSampler(std::int64_t dataset_size, int num_replicas, int rank, SamplerOptions options,
                     EpochOrder order = {}, EpochBatches batches = {})
      : size_(order ? order(0).size(0) : dataset_size),
        replicas_(num_replicas),
        rank_(rank),
        options_(options),
        order_(std::move(order)),
        batches_(std::move(batches)),
        batch_count_(batches_ ? static_cast<std::int64_t>(batches_(0).size()) : 0) {
    if (dataset_size <= 0) throw std::invalid_argument("accel: cannot shard an empty dataset");
    if (batches_) {
      if (options.sharding == Sharding::samples || options.shuffle)
        throw std::invalid_argument("accel: a batch sampler's batches are dealt to the ranks whole, in its order: "
                                    "use Sharding::batches and no shuffle");
      if (batch_count_ == 0) throw std::invalid_argument("accel: the batch sampler gave no batches for epoch 0");
      if (options.drop_last && batch_count_ < num_replicas)
        throw std::invalid_argument("accel: drop_last with " + std::to_string(batch_count_) +
                                    " batches leaves nothing for " + std::to_string(num_replicas) + " ranks");
      return;
    }
    if (options.batch_size < 1) throw std::invalid_argument("accel: batch_size must be at least 1");
    if (options.drop_last && dataset_size < num_replicas * unit())
      throw std::invalid_argument("accel: drop_last with " + std::to_string(dataset_size) +
                                  " samples leaves nothing for " + std::to_string(num_replicas) + " ranks");
  }

  void set_epoch(std::int64_t epoch) { epoch_ = epoch; }
  std::int64_t epoch() const { return epoch_; }
  std::int64_t dataset_size() const { return size_; }

  /// Whether every rank reads as many samples (padded or dropped to even
  /// them out). Never with a batch sampler's batches, whose sizes differ.
  bool even() const {
    if (batches_) return replicas_ == 1;
    return options_.even_batches || options_.drop_last || replicas_ == 1;
  }

  /// Whether a user's batch sampler gives the batches (EpochBatches).
  bool batched() const { return static_cast<bool>(batches_); }
  /// With a batch sampler: the batches every rank runs per epoch (a rank
  /// past the sampler's last batch, under even_batches = false, runs empty ones).
  std::int64_t batches_per_rank() const {
    if (options_.drop_last) return batch_count_ / replicas_;
    return (batch_count_ + replicas_ - 1) / replicas_;
  }
  /// With a batch sampler: whether `rank`'s batch `batch` is one of the
  /// sampler's, not a repeat filling the last round (or an empty one).
  bool real_batch(int rank, std::int64_t batch) const { return batch * replicas_ + rank < batch_count_; }
  /// With a batch sampler: this rank's batches of the current epoch, as
  /// Accelerate's BatchSamplerShard deals them (see the top of this file).
  std::vector<at::Tensor> rank_batches() const {
    auto all = batches_(epoch_);
    if (static_cast<std::int64_t>(all.size()) != batch_count_)
      throw std::invalid_argument("accel: the batch sampler gave " + std::to_string(all.size()) + " batches for epoch " +
                                  std::to_string(epoch_) + " but " + std::to_string(batch_count_) +
                                  " for epoch 0: it must give as many every epoch");
    std::vector<at::Tensor> mine;
    const std::int64_t head = std::min<std::int64_t>(batch_count_, replicas_);  // what fills the last round
    for (std::int64_t b = 0; b < batches_per_rank(); ++b) {
      const std::int64_t i = b * replicas_ + rank_;
      if (i < batch_count_) mine.push_back(all[i]);
      else if (options_.even_batches) mine.push_back(all[(i - batch_count_) % head]);
      else mine.push_back(at::empty({0}, at::TensorOptions().dtype(at::kLong)));
    }
    return mine;
  }

  /// Samples this rank reads (after padding or dropping).
  std::int64_t per_rank() const {
    if (replicas_ == 1) return options_.drop_last ? size_ / unit() * unit() : size_;  // nothing to even out
    if (!even()) return uneven_positions(rank_).size(0);
    const std::int64_t round = replicas_ * unit();  // samples dealt to all ranks in one turn
    const std::int64_t rounds = options_.drop_last ? size_ / round : (size_ + round - 1) / round;
    return rounds * unit();
  }
  std::int64_t padded_size() const { return per_rank() * replicas_; }
  /// The most samples any rank reads (rank 0's): per_rank() when even.
  std::int64_t most_per_rank() const { return even() ? per_rank() : uneven_positions(0).size(0); }
  Sharding sharding() const { return options_.sharding; }

  /// This rank's indices for the current epoch, int64, in reading order.
  at::Tensor indices() const {
    const at::Tensor order = global_order();
    if (replicas_ == 1) return order;
    if (!even()) return order.index_select(0, uneven_positions(rank_));
    if (options_.sharding == Sharding::samples) return order.slice(0, rank_, padded_size(), replicas_);
    // (rounds, ranks, batch): rank r's batches are column r
    return order.view({-1, replicas_, unit()}).select(1, rank_).reshape({-1});
  }

  /// How many of `rank`'s first `count` local positions past `start` are
  /// real samples rather than padding (padding sits at the global tail).
  std::int64_t real_in(int rank, std::int64_t start, std::int64_t count) const {
    std::int64_t real = 0;
    for (std::int64_t local = start; local < start + count; ++local)
      if (global_position(rank, local) < size_) ++real;
    return real;
  }

 private:
  // The number of consecutive samples of the order one rank takes at a time.
  std::int64_t unit() const { return options_.sharding == Sharding::batches ? options_.batch_size : 1; }

  // Without padding: this rank's positions in the epoch order, whole units
  // dealt in turn as when padded, the tail unit possibly short.
  at::Tensor uneven_positions(int rank) const {
    const std::int64_t u = unit();
    std::vector<std::int64_t> positions;
    for (std::int64_t start = static_cast<std::int64_t>(rank) * u; start < size_; start += replicas_ * u)
      for (std::int64_t p = start; p < std::min(start + u, size_); ++p) positions.push_back(p);
    return at::tensor(positions, at::TensorOptions().dtype(at::kLong));
  }

  // Where `rank`'s local position `local` sits in the padded epoch order.
  std::int64_t global_position(int rank, std::int64_t local) const {
    const std::int64_t u = unit();
    return ((local / u) * replicas_ + rank) * u + local % u;
  }

  at::Tensor global_order() const {
    at::Tensor order;
    if (order_) {
      order = order_(epoch_);
      if (order.size(0) != size_)
        throw std::invalid_argument("accel: the sampler gave " + std::to_string(order.size(0)) + " indices for epoch " +
                                    std::to_string(epoch_) + " but " + std::to_string(size_) +
                                    " for epoch 0: a wrapped sampler must give as many every epoch");
    } else if (options_.shuffle) {
      auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed + static_cast<std::uint64_t>(epoch_));
      order = at::randperm(size_, generator, at::TensorOptions().dtype(at::kLong));
    } else {
      order = at::arange(size_, at::TensorOptions().dtype(at::kLong));
    }
    if (!even()) return order;  // dealt out as it is (uneven_positions)
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
  EpochOrder order_;
  EpochBatches batches_;
  std::int64_t batch_count_ = 0;  // a batch sampler's batches per epoch
  std::int64_t epoch_ = 0;
};

}  // namespace accel::data
