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
#include <ATen/ops/zeros.h>
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
    if (idx.numel() == 0) {
      // A short rank's empty batch (even_batches = false): sample 0's shapes with no rows, as LibTorch's
      // transforms (Stack<>) cannot stack nothing.
      Batch one = get(at::zeros({1}, at::TensorOptions().dtype(at::kLong)));
      return {one.data.narrow(0, 0, 0), one.target.defined() ? one.target.narrow(0, 0, 0) : at::Tensor()};
    }
    const at::Tensor host = idx.to(at::kLong).contiguous();
    const auto* p = host.data_ptr<std::int64_t>();
    const std::vector<std::size_t> indices(p, p + host.numel());
    return detail::to_batch(dataset_->get_batch(c10::ArrayRef<std::size_t>(indices)));
  }
  D& dataset() const { return *dataset_; }

 private:
  std::shared_ptr<D> dataset_;  // get_batch is not const in LibTorch
};

namespace detail {

// Epoch `epoch` of a LibTorch sampler: reset for `size` samples, asked for
// batches of `request` until it has none, each handed to `take`. A sampler
// that draws from LibTorch's default CPU generator (RandomSampler) draws with
// it seeded by seed + epoch, and the generator is put back as it was, so every
// rank draws the same order and the training's own random stream is untouched.
template <class S, class Take>
void read_sampler_epoch(S& sampler, std::size_t size, std::uint64_t seed, std::int64_t epoch, std::size_t request,
                        Take&& take) {
  auto generator = at::detail::getDefaultCPUGenerator();
  // Not locked while the sampler draws: drawing takes the generator's own lock.
  auto with_lock = [&](auto&& fn) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    return fn();
  };
  const at::Tensor saved = with_lock([&] { return generator.get_state(); });
  with_lock([&] { generator.set_current_seed(seed + static_cast<std::uint64_t>(epoch)); });
  try {
    sampler.reset(size);
    while (auto batch = sampler.next(request)) {
      for (std::size_t i : *batch)
        if (i >= size)
          throw std::out_of_range("accel: the sampler gave index " + std::to_string(i) + " for a dataset of " +
                                  std::to_string(size) + " samples");
      take(*batch);
    }
  } catch (...) {
    with_lock([&] { generator.set_state(saved); });
    throw;
  }
  with_lock([&] { generator.set_state(saved); });
}

inline at::Tensor index_tensor(const std::vector<std::size_t>& indices) {
  std::vector<std::int64_t> values(indices.begin(), indices.end());
  return at::tensor(values, at::TensorOptions().dtype(at::kLong));
}

}  // namespace detail

/// The epoch order a LibTorch sampler gives, read to its end
/// (detail::read_sampler_epoch: the same on every rank). A sampler with its
/// own randomness must give the same order on every rank.
///
/// The sampler is asked for batches of `batch_size` (as LibTorch's own
/// DataLoader asks it); one that answers with another size before its last
/// batch is a batch sampler, whose batches would be re-cut here, so it is
/// refused with a sentence naming data::batch_sampler (0: any sizes, read as one order).
template <torch_sampler S>
EpochOrder epoch_order_of(S sampler, std::size_t size, std::uint64_t seed, std::size_t batch_size = 0) {
  auto shared = std::make_shared<S>(std::move(sampler));
  return [shared, size, seed, batch_size](std::int64_t epoch) {
    std::vector<std::size_t> order;
    std::size_t short_batch = 0;  // the size of a batch smaller than batch_size, once one was seen
    detail::read_sampler_epoch(*shared, size, seed, epoch, batch_size > 0 ? batch_size : size,
                               [&](const std::vector<std::size_t>& batch) {
      if (batch_size > 0 && (short_batch > 0 || batch.size() > batch_size))
        throw std::invalid_argument(
            "accel: the sampler gave a batch of " + std::to_string(short_batch > 0 ? short_batch : batch.size()) +
            " indices before its last one for batch_size " + std::to_string(batch_size) +
            ": a batch sampler (batches of their own sizes) is prepared wrapped, "
            "trainer.prepare(dataset, options, accel::data::batch_sampler(sampler)), so that its batches stay whole");
      if (batch_size > 0 && batch.size() < batch_size) short_batch = batch.size();
      order.insert(order.end(), batch.begin(), batch.end());
    });
    if (order.empty()) throw std::invalid_argument("accel: the sampler gave no indices for epoch " + std::to_string(epoch));
    return detail::index_tensor(order);
  };
}

/// A LibTorch sampler whose batches keep their own sizes (what Python's
/// DataLoader(batch_sampler=...) takes): `trainer.prepare(dataset, options,
/// accel::data::batch_sampler(sampler))`.
template <torch_sampler S>
struct BatchSampler {
  S sampler;
};
template <torch_sampler S>
BatchSampler<S> batch_sampler(S sampler) {
  return {std::move(sampler)};
}

/// The epochs of a batch sampler, batch by batch (read as epoch_order_of
/// reads a sampler; empty batches are left out).
template <torch_sampler S>
EpochBatches epoch_batches_of(S sampler, std::size_t size, std::uint64_t seed, std::size_t batch_size) {
  auto shared = std::make_shared<S>(std::move(sampler));
  return [shared, size, seed, batch_size](std::int64_t epoch) {
    std::vector<at::Tensor> batches;
    detail::read_sampler_epoch(*shared, size, seed, epoch, batch_size, [&](const std::vector<std::size_t>& batch) {
      if (!batch.empty()) batches.push_back(detail::index_tensor(batch));
    });
    return batches;
  };
}

}  // namespace accel::data
