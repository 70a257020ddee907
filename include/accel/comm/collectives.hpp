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
// NCCL has both collectives natively and they are used there. Gloo (LibTorch
// 1.13) has neither, so they are built from what it has: reduce-scatter as a
// ring of send/recv, moving (n-1)/n of the tensor per rank (all-reduce then
// slice would move about twice that); flat all-gather from the list all-gather.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

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

/// Whether the ring sums `dtype` as it is. bf16 partial sums would be
/// rounded at every hop (and 1.13's Gloo refuses bf16 in its own
/// collectives), so bf16 travels and accumulates as fp32 instead.
inline bool ring_sums_natively(at::ScalarType dtype) { return dtype != at::kBFloat16; }

/// Whether the backend's native flat all-gather takes `dtype`: NCCL any;
/// Gloo (2.15 measured) refuses bool, int16 and uint8, so those travel as bytes
/// in the list form.
inline bool gathers_natively(const Communicator& comm, at::ScalarType dtype) {
  if (comm.backend_kind() == BackendKind::nccl) return true;
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16 ||
         dtype == at::kLong || dtype == at::kInt;
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

// Ring reduce-scatter from send/recv. At step k (0 <= k < n-1) rank r sends
// the partial sum of shard (r-k-1) mod n to rank r+1 and receives the partial
// sum of shard (r-k-2) mod n from rank r-1, adding its own contribution. Each
// shard thus travels once round the ring, collecting every rank's part, and
// after n-1 steps rank r holds the full sum of shard r. Rank r sends every
// shard but its own: N - size(r) elements, (n-1)/n of the tensor.
inline at::Tensor ring_reduce_scatter(Communicator& comm, const at::Tensor& input, const std::string& what) {
  const int n = comm.size(), r = comm.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  const std::int64_t total = input.numel();
  auto shard = [&](int index) { return shard_range(total, n, ((index % n) + n) % n); };
  auto piece = [&](int index) {  // this rank's contribution to shard `index` (size(index))
    const auto s = shard(index);
    return input.narrow(0, s.offset, s.size);
  };
  // Two receive buffers, alternating: the one received at step k is sent at
  // step k+1 while the other receives. The last step receives into a tensor
  // of exactly this rank's shard, which becomes the result.
  const std::int64_t longest = shard(0).size;
  at::Tensor buffers[2];
  if (n > 2) buffers[0] = at::empty({longest}, input.options()), buffers[1] = at::empty({longest}, input.options());
  at::Tensor outgoing = piece(r - 1);  // step 0 sends this rank's own data (size(r-1))
  for (int k = 0; k < n - 1; ++k) {
    const int in_index = r - k - 2;
    const std::int64_t in_size = shard(in_index).size;
    at::Tensor incoming =
        k == n - 2 ? at::empty({in_size}, input.options()) : buffers[k % 2].narrow(0, 0, in_size);  // (size(in_index))
    const std::string step = what + " (reduce-scatter ring step " + std::to_string(k + 1) + " of " +
                             std::to_string(n - 1) + ": ";
    // Empty shards (total < n) are skipped on both ends alike: sizes are known to all.
    Pending received, sent;
    if (in_size > 0)
      received = comm.recv_async(incoming, prev, k, step + "receive from rank " + std::to_string(prev) + ")");
    if (outgoing.numel() > 0)
      sent = comm.send_async(outgoing, next, k, step + "send to rank " + std::to_string(next) + ")");
    received.wait();
    sent.wait();
    incoming.add_(piece(in_index));
    outgoing = incoming;
  }
  return outgoing;  // (size(r)): after the last step, `incoming` of shard r
}

}  // namespace detail

