#pragma once
// The loader `Trainer::prepare(dataset, options)` returns: this rank's shard
// of the dataset, in batches, moved to the trainer's device. It reports the
// batch it is on to the trainer (`LoaderCursor`), which is how
// gather_for_metrics knows which gathered rows are padding.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/data/dataset.hpp"
#include "accel/data/prefetch.hpp"
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
  /// PyTorch's num_workers: threads that load the next batches in the
  /// background while the loop trains (0: loaded in the loop, as before).
  /// The order is unchanged; the dataset's get() must be safe to call from
  /// several threads at once (data/prefetch.hpp).
  int num_workers = 0;
  /// PyTorch's prefetch_factor: batches loaded ahead per worker.
  int prefetch_factor = 2;
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
  /// An iterable dataset's loader (no sampler): how many of the step's
  /// ranks x count samples, in rank order, are real; the rest were filled
  /// from the stream's head (data/iterable.hpp). -1: all of them.
  std::int64_t real_in_step = -1;
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

/// A loader's position as torchdata's StatefulDataLoader hands it out
/// (state_dict / load_state_dict), for code that keeps it itself; save_state
/// records the same in its checkpoints. In samples the data ranks have read
/// together, so it resumes on another number of ranks or batch size too.
struct LoaderState {
  std::int64_t epoch = 0;
  std::int64_t samples_read = 0;  ///< in `epoch`, by all data ranks together
};

/// The member types of a loader's input iterator (over Batches, `*it` a reference).
struct BatchIteratorTypes {
  using value_type = Batch;
  using reference = Batch&;
  using difference_type = std::ptrdiff_t;
};

// NOTE [Epochs]
// Accelerate's DataLoaderShard counts its passes: each pass read to its
// end makes the next one the next epoch, so a shuffled loader reshuffles
// every epoch without set_epoch (PyTorch's DistributedSampler alone would
// repeat its order). A pass left early (a `break`) does not count, and
// set_epoch still sets the epoch as before. A checkpoint taken at the end
// of a pass saves the next epoch's start (checkpoint/state.hpp).

/// The epoch and pass bookkeeping both loaders share (NOTE [Epochs]), on
/// the LoaderPosition the trainer's checkpoints save; `samples_per_batch`
/// is one batch of every data rank together.
template <class Loader>
class LoaderPasses {
 public:
  /// Sets the epoch the next pass reads (a shuffled loader reshuffles for
  /// it, the same on every rank). Not needed in a loop over epochs: as
  /// Accelerate's prepared loader, each pass read to its end makes the next
  /// pass the next epoch. After load_state the loader is already at the
  /// saved epoch; setting the epoch it is at, after a whole pass, reads that
  /// epoch again.
  void set_epoch(std::int64_t epoch) {
    if (epoch != position_->epoch) {
      position_->epoch = epoch;
      position_->next_batch = 0;
      position_->skip = 0;
    } else if (finished_pass()) {
      position_->next_batch = 0;
    }
  }
  /// The epoch of the current pass (of the next one, once a pass ended and
  /// begin() started the next).
  std::int64_t epoch() const { return position_->epoch; }

  /// Where the loader is: the epoch and the samples its ranks have read in
  /// it (a pass read to its end is the next epoch's start).
  LoaderState state_dict() const {
    if (finished_pass()) return {position_->epoch + 1, 0};
    return {position_->epoch, position_->next_batch * samples_per_batch_};
  }
  /// Resumes where `state` was taken: the next pass reads `state.epoch`
  /// from the first batch not yet read (whole batches of this loader).
  void load_state_dict(const LoaderState& state) {
    if (state.epoch < 0 || state.samples_read < 0)
      throw std::invalid_argument("accel: load_state_dict: a negative epoch or sample count");
    position_->epoch = state.epoch;
    position_->skip = state.samples_read / samples_per_batch_;
    position_->next_batch = position_->skip;
  }
  /// Accelerate's skip_first_batches: the next pass starts `count` batches
  /// into its epoch (e.g. to resume mid-epoch by hand); the pass after it
  /// is whole again.
  Loader& skip_first_batches(std::int64_t count) {
    if (count < 0) throw std::invalid_argument("accel: skip_first_batches needs a count of at least 0");
    if (finished_pass()) start_next_epoch();
    position_->skip = count;
    return static_cast<Loader&>(*this);
  }

