#pragma once
// The loader `Trainer::prepare(dataset, options)` returns: this rank's shard
// of the dataset, in batches, moved to the trainer's device. It reports the
// batch it is on to the trainer (`LoaderCursor`), which is how
// gather_for_metrics knows which gathered rows are padding.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>

#include "accel/data/dataset.hpp"
#include "accel/data/sampler.hpp"

namespace accel::data {

struct LoaderOptions {
  std::int64_t batch_size = 1;
  bool shuffle = false;
  std::uint64_t seed = 0;  ///< the shuffle seed, shared by all ranks
  /// Sharding::batches: drop the samples that do not fill a batch on every rank
  /// (Accelerate's drop_last); Sharding::samples: drop a final batch smaller than batch_size.
  bool drop_last = false;
  /// Which samples each rank reads: Accelerate's whole batches in turn (the
  /// default), or PyTorch DistributedSampler's every n-th sample.
  Sharding sharding = Sharding::batches;
  /// Accelerate's split_batches: `batch_size` is the global batch, split
  /// evenly across the data ranks (each reads batch_size / ranks samples a
  /// step), so the global batch stays the same whatever the number of
  /// processes. batch_size must divide by the number of ranks.
  bool split_batches = false;
  /// Accelerate's even_batches: pad the epoch's tail from its head so every
  /// rank reads as many full batches (the default). Off, nothing is repeated:
  /// the last ranks' final batch is smaller or empty (0 rows: the dataset's
  /// get must take no indices), and gather_for_metrics gathers the ragged
  /// batches. For evaluation: an empty batch has no loss to train on.
  bool even_batches = true;
};

/// The options one rank's loader runs with: under split_batches, its share
/// of the global batch.
inline LoaderOptions per_rank_options(LoaderOptions options, int world_size) {
  if (!options.split_batches) return options;
  if (options.batch_size < 1 || options.batch_size % world_size != 0)
    throw std::invalid_argument("accel: split_batches needs a batch_size that divides by the " +
                                std::to_string(world_size) + " data ranks, got " + std::to_string(options.batch_size) +
                                ": use a multiple of " + std::to_string(world_size) + ", or per-rank batches " +
                                "(split_batches = false)");
  options.batch_size /= world_size;
  options.split_batches = false;
  return options;
}

/// Where the most recently served batch sits: shared between a loader and
/// its trainer.
struct LoaderCursor {
  const DistributedSampler* sampler = nullptr;
  std::int64_t epoch = 0;
  std::int64_t batch = -1;     ///< index within the epoch
  std::int64_t first = 0;      ///< first local position of the batch
  std::int64_t count = 0;      ///< samples in the batch (on every rank, unless even_batches is off)
  bool last_in_epoch = false;  ///< gradient accumulation syncs at the end of an epoch
};

/// A loader's place in its data, saved in checkpoints so a resumed run reads
/// exactly the batches the interrupted one had not read yet.
struct LoaderPosition {
  std::int64_t epoch = 0;
  std::int64_t next_batch = 0;   ///< batches served in `epoch` so far
  std::int64_t skip = 0;         ///< batches to skip on the next pass over `epoch` (set by load_state)
  std::int64_t batch_size = 1;
  std::int64_t batches = 0;      ///< per epoch on this rank: a position at the end is the next epoch's start
};

template <batched_dataset Dataset>
class DataLoader {
 public:
  DataLoader(Dataset dataset, LoaderOptions options, int world_size, int rank, at::Device device,
             std::shared_ptr<LoaderCursor> cursor, std::shared_ptr<LoaderPosition> position)
      : dataset_(std::move(dataset)),
        options_(per_rank_options(options, world_size)),
        sampler_(std::make_unique<DistributedSampler>(
            dataset_.size(), world_size, rank,
            SamplerOptions{.shuffle = options_.shuffle,
                           .seed = options_.seed,
                           .drop_last = options_.drop_last && options_.sharding == Sharding::batches,
                           .sharding = options_.sharding,
                           .batch_size = options_.batch_size,
                           .even_batches = options_.even_batches})),
        device_(device),
        cursor_(std::move(cursor)),
        position_(std::move(position)) {
    if (options_.batch_size < 1) throw std::invalid_argument("accel: batch_size must be at least 1");
    position_->batch_size = options_.batch_size;
    position_->batches = size();
  }

  /// Reshuffle for `epoch` (same permutation on every rank). After
  /// load_state the loader is already at the saved epoch.
  void set_epoch(std::int64_t epoch) {
    if (epoch != position_->epoch) {
      position_->epoch = epoch;
      position_->next_batch = 0;
      position_->skip = 0;
    }
  }
  std::int64_t epoch() const { return position_->epoch; }

  /// Batches per epoch on this rank (the same on every rank unless even_batches is off).
  std::int64_t size() const {
    const auto n = sampler_->most_per_rank();  // without even_batches, short ranks end on smaller or empty batches
    return options_.drop_last ? n / options_.batch_size : (n + options_.batch_size - 1) / options_.batch_size;
  }
  const DistributedSampler& sampler() const { return *sampler_; }

  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    iterator(DataLoader* loader, at::Tensor indices, std::int64_t batch) : loader_(loader), indices_(std::move(indices)), batch_(batch) {}
    Batch operator*() const { return loader_->load(indices_, batch_); }
    iterator& operator++() { ++batch_; return *this; }
    void operator++(int) { ++batch_; }
    bool operator==(const iterator& other) const { return batch_ == other.batch_; }

   private:
    DataLoader* loader_ = nullptr;
    at::Tensor indices_;
    std::int64_t batch_ = 0;
  };

  /// Starts a pass over the current epoch; after load_state, past the
  /// batches the interrupted run had already read (skip_first_batches).
  iterator begin() {
    sampler_->set_epoch(position_->epoch);
    const std::int64_t first = std::min(position_->skip, size());
    position_->skip = 0;
    position_->next_batch = first;
    return iterator(this, sampler_->indices(), first);
  }
  iterator end() { return iterator(this, {}, size()); }

 private:
  Batch load(const at::Tensor& indices, std::int64_t batch) {
    const std::int64_t first = batch * options_.batch_size;
    const std::int64_t count = std::clamp<std::int64_t>(indices.size(0) - first, 0, options_.batch_size);
    *cursor_ = LoaderCursor{sampler_.get(), sampler_->epoch(), batch, first, count, batch + 1 == size()};
    position_->next_batch = batch + 1;
    Batch b = dataset_.get(indices.slice(0, first, first + count));
    if (b.data.device() != device_) {
      b.data = b.data.to(device_);
      b.target = b.target.to(device_);
    }
    return b;
  }

  Dataset dataset_;
  LoaderOptions options_;
  std::unique_ptr<DistributedSampler> sampler_;  // stable address: the cursor points at it
  at::Device device_;
  std::shared_ptr<LoaderCursor> cursor_;
  std::shared_ptr<LoaderPosition> position_;
};

}  // namespace accel::data
