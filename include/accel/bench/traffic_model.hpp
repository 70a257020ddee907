#pragma once
// The bytes each strategy's formula says one optimizer step moves, per kind
// of collective, in comm/traffic.hpp's units (nccl-tests' sizes). Benchmarks
// print them beside the counted bytes; a difference is a finding. Torch-free.
//
//   DDP          all-reduce      P            (P: trainable elements x bytes; a comm_hook halves it)
//   ZeRO-1       all-reduce      P'           (P': the buckets padded to the shard count)
//                all-gather      P'           (the updated shards, after the step)
//   ZeRO-2       reduce-scatter  P'
//                all-gather      P'
//   ZeRO-3       all-gather      2 P'         (before the forward, again before the backward)
//                reduce-scatter  P'
//   HybridShard  ZeRO-3's within a shard group, plus an all-reduce of P'/shards
//                across the replicas (when there is more than one)
//   FP16         one more 4-byte all-reduce: the overflow flag
// Parallel<> moves activations too, which depend on the model's shapes: it
// has no formula here.

#include <array>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "accel/comm/traffic.hpp"
#include "accel/core/policies.hpp"

namespace accel::bench {

/// Bytes per kind of collective for one optimizer step.
using TrafficBytes = std::array<std::uint64_t, comm::collective_kinds>;

/// What the formulas need to know of a prepared model.
struct TrafficInputs {
  int world = 1;
  std::int64_t trainable_numel = 0;           ///< elements of the parameters that get gradients
  std::int64_t element_size = 4;              ///< bytes per element of the gradients (fp32 master weights)
  int shard_count = 1;                        ///< sharded strategies: ranks a bucket is cut over
  std::vector<std::int64_t> bucket_numels{};  ///< sharded strategies: elements per bucket, unpadded
};

namespace detail {
inline std::uint64_t padded_bytes(const TrafficInputs& in) {
  std::uint64_t elements = 0;
  const std::int64_t n = in.shard_count;
  for (auto numel : in.bucket_numels) elements += static_cast<std::uint64_t>((numel + n - 1) / n * n);
  return elements * static_cast<std::uint64_t>(in.element_size);
}
inline void add(TrafficBytes& bytes, comm::Collective kind, std::uint64_t n) { bytes[static_cast<std::size_t>(kind)] += n; }
}  // namespace detail

/// The formula's bytes for one optimizer step of `Strategy` under
/// `Precision`; none where the strategy has no formula (Parallel<>).
template <class Strategy, class Precision>
std::optional<TrafficBytes> predicted_traffic(const Strategy& strategy, const TrafficInputs& in) {
  using comm::Collective;
  TrafficBytes bytes{};
  if (in.world <= 1) return bytes;
  const auto full = static_cast<std::uint64_t>(in.trainable_numel * in.element_size);
  if constexpr (std::is_same_v<Strategy, SingleProcess>) {
    return bytes;
  } else if constexpr (std::is_same_v<Strategy, DDP>) {
    detail::add(bytes, Collective::all_reduce, strategy.comm_hook != CommHook::none ? full / 2 : full);
  } else if constexpr (std::is_same_v<Strategy, ZeRO<1>>) {
    detail::add(bytes, Collective::all_reduce, detail::padded_bytes(in));
    detail::add(bytes, Collective::all_gather, detail::padded_bytes(in));
  } else if constexpr (std::is_same_v<Strategy, ZeRO<2>>) {
    detail::add(bytes, Collective::reduce_scatter, detail::padded_bytes(in));
    detail::add(bytes, Collective::all_gather, detail::padded_bytes(in));
  } else if constexpr (std::is_same_v<Strategy, ZeRO<3>> || std::is_same_v<Strategy, HybridShard>) {
    if (in.shard_count > 1) {
      detail::add(bytes, Collective::all_gather, 2 * detail::padded_bytes(in));
      detail::add(bytes, Collective::reduce_scatter, detail::padded_bytes(in));
    }
    if (in.world > in.shard_count) detail::add(bytes, Collective::all_reduce, detail::padded_bytes(in) / in.shard_count);
  } else {
    return std::nullopt;
  }
  if constexpr (std::is_same_v<Precision, FP16>) detail::add(bytes, Collective::all_reduce, 4);
  return bytes;
}

}  // namespace accel::bench
