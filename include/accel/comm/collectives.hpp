#pragma once
// Sharded collectives for ZeRO/FSDP-style strategies: a flat 1-D tensor is
// split into `world` contiguous shards, one per rank.
//   reduce_scatter:   every rank's full tensor in -> this rank's shard of the sum out
//   all_gather_flat:  every rank's shard in       -> the full tensor out, on every rank
//
// Shard convention (shard_range): as even as possible, the first total % world
// shards one element longer, so shard sizes differ by at most one and some are
// empty when total < world. Ranks must agree on `total`; a mismatch is not
// detected and ends in a CollectiveError or the communicator's timeout.
//
// One implementation of each, used by these synchronous forms and by the
// ZeRO/FSDP engines' bucketed, asynchronous ones (strategy/buckets.hpp,
// zero.hpp, zero3.hpp), on a flat tensor of `world` equal rows:
// reduce_scatter_rows_async and all_gather_rows_async, which the backend's
// adapter builds from its own primitives (comm/gloo_adapter.hpp: an
// all-to-all among the other ranks and a local sum, broadcasts in place;
// comm/nccl_adapter.hpp: the native flat collectives).

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/communicator.hpp"

namespace accel::comm {

/// Where rank `rank`'s shard of a `total`-element flat tensor lies.
struct ShardRange {
  std::int64_t offset = 0;
  std::int64_t size = 0;
  bool operator==(const ShardRange&) const = default;
};

/// The shard of `rank` when `total` elements are split over `world` ranks:
/// the first `total % world` shards hold one element more than the rest.
constexpr ShardRange shard_range(std::int64_t total, int world, int rank) {
  if (total < 0 || world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("accel: shard_range needs total >= 0 and 0 <= rank < world");
  const std::int64_t base = total / world, longer = total % world;
  return {rank * base + std::min<std::int64_t>(rank, longer), base + (rank < longer ? 1 : 0)};
}

namespace detail {

inline void check_flat(const at::Tensor& t, const char* op, const char* name) {
  if (t.dim() != 1)
    throw std::invalid_argument(std::string("accel: ") + op + ": " + name + " must be 1-D, got " +
                                std::to_string(t.dim()) + " dimensions");
}

/// `input` (N) laid out as `world` rows of the longest shard (world * max),
/// zero-padded: the layout the native equal-split collectives require.
inline at::Tensor pad_to_rows(const at::Tensor& input, int world) {
  const std::int64_t total = input.numel(), longest = shard_range(total, world, 0).size;
  auto rows = at::zeros({world, longest}, input.options());  // (world, longest)
  for (int r = 0; r < world; ++r) {
    const auto s = shard_range(total, world, r);
    rows[r].narrow(0, 0, s.size).copy_(input.narrow(0, s.offset, s.size));
  }
  return rows;
}

/// The inverse of pad_to_rows: the first size(r) elements of each row, concatenated (N).
inline at::Tensor unpad_rows(const at::Tensor& rows, std::int64_t total, int world) {
  if (total % world == 0) return rows.reshape({total});  // no padding: rows are the flat tensor already
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < world; ++r) pieces.push_back(rows[r].narrow(0, 0, shard_range(total, world, r).size));
  return at::cat(pieces);
}

}  // namespace detail

/// Starts the reduce-scatter (sum) of `rows` (1-D, contiguous, size() equal
/// rows of `shard`'s length): once the result is waited on and
/// finish_reduce_scatter_rows has run, `shard` holds this rank's row of the
/// sum over ranks. `rows` is scratch on Gloo (this rank's row is copied to
/// `shard` and the others' move down over it) and `received` is filled there
/// with the other ranks' rows for this rank, (n-1) x shard; NCCL leaves both
/// alone. Counted (and in debug mode checked) as one reduce-scatter of
/// `counted`, the caller's whole input. One rank: a copy. `received` comes
/// from `scratch` where one is given (the engine's pool), else is allocated.
inline Pending reduce_scatter_rows_async(Communicator& comm, at::Tensor& shard, at::Tensor& rows,
                                         at::Tensor& received, const at::Tensor& counted, std::string what,
                                         device::BufferPool* scratch = nullptr) {
  if (!comm.distributed()) {
    shard.copy_(rows);
    return {};
  }
  return comm.adapter().reduce_scatter_rows_async(comm, shard, rows, received, counted, std::move(what), scratch);
}

/// Completes reduce_scatter_rows_async after its wait: adds the other ranks'
/// rows (Gloo) into `shard` and drops them.
inline void finish_reduce_scatter_rows(const Communicator& comm, at::Tensor& shard, at::Tensor& received) {
  if (!received.defined()) return;
  c10::NoGradGuard no_grad;
  // (n-1, shard): row k is the next other rank's contribution to this rank's shard
  for (const auto& row : received.view({comm.size() - 1, -1}).unbind(0)) shard.add_(row);
  received = at::Tensor();
}

/// Starts the all-gather of `rows` (1-D, contiguous, size() equal rows) in
/// place: this rank's row already holds its data; once every returned
/// Pending is waited on, row j holds rank j's. Nothing is staged beside
/// `rows`; any dtype. One rank: nothing to do.
inline std::vector<Pending> all_gather_rows_async(Communicator& comm, at::Tensor& rows, const std::string& what) {
  if (!comm.distributed()) return {};
  return comm.adapter().all_gather_rows_async(comm, rows, what);
}

/// This rank's shard (shard_range(N, world, rank).size elements) of the
/// element-wise sum over ranks of `input` (1-D, N elements, the same N on
/// every rank). Returns a new tensor of input's dtype; synchronous; `input`
/// is left as it was.
///
/// reduce_scatter_rows_async on `input` padded to equal rows. On Gloo each
/// rank adds the others' rows to its own in rank order, so floating-point
/// results may differ from a plain sum in the last bits; bf16 travels and
/// accumulates as fp32 and is rounded once at the end (so it moves fp32's
/// bytes; 1.13's Gloo refuses bf16 in its own collectives anyway). Bounded
/// by the communicator's timeout; failures are CollectiveErrors naming
/// `what` and the rank.
inline at::Tensor reduce_scatter(Communicator& comm, const at::Tensor& input, const std::string& what) {
  detail::check_flat(input, "reduce_scatter", "input");
  if (!comm.distributed()) return input.clone();
  const int n = comm.size(), r = comm.rank();
  const std::int64_t total = input.numel(), longest = shard_range(total, n, 0).size;
  const BackendAdapter& backend = comm.adapter();
  const auto reduced_as = backend.route(Carried::reduced, input).dtype;  // Gloo: bf16 summed in fp32, rounded once
  at::Tensor work = reduced_as ? input.to(*reduced_as).contiguous() : input.contiguous();  // (N)
  at::Tensor rows;  // (n * longest): Gloo writes over it, so never the caller's input
  if (total % n != 0) rows = detail::pad_to_rows(work, n).reshape({n * longest});
  else rows = backend.overwrites_rows() && work.is_same(input) ? work.clone() : work;
  at::Tensor out = at::empty({longest}, work.options()), received;  // (longest)
  reduce_scatter_rows_async(comm, out, rows, received, work, what + " (reduce-scatter)").wait();
  finish_reduce_scatter_rows(comm, out, received);
  at::Tensor mine = total % n == 0 ? out : out.narrow(0, 0, shard_range(total, n, r).size).clone();  // (size(r))
  return reduced_as ? mine.to(input.scalar_type()) : mine;
}

/// Every rank's 1-D `mine`, in rank order, where the lengths may differ (the
/// dtype may not): the lengths are gathered first, then the tensors padded
/// to the longest. Small things (an error text, a list of sizes).
inline std::vector<at::Tensor> all_gather_ragged(Communicator& comm, const at::Tensor& mine, const std::string& what) {
  detail::check_flat(mine, "all_gather_ragged", "mine");
  if (!comm.distributed()) return {mine};
  const at::Tensor length = at::full({1}, mine.numel(), at::TensorOptions().dtype(at::kLong));
  std::vector<std::int64_t> lengths;
  for (const auto& l : comm.all_gather(length, what + " (lengths)")) lengths.push_back(l.item<std::int64_t>());
  const std::int64_t longest = std::max<std::int64_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  at::Tensor padded = at::zeros({longest}, mine.options());  // (longest)
  padded.narrow(0, 0, mine.numel()).copy_(mine);
  std::vector<at::Tensor> parts = comm.all_gather(padded, what);
  for (std::size_t r = 0; r < parts.size(); ++r) parts[r] = parts[r].narrow(0, 0, lengths[r]);
  return parts;
}

/// The full flat tensor (`total_numel` elements, in rank order) from every
/// rank's `shard` (1-D, shard_range(total_numel, world, rank).size elements),
/// on every rank. Returns a new tensor of the shard's dtype (any, bit-exact);
/// synchronous. all_gather_rows_async into rows padded to the longest shard,
/// the padding dropped afterwards. Bounded by the communicator's timeout;
/// failures are CollectiveErrors naming `what` and the rank.
inline at::Tensor all_gather_flat(Communicator& comm, const at::Tensor& shard, std::int64_t total_numel,
                                  const std::string& what) {
  detail::check_flat(shard, "all_gather_flat", "shard");
  const int n = comm.size(), r = comm.rank();
  const auto mine = shard_range(total_numel, n, r);
  if (shard.numel() != mine.size)
    throw std::invalid_argument("accel: all_gather_flat (" + what + "): rank " + std::to_string(r) + " holds " +
                                std::to_string(shard.numel()) + " elements, but its shard of " +
                                std::to_string(total_numel) + " over " + std::to_string(n) + " ranks has " +
                                std::to_string(mine.size));
  if (!comm.distributed()) return shard.clone();
  const std::int64_t longest = shard_range(total_numel, n, 0).size;
  if (longest == 0) return at::empty({0}, shard.options());  // nothing anywhere (total 0)
  at::Tensor rows = at::zeros({n * longest}, shard.options());  // (n * longest)
  rows.narrow(0, r * longest, mine.size).copy_(shard);
  for (auto& pending : all_gather_rows_async(comm, rows, what + " (flat all-gather)")) pending.wait();
  return detail::unpad_rows(rows.view({n, longest}), total_numel, n);  // (total)
}

}  // namespace accel::comm
