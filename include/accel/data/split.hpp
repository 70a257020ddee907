#pragma once
// Accelerate's split_between_processes: each rank's contiguous share of an
// input every rank holds whole (prompts for distributed inference, a list of
// files), the first `length % ranks` ranks one item longer:
//   length 5 on 2 ranks: rank 0 [0, 3), rank 1 [3, 5)
// With apply_padding every share is as long as the longest, padded with the
// input's last item (what Accelerate repeats), so results can be gathered.
// Pure functions of (rank, ranks): no communication.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "accel/data/dataset.hpp"

namespace accel::data {

/// Rank `rank`'s share [begin, end) of `length` items, and the longest share.
struct Share {
  std::int64_t begin = 0, end = 0, longest = 0;
};

inline Share share_of(std::int64_t length, int rank, int ranks) {
  const std::int64_t per = length / ranks, extras = length % ranks;
  Share s;
  s.begin = rank * per + std::min<std::int64_t>(rank, extras);
  s.end = s.begin + per + (rank < extras ? 1 : 0);
  s.longest = per + (extras > 0 ? 1 : 0);
  return s;
}

template <class T, class A>
std::vector<T, A> split_between_processes(const std::vector<T, A>& inputs, int rank, int ranks,
                                          bool apply_padding = false) {
  if (ranks == 1) return inputs;
  const Share s = share_of(static_cast<std::int64_t>(inputs.size()), rank, ranks);
  std::vector<T, A> out(inputs.begin() + s.begin, inputs.begin() + s.end);
  if (apply_padding)
    while (static_cast<std::int64_t>(out.size()) < s.longest) out.push_back(inputs.back());
  return out;
}

/// Along dimension 0; padded rows are copies of the input's last row.
inline at::Tensor split_between_processes(const at::Tensor& inputs, int rank, int ranks, bool apply_padding = false) {
  if (ranks == 1 || inputs.dim() == 0) return inputs;
  const Share s = share_of(inputs.size(0), rank, ranks);
  at::Tensor out = inputs.slice(0, s.begin, s.end);
  if (apply_padding && out.size(0) < s.longest) {
    const at::Tensor last = inputs.slice(0, inputs.size(0) - 1, inputs.size(0));
    std::vector<at::Tensor> parts{out};
    for (std::int64_t i = out.size(0); i < s.longest; ++i) parts.push_back(last);
    out = at::cat(parts, 0);
  }
  return out;
}

/// Every value split alike; the values must have one length.
template <class K, class V, class C, class A>
std::map<K, V, C, A> split_between_processes(const std::map<K, V, C, A>& inputs, int rank, int ranks,
                                             bool apply_padding = false) {
  if (ranks == 1 || inputs.empty()) return inputs;
  auto length = [](const V& v) -> std::int64_t {
    if constexpr (std::is_same_v<V, at::Tensor>) return v.dim() == 0 ? 1 : v.size(0);
    else return static_cast<std::int64_t>(v.size());
  };
  const std::int64_t first = length(inputs.begin()->second);
  for (const auto& [key, value] : inputs)
    if (length(value) != first)
      throw std::invalid_argument("accel: split_between_processes: every value of the map must have the same "
                                  "length (the first has " + std::to_string(first) + ", another " +
                                  std::to_string(length(value)) + ")");
  std::map<K, V, C, A> out;
  for (const auto& [key, value] : inputs) out.emplace(key, split_between_processes(value, rank, ranks, apply_padding));
  return out;
}

/// A dataset's share, as a view of it (Accelerate's datasets.Dataset case:
/// padding repeats the last sample).
template <batched_dataset D>
class Subset {
 public:
  Subset(D dataset, std::vector<std::int64_t> indices) : dataset_(std::move(dataset)), indices_(std::move(indices)) {}
  std::int64_t size() const { return static_cast<std::int64_t>(indices_.size()); }
  Batch get(const at::Tensor& idx) const {
    const at::Tensor host = idx.to(at::kLong).contiguous();
    std::vector<std::int64_t> mapped;
    for (std::int64_t i = 0; i < host.numel(); ++i) mapped.push_back(indices_.at(host.data_ptr<std::int64_t>()[i]));
    return dataset_.get(at::tensor(mapped, at::TensorOptions().dtype(at::kLong)));
  }
  const std::vector<std::int64_t>& indices() const { return indices_; }

 private:
  D dataset_;
  std::vector<std::int64_t> indices_;
};

template <batched_dataset D>
Subset<D> split_between_processes(D dataset, int rank, int ranks, bool apply_padding = false) {
  const std::int64_t length = dataset.size();
  const Share s = ranks == 1 ? Share{0, length, length} : share_of(length, rank, ranks);
  std::vector<std::int64_t> indices;
  for (std::int64_t i = std::min(s.begin, length); i < std::min(s.end, length); ++i) indices.push_back(i);
  if (apply_padding && length > 0)
    while (static_cast<std::int64_t>(indices.size()) < s.longest) indices.push_back(length - 1);
  return Subset<D>(std::move(dataset), std::move(indices));
}

}  // namespace accel::data