 protected:
  LoaderPasses(std::shared_ptr<LoaderPosition> position, std::int64_t samples_per_batch)
      : position_(std::move(position)), samples_per_batch_(samples_per_batch) {}

  /// Starts a pass: the next epoch when the last pass was read to its end,
  /// else the current one. Returns the first batch to read (past those to
  /// skip, at most `batches`).
  std::int64_t begin_pass(std::int64_t batches) {
    if (finished_pass()) start_next_epoch();
    const std::int64_t first = std::min(position_->skip, batches);
    position_->skip = 0;
    position_->next_batch = first;
    return first;
  }
  void served(std::int64_t batch) { position_->next_batch = batch + 1; }
  /// An iterable loader learns its epoch's length at the end of the stream.
  void set_batches(std::int64_t batches) { position_->batches = batches; }
  std::int64_t batches() const { return position_->batches; }

 private:
  bool finished_pass() const { return position_->batches > 0 && position_->next_batch >= position_->batches; }
  void start_next_epoch() {
    ++position_->epoch;
    position_->next_batch = 0;
  }

  std::shared_ptr<LoaderPosition> position_;
  std::int64_t samples_per_batch_;
};

template <batched_dataset Dataset>
class DataLoader : public LoaderPasses<DataLoader<Dataset>> {
  using Passes = LoaderPasses<DataLoader<Dataset>>;

 public:
  /// `order`: a user's sampler's order of the samples; `batches`: a user's
  /// batch sampler's batches, dealt whole (positions then count batches:
  /// one per data rank and step).
  DataLoader(Dataset dataset, LoaderOptions options, int world_size, int rank, at::Device device,
             std::shared_ptr<LoaderCursor> cursor, std::shared_ptr<LoaderPosition> position, EpochOrder order = {},
             EpochBatches batches = {})
      : Passes(position, batches ? world_size : per_rank_options(options, world_size).batch_size * world_size),
        dataset_(std::move(dataset)),
        options_(per_rank_options(options, world_size)),
        sampler_(std::make_unique<DistributedSampler>(
            dataset_.size(), world_size, rank,
            SamplerOptions{.shuffle = options_.shuffle,
                           .seed = options_.seed,
                           .drop_last = options_.drop_last && options_.sharding == Sharding::batches,
                           .sharding = options_.sharding,
                           .batch_size = options_.batch_size,
                           .even_batches = options_.even_batches},
            std::move(order), std::move(batches))),
        device_(device),
        cursor_(std::move(cursor)) {
    if (options_.batch_size < 1) throw std::invalid_argument("accel: batch_size must be at least 1");
    if (options_.num_workers < 0 || options_.prefetch_factor < 1)
      throw std::invalid_argument("accel: num_workers must be at least 0 and prefetch_factor at least 1");
    position->batch_size = sampler_->batched() ? 1 : options_.batch_size;
    this->set_batches(size());
  }

  /// Batches per epoch on this rank (the same on every rank unless even_batches is off).
  std::int64_t size() const {
    if (sampler_->batched()) return sampler_->batches_per_rank();
    const auto n = sampler_->most_per_rank();  // without even_batches, short ranks end on smaller or empty batches
    return options_.drop_last ? n / options_.batch_size : (n + options_.batch_size - 1) / options_.batch_size;
  }
  const DistributedSampler& sampler() const { return *sampler_; }

