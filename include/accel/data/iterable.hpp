#pragma once
// An iterable (streaming) dataset, sharded as Accelerate's IterableDatasetShard:
//
//   struct Lines { auto begin() ...; auto end() ...; };  // yields Examples
//   auto loader = trainer.prepare(Lines{path}, {.batch_size = 32});
//
// An iterable dataset is a C++ range of examples (anything with a tensor
// `data`, and `target` if it has one: torch::data::Example<>), read from its
// begin() on every pass, as Python's IterableDataset.__iter__. It has no
// size and no indices, so every rank reads the whole stream and keeps its
// slice of each global batch: the stream is cut into consecutive groups of
// ranks x batch_size samples and rank r takes the r-th batch_size of each
// group (Accelerate's rule; under split_batches the group is batch_size).
// Every rank serves the same number of batches. The stream's last, short
// group is dropped under drop_last; otherwise it is filled by repeating the
// first group, as Accelerate does, and gather_for_metrics drops the
// repeats (the cursor says how many are real; Accelerate keeps them for
// a dataset without a length). On one process nothing is filled: the last
// batch is short, as Accelerate leaves a one-process loader alone. A range
// with set_epoch(epoch) is told the
// epoch at each pass (Accelerate's IterableDatasetShard.set_epoch), so a
// stream can reshuffle itself. state_dict/load_state_dict (and checkpoints)
// resume mid-epoch: the next pass reads the stream from its start and skips
// the groups already read.
//
// Refused, each with its sentence: shuffle (there are no indices to permute),
// Sharding::samples and even_batches = false (both assume a known size), and
// num_workers (the stream has one reader, in order).

#include <ATen/core/Tensor.h>
#include <ATen/ops/stack.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "accel/data/dataset.hpp"
#include "accel/data/loader.hpp"
#include "accel/data/torch_dataset.hpp"

namespace accel::data {

namespace detail {
// std::ranges::input_range and its aliases, from <iterator> alone: <ranges>
// would cost every translation unit that includes the Trainer ~0.5 s.
template <class R>
using range_iterator = decltype(std::ranges::begin(std::declval<R&>()));
template <class R>
using range_sentinel = decltype(std::ranges::end(std::declval<R&>()));
template <class R>
concept input_range = requires(R& r) {
  std::ranges::begin(r);
  std::ranges::end(r);
} && std::input_iterator<range_iterator<R>> && std::sentinel_for<range_sentinel<R>, range_iterator<R>>;
}  // namespace detail

/// A range of examples read from its begin() on every pass (see the top of this file).
template <class R>
concept iterable_dataset =
    detail::input_range<R> && detail::example<std::remove_cvref_t<std::iter_reference_t<detail::range_iterator<R>>>> &&
    !batched_dataset<R> && !torch_dataset<R>;

template <iterable_dataset Range>
class IterableLoader : public LoaderPasses<IterableLoader<Range>> {
  using Passes = LoaderPasses<IterableLoader<Range>>;

 public:
  IterableLoader(Range range, LoaderOptions options, int world_size, int rank, at::Device device,
                 std::shared_ptr<LoaderCursor> cursor, std::shared_ptr<LoaderPosition> position)
      : Passes(position, per_rank_options(options, world_size).batch_size * world_size),
        range_(std::move(range)),
        options_(per_rank_options(options, world_size)),
        world_size_(world_size),
        rank_(rank),
        device_(device),
        cursor_(std::move(cursor)) {
    if (options_.batch_size < 1) throw std::invalid_argument("accel: batch_size must be at least 1");
    if (options_.shuffle)
      throw std::invalid_argument("accel: an iterable dataset cannot be shuffled by the loader (it has no indices "
                                  "to permute): shuffle inside the stream (a set_epoch(epoch) member is told each "
                                  "pass's epoch), or give the dataset a size() and get()");
    if (options_.sharding != Sharding::batches)
      throw std::invalid_argument("accel: Sharding::samples needs a dataset of known size; an iterable dataset is "
                                  "dealt out in whole batches (Accelerate's IterableDatasetShard)");
    if (!options_.even_batches)
      throw std::invalid_argument("accel: even_batches = false needs a dataset of known size; an iterable "
                                  "dataset's last batch is filled from the stream's first samples (and "
                                  "gather_for_metrics drops them), or dropped with drop_last");
    if (options_.num_workers != 0)
      throw std::invalid_argument("accel: num_workers needs a dataset of known size; an iterable dataset is read "
                                  "in order by one reader: load ahead inside the stream");
    position->batch_size = options_.batch_size;
  }

