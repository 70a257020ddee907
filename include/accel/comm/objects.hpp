#pragma once
// Accelerate's helpers for what is not one equal-shaped tensor per rank:
//   gather_object          every rank's object (anything nlohmann::json converts), in rank order
//   pad_across_processes   a tensor padded along one dimension to the longest rank's size,
//                          so that ranks with ragged batches can gather it

#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/collectives.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/core/json.hpp"

namespace accel::comm {

/// Every rank's `object`, in rank order, on every rank. `T` is anything
/// nlohmann::json converts both ways (numbers, strings, containers of them,
/// or a type with to_json/from_json). It travels as JSON text, one byte per
/// element of a ragged all-gather (Gloo gathers uint8 on both versions).
template <class T>
std::vector<T> gather_object(Communicator& comm, const T& object) {
  using Json = accel::detail::json_t<T>;
  static_assert(accel::detail::complete_json<Json>,
                "accel: gather_object converts through nlohmann::json: include <nlohmann/json.hpp> (under "
                "ACCEL_SEPARATE_COMPILATION accel's headers declare it only, see <accel/core/json.hpp>)");
  if (!comm.distributed()) return {object};
  const std::string text = Json(object).dump();
  at::Tensor mine = at::empty({static_cast<std::int64_t>(text.size())}, at::TensorOptions().dtype(at::kByte));
  if (!text.empty()) std::memcpy(mine.data_ptr<std::uint8_t>(), text.data(), text.size());
  std::vector<T> out;
  int rank = 0;
  for (const at::Tensor& part : all_gather_ragged(comm, mine, "gather_object")) {
    const at::Tensor host = part.contiguous();
    const std::string received(reinterpret_cast<const char*>(host.data_ptr<std::uint8_t>()), static_cast<std::size_t>(host.numel()));
    try {
      out.push_back(Json::parse(received).template get<T>());
    } catch (const typename Json::exception& e) {
      throw std::invalid_argument("accel: gather_object: rank " + std::to_string(rank) +
                                  "'s object does not convert to this rank's type: " + e.what());
    }
    ++rank;
  }
  return out;
}

/// Every rank's `mine`, whose first dimensions may differ (the rest must
/// agree), in rank order: gather_for_metrics over ragged batches.
inline std::vector<at::Tensor> all_gather_rows(Communicator& comm, const at::Tensor& mine, const std::string& what) {
  if (mine.dim() == 0) throw std::invalid_argument("accel: " + what + ": a 0-dimensional tensor has no rows");
  std::vector<std::int64_t> row_shape(mine.sizes().begin() + 1, mine.sizes().end());
  std::int64_t row_numel = 1;
  for (auto d : row_shape) row_numel *= d;
  std::vector<at::Tensor> parts = all_gather_ragged(comm, mine.contiguous().view({-1}), what);
  for (auto& part : parts) {
    std::vector<std::int64_t> shape{row_numel == 0 ? 0 : part.numel() / row_numel};
    shape.insert(shape.end(), row_shape.begin(), row_shape.end());
    part = part.view(shape);
  }
  return parts;
}

/// Debug mode (Accelerate's ACCELERATE_DEBUG_MODE): every rank's shape, so
/// that tensors differing in a dimension other than the padded one fail
/// here, naming each rank's shape, instead of in a later gather.
inline void check_other_dimensions_agree(Communicator& comm, const at::Tensor& tensor, std::int64_t dim) {
  constexpr std::int64_t most = 16;  // dimensions compared; LibTorch allows 64, nobody pads such tensors
  at::Tensor shape = at::full({most + 1}, -1, at::TensorOptions().dtype(at::kLong));
  shape[0] = tensor.dim();
  for (std::int64_t d = 0; d < std::min(tensor.dim(), most); ++d) shape[d + 1] = d == dim ? -2 : tensor.size(d);
  const auto shapes = comm.all_gather(shape, "pad_across_processes (debug mode: every rank's shape)");
  auto text = [&](const at::Tensor& s) {
    std::string out = "[";
    for (std::int64_t d = 0; d < std::min(s[0].item<std::int64_t>(), most); ++d) {
      const std::int64_t v = s[d + 1].item<std::int64_t>();
      out += (d ? ", " : "") + (v == -2 ? std::string("*") : std::to_string(v));
    }
    return out + "]";
  };
  for (std::size_t r = 1; r < shapes.size(); ++r)
    if (!shapes[r].equal(shapes[0])) {
      std::string each;
      for (std::size_t k = 0; k < shapes.size(); ++k) each += "\n  rank " + std::to_string(k) + ": " + text(shapes[k]);
      throw std::invalid_argument("accel: pad_across_processes (debug mode): the ranks' tensors differ in a "
                                  "dimension other than the padded one (" + std::to_string(dim) +
                                  ", shown as *), so they cannot be gathered:" + each);
    }
}

/// `tensor` padded with `pad_value` along `dim` to the largest size any rank
/// has there (at the end, or at the start with `pad_first`), so that the
/// ranks' tensors can be gathered. Every other dimension must agree.
inline at::Tensor pad_across_processes(Communicator& comm, const at::Tensor& tensor, std::int64_t dim = 0,
                                       double pad_value = 0, bool pad_first = false) {
  if (tensor.dim() == 0) return tensor;
  if (dim < 0) dim += tensor.dim();
  if (dim < 0 || dim >= tensor.dim())
    throw std::invalid_argument("accel: pad_across_processes: dimension " + std::to_string(dim) +
                                " is out of range for a tensor of " + std::to_string(tensor.dim()) + " dimensions");
  if (!comm.distributed()) return tensor;
  if (comm.debug()) check_other_dimensions_agree(comm, tensor, dim);
  at::Tensor size = at::full({1}, tensor.size(dim), at::TensorOptions().dtype(at::kLong));
  comm.all_reduce_max(size, "pad_across_processes (sizes)");
  const std::int64_t longest = size.item<std::int64_t>();
  if (longest == tensor.size(dim)) return tensor;
  // constant_pad_nd takes (before, after) pairs from the last dimension backwards.
  std::vector<std::int64_t> pads(2 * (tensor.dim() - dim), 0);
  pads[pads.size() - (pad_first ? 2 : 1)] = longest - tensor.size(dim);
  return at::constant_pad_nd(tensor, pads, pad_value);
}

}  // namespace accel::comm