/// This rank's shard (shard_range(N, world, rank).size elements) of the
/// element-wise sum over ranks of `input` (1-D, N elements, the same N on
/// every rank). Returns a new tensor of input's dtype; synchronous.
///
/// Gloo: a send/recv ring, (n-1)/n of the tensor sent per rank; partial sums
/// are added in a different order for each shard, so floating-point results
/// may differ from a plain sum in the last bits. bf16 travels and
/// accumulates as fp32 and is rounded once at the end (so it moves fp32's
/// bytes; 1.13's Gloo refuses bf16 in its own collectives anyway). NCCL: native _reduce_scatter_base (padded to equal shards when N is
/// not divisible by the world size). Each send/recv wait, and each native
/// collective, is bounded by the communicator's timeout; failures are
/// CollectiveErrors naming `what` and the rank.
inline at::Tensor reduce_scatter(Communicator& comm, const at::Tensor& input, const std::string& what) {
  detail::check_flat(input, "reduce_scatter", "input");
  if (!comm.distributed()) return input.clone();
  const int n = comm.size(), r = comm.rank();
  const std::int64_t total = input.numel();
  // On Gloo bf16 is summed in fp32 (one rounding), natively or in the ring.
  const bool widen = comm.backend_kind() == BackendKind::gloo && !detail::ring_sums_natively(input.scalar_type());
  at::Tensor work = widen ? input.to(at::kFloat).contiguous() : input.contiguous();  // (N)
  at::Tensor mine;
  if (comm.native_flat_collectives()) {
    // Native equal-split reduce-scatter.
    const bool even = total % n == 0;
    at::Tensor rows = even ? work : detail::pad_to_rows(work, n);  // (n * longest)
    at::Tensor out = at::empty({rows.numel() / n}, work.options());  // (longest)
    at::Tensor flat_rows = rows.reshape({rows.numel()});
    comm.reduce_scatter_base_async(out, flat_rows, what + " (reduce-scatter)").wait();
    mine = even ? out : out.narrow(0, 0, shard_range(total, n, r).size).clone();  // (size(r))
  } else {
    comm.begin_composite(Collective::reduce_scatter, work, what + " (reduce-scatter)");
    mine = detail::ring_reduce_scatter(comm, work, what);  // (size(r))
  }
  return widen ? mine.to(input.scalar_type()) : mine;
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
/// on every rank. Returns a new tensor of the shard's dtype; synchronous.
///
/// Gloo: the list all-gather, each shard zero-padded to the longest one and
/// the padding dropped afterwards; shards travel as raw bytes, so any dtype
/// (bf16 included) arrives bit-exact and at its own width. NCCL and Gloo from
/// LibTorch 2.11 (Communicator::native_flat_collectives): native
/// _allgather_base. Bounded by the communicator's timeout; failures are
/// CollectiveErrors naming `what` and the rank.
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
  // Every rank contributes `longest` elements: the native op needs equal
  // sizes, and so does Gloo's list form.
  at::Tensor padded = shard.contiguous();  // (longest)
  if (mine.size < longest) {
    padded = at::zeros({longest}, shard.options());
    padded.narrow(0, 0, mine.size).copy_(shard);
  }
  if (comm.native_flat_collectives() && detail::gathers_natively(comm, shard.scalar_type())) {
    at::Tensor rows = at::empty({n * longest}, shard.options());  // (n * longest)
    comm.all_gather_base_async(rows, padded, what + " (flat all-gather)").wait();
    return detail::unpad_rows(rows.view({n, longest}), total_numel, n);  // (total)
  }
  // Gathering only copies, so every dtype travels as its bytes: 1.13's Gloo
  // refuses bf16, bool, int16 and more in all-gather.
  at::Tensor wire = padded.view(at::kByte);  // (longest * element_size)
  std::vector<at::Tensor> pieces = comm.all_gather(wire, what + " (flat all-gather)");  // n x (longest * element_size)
  for (int q = 0; q < n; ++q)
    pieces[q] = pieces[q].view(shard.scalar_type()).narrow(0, 0, shard_range(total_numel, n, q).size);  // (size(q))
  return at::cat(pieces);  // (total)
}

}  // namespace accel::comm