  /// One pass: this rank's samples in reading order, and where each batch
  /// starts in them (batch b is [offsets[b], offsets[b + 1])).
  struct Pass {
    at::Tensor indices;
    std::vector<std::int64_t> offsets;
  };

  /// An input iterator: `*it` loads its batch once and hands out a
  /// reference to it, so `auto`, `auto&` and `const auto&` loops all work.
  class iterator : public BatchIteratorTypes {
   public:
    iterator() = default;
    iterator(DataLoader* loader, std::shared_ptr<const Pass> pass, std::int64_t batch)
        : loader_(loader), pass_(std::move(pass)), batch_(batch) {}
    Batch& operator*() const {
      if (!loaded_) {
        current_ = loader_->load(*pass_, batch_);
        loaded_ = true;
      }
      return current_;
    }
    Batch* operator->() const { return &**this; }
    iterator& operator++() {
      ++batch_;
      loaded_ = false;
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(const iterator& other) const { return batch_ == other.batch_; }

   private:
    DataLoader* loader_ = nullptr;
    std::shared_ptr<const Pass> pass_;
    std::int64_t batch_ = 0;
    mutable Batch current_;
    mutable bool loaded_ = false;
  };

  /// Starts a pass (NOTE [Epochs]): the next epoch when the last pass was
  /// read to its end, else the current one; after load_state, past the
  /// batches the interrupted run had already read.
  iterator begin() {
    const std::int64_t first = this->begin_pass(size());
    sampler_->set_epoch(this->epoch());
    auto pass = make_pass();
    prefetcher_.reset();  // a pass left early: its workers stop
    if (options_.num_workers > 0)
      prefetcher_ = std::make_unique<Prefetcher>([this, pass](std::int64_t batch) { return fetch(*pass, batch); },
                                                 first, size(), options_.num_workers,
                                                 options_.num_workers * options_.prefetch_factor);
    return iterator(this, std::move(pass), first);
  }
  iterator end() { return iterator(this, {}, size()); }

 private:
  std::shared_ptr<const Pass> make_pass() const {
    auto pass = std::make_shared<Pass>();
    pass->offsets.push_back(0);
    if (sampler_->batched()) {
      auto batches = sampler_->rank_batches();
      for (const auto& b : batches) pass->offsets.push_back(pass->offsets.back() + b.size(0));
      pass->indices = at::cat(batches);
    } else {
      pass->indices = sampler_->indices();
      const std::int64_t n = pass->indices.size(0);  // the last batch smaller, or empty on a short rank
      for (std::int64_t b = 1; b <= size(); ++b) pass->offsets.push_back(std::min(b * options_.batch_size, n));
    }
    return pass;
  }

  Batch load(const Pass& pass, std::int64_t batch) {
    const std::int64_t first = pass.offsets[batch], count = pass.offsets[batch + 1] - first;
    *cursor_ = LoaderCursor{sampler_.get(), sampler_->epoch(), batch, first, count, batch + 1 == size()};
    this->served(batch);
    Batch b = prefetcher_ ? prefetcher_->take(batch) : fetch(pass, batch);
    if (b.data.device() != device_) {
      b.data = b.data.to(device_);
      if (b.target.defined()) b.target = b.target.to(device_);  // a dataset without targets has none
    }
    return b;
  }

  // The dataset's batch `batch` of this pass's `indices` (on a worker thread with num_workers).
  Batch fetch(const Pass& pass, std::int64_t batch) const {
    return dataset_.get(pass.indices.slice(0, pass.offsets[batch], pass.offsets[batch + 1]));
  }

  Dataset dataset_;
  LoaderOptions options_;
  std::unique_ptr<DistributedSampler> sampler_;  // stable address: the cursor points at it
  at::Device device_;
  std::shared_ptr<LoaderCursor> cursor_;
  std::unique_ptr<Prefetcher> prefetcher_;  // this pass's workers (num_workers > 0); declared last: stopped first
};

}  // namespace accel::data
