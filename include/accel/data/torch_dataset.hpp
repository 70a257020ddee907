#pragma once
// LibTorch's own data API, prepared as it is written:
//
//   auto dataset = MyImages(root).map(torch::data::transforms::Normalize<>(0.5, 0.5))
//                                .map(torch::data::transforms::Stack<>());
//   auto loader = trainer.prepare(std::move(dataset), {.batch_size = 64, .shuffle = true});
//
// A torch::data dataset (anything with `size()` as an optional count and
// `get_batch(indices)`, so every `.map(...)` chain) becomes accel's
// batched_dataset: the loader asks it for this rank's indices and turns what
// it returns (a stacked Example, or a vector of Examples, stacked here) into
// a Batch. A LibTorch sampler gives the epoch's order instead of the
// loader's shuffle (`prepare(dataset, options, sampler)`), dealt out to the
// ranks as Accelerate's BatchSamplerShard deals a user's sampler.
//
// Only declarations of torch::data are needed here (concepts on the shape),
// so a program that uses none of it pays nothing for this header.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <c10/util/ArrayRef.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "accel/data/dataset.hpp"
#include "accel/data/sampler.hpp"

namespace accel::data {

/// A LibTorch dataset: torch::data::datasets::Dataset, BatchDataset, and
/// every MapDataset a `.map(...)` chain makes of them.
template <class D>
concept torch_dataset = requires(D& d, c10::ArrayRef<std::size_t> indices) {
  { d.size().has_value() } -> std::convertible_to<bool>;
  { *d.size() } -> std::convertible_to<std::size_t>;
  d.get_batch(indices);
} && !batched_dataset<D>;

/// A LibTorch sampler (torch::data::samplers::Sampler<>): reset, then
/// batches of indices until none is left.
template <class S>
concept torch_sampler = requires(S& s, std::size_t n) {
  s.reset(n);
  { *s.next(n) } -> std::convertible_to<std::vector<std::size_t>>;
};

namespace detail {

template <class E>
concept example_with_target = requires(const E& e) {
  { e.data } -> std::convertible_to<at::Tensor>;
  { e.target } -> std::convertible_to<at::Tensor>;
};
template <class E>
concept example_without_target = requires(const E& e) {
  { e.data } -> std::convertible_to<at::Tensor>;
} && !example_with_target<E>;
template <class E>
concept example = example_with_target<E> || example_without_target<E>;

template <class R>
struct is_example_vector : std::false_type {};
template <example E, class A>
struct is_example_vector<std::vector<E, A>> : std::true_type {};

// What get_batch returned, as a Batch (no target: an undefined tensor).
template <class R>
Batch to_batch(R&& result) {
  using T = std::remove_cvref_t<R>;
  if constexpr (example_with_target<T>) {
    return {result.data, result.target};
  } else if constexpr (example_without_target<T>) {
    return {result.data, at::Tensor()};
  } else if constexpr (is_example_vector<T>::value) {
    std::vector<at::Tensor> data, target;
    for (auto& e : result) {
      data.push_back(e.data);
      if constexpr (example_with_target<typename T::value_type>) target.push_back(e.target);
    }
    if (data.empty())
      throw std::invalid_argument("accel: a LibTorch dataset returned no examples for a non-empty batch");
    return {at::stack(data), target.empty() ? at::Tensor() : at::stack(target)};
  } else {
    static_assert(sizeof(T) == 0,
                  "accel: a LibTorch dataset's get_batch must return an Example (as .map(Stack<>()) makes it) "
                  "or a std::vector of Examples with a tensor `data` (and `target`)");
  }
}

}  // namespace detail

/// A LibTorch dataset as accel's batched_dataset (see the top of this file).
template <torch_dataset D>
class TorchDataset {
 public:
  explicit TorchDataset(D dataset) : dataset_(std::make_shared<D>(std::move(dataset))) {
    if (!dataset_->size().has_value())
      throw std::invalid_argument(
          "accel: this LibTorch dataset has no size (an iterable, streaming dataset): accel's loader shards "
          "datasets of known size only; give it a size() or read the stream per rank yourself");
  }
  std::int64_t size() const { return static_cast<std::int64_t>(*dataset_->size()); }
  Batch get(const at::Tensor& idx) const {
    const at::Tensor host = idx.to(at::kLong).contiguous();
    const auto* p = host.data_ptr<std::int64_t>();
    const std::vector<std::size_t> indices(p, p + host.numel());
    return detail::to_batch(dataset_->get_batch(c10::ArrayRef<std::size_t>(indices)));
  }
  D& dataset() const { return *dataset_; }

 private:
  std::shared_ptr<D> dataset_;  // get_batch is not const in LibTorch
};

/// The epoch order a LibTorch sampler gives: reset for `size` samples and
/// read to its end. A sampler that draws from LibTorch's default CPU
/// generator (RandomSampler) draws with it seeded by seed + epoch, and the
/// generator is put back as it was, so every rank draws the same order and
/// the training's own random stream is untouched. A sampler with its own
/// randomness must give the same order on every rank.
///
/// The sampler is asked for batches of `batch_size` (as LibTorch's own
/// DataLoader asks it); one that answers with another size before its last
/// batch is a batch sampler, whose batches would be re-cut here, so it is
/// refused with a sentence instead (0: any sizes, read as one order).
template <torch_sampler S>
EpochOrder epoch_order_of(S sampler, std::size_t size, std::uint64_t seed, std::size_t batch_size = 0) {
  auto shared = std::make_shared<S>(std::move(sampler));
  return [shared, size, seed, batch_size](std::int64_t epoch) {
    auto generator = at::detail::getDefaultCPUGenerator();
    // Not locked while the sampler draws: drawing takes the generator's own lock.
    auto with_lock = [&](auto&& fn) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      return fn();
    };
    const at::Tensor saved = with_lock([&] { return generator.get_state(); });
    with_lock([&] { generator.set_current_seed(seed + static_cast<std::uint64_t>(epoch)); });
    std::vector<std::int64_t> order;
    std::size_t short_batch = 0;  // the size of a batch smaller than batch_size, once one was seen
    try {
      shared->reset(size);
      while (auto batch = shared->next(batch_size > 0 ? batch_size : size)) {
        if (batch_size > 0 && (short_batch > 0 || batch->size() > batch_size))
          throw std::invalid_argument(
              "accel: the sampler gave a batch of " + std::to_string(short_batch > 0 ? short_batch : batch->size()) +
              " indices before its last one for batch_size " + std::to_string(batch_size) +
              ": batches of their own sizes (a batch sampler) are not supported yet; give batches of batch_size "
              "(the last may be smaller)");
        if (batch_size > 0 && batch->size() < batch_size) short_batch = batch->size();
        for (std::size_t i : *batch) order.push_back(static_cast<std::int64_t>(i));
      }
    } catch (...) {
      with_lock([&] { generator.set_state(saved); });
      throw;
    }
    with_lock([&] { generator.set_state(saved); });
    if (order.empty()) throw std::invalid_argument("accel: the sampler gave no indices for epoch " + std::to_string(epoch));
    for (std::int64_t i : order)
      if (i < 0 || static_cast<std::size_t>(i) >= size)
        throw std::out_of_range("accel: the sampler gave index " + std::to_string(i) + " for a dataset of " +
                                std::to_string(size) + " samples");
    return at::tensor(order, at::TensorOptions().dtype(at::kLong));
  };
}

}  // namespace accel::data