  IterableLoader(IterableLoader&&) = default;
  IterableLoader& operator=(IterableLoader&&) = default;

  /// An input iterator over this pass's batches; `*it` is the current one.
  class iterator : public BatchIteratorTypes {
   public:
    iterator() = default;
    explicit iterator(IterableLoader* loader) : loader_(loader) {}
    Batch& operator*() const { return loader_->current_; }
    Batch* operator->() const { return &loader_->current_; }
    iterator& operator++() {
      loader_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const { return loader_ == nullptr || loader_->ended_; }

   private:
    IterableLoader* loader_ = nullptr;
  };

  /// Starts a pass (NOTE [Epochs] in data/loader.hpp) from the stream's
  /// begin(), past the batches to skip, and loads the first batch.
  iterator begin() {
    const std::int64_t first = this->begin_pass(std::numeric_limits<std::int64_t>::max());
    if constexpr (requires { range_.set_epoch(this->epoch()); }) range_.set_epoch(this->epoch());
    stream_.emplace(std::ranges::begin(range_));
    end_.emplace(std::ranges::end(range_));
    head_.clear();
    batch_ = -1;
    ended_ = false;
    next_ = read_group();
    while (batch_ + 1 < first && !ended_) skip_group();
    advance();
    return iterator(this);
  }
  std::default_sentinel_t end() const { return {}; }

 private:
  using Example = std::remove_cvref_t<std::iter_reference_t<detail::range_iterator<Range>>>;
  using Group = std::vector<Example>;

  std::int64_t group_size() const { return options_.batch_size * world_size_; }

  Group read_group() {
    Group group;
    for (; group.size() < static_cast<std::size_t>(group_size()) && *stream_ != *end_; ++*stream_)
      group.push_back(**stream_);
    return group;
  }

  // A group that would be served, read and dropped (resuming mid-epoch).
  void skip_group() {
    if (take_group().empty()) ended_ = true;
  }

  // The next group to serve, filled from the stream's head when short;
  // empty when the pass is over.
  Group take_group() {
    Group group = std::move(next_);
    next_.clear();
    real_ = static_cast<std::int64_t>(group.size());
    if (group.empty() || (options_.drop_last && real_ < group_size())) return {};
    if (head_.empty()) head_ = group;
    if (real_ < group_size()) {
      for (std::size_t i = 0; world_size_ > 1 && group.size() < static_cast<std::size_t>(group_size()); ++i)
        group.push_back(head_[i % head_.size()]);
    } else {
      next_ = read_group();
    }
    ++batch_;
    this->served(batch_);
    return group;
  }

  void advance() {
    Group group = take_group();
    if (group.empty()) {
      ended_ = true;
      this->set_batches(batch_ + 1);
      stream_.reset();
      end_.reset();
      current_ = Batch{};
      return;
    }
    const std::int64_t per_rank = options_.batch_size;
    std::vector<at::Tensor> data, target;
    const auto served = std::min<std::int64_t>((rank_ + 1) * per_rank, static_cast<std::int64_t>(group.size()));
    for (std::int64_t i = rank_ * per_rank; i < served; ++i) {
      data.push_back(group[i].data);
      if constexpr (detail::example_with_target<Example>) target.push_back(group[i].target);
    }
    current_ = Batch{at::stack(data).to(device_), target.empty() ? at::Tensor() : at::stack(target).to(device_)};
    const bool last =
        next_.empty() || (options_.drop_last && static_cast<std::int64_t>(next_.size()) < group_size());
    *cursor_ = LoaderCursor{nullptr, this->epoch(), batch_, batch_ * per_rank, served - rank_ * per_rank, last, real_};
  }

  Range range_;
  LoaderOptions options_;
  int world_size_;
  int rank_;
  at::Device device_;
  std::shared_ptr<LoaderCursor> cursor_;
  // This pass: where the stream is, the next group (read ahead to know
  // whether the current batch is the epoch's last), the first group (what
  // fills a short last one), the batch served.
  std::optional<detail::range_iterator<Range>> stream_;
  std::optional<detail::range_sentinel<Range>> end_;
  Group next_;
  Group head_;
  std::int64_t batch_ = -1;
  std::int64_t real_ = 0;
  bool ended_ = true;
  Batch current_;
};

}  // namespace accel::data
