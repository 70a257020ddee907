#pragma once
// What a process has put through its communicators, counted where each
// collective is issued (comm/communicator.hpp), so benchmarks report exact
// byte counts per kind of collective instead of estimates. Torch-free.
//
// Bytes follow nccl-tests' "size": the whole buffer the collective works on,
// the same on every rank whatever the algorithm underneath.
//   all_reduce, broadcast:  the tensor
//   reduce_scatter:         the full input (world x this rank's shard)
//   all_gather:             the full output (world x this rank's input)
//   all_to_all:             the input
//   send / recv:            the message
// Gloo's reduce-scatter built from an all-to-all, and its in-place
// all-gather built from broadcasts, are counted as the collective they are;
// barriers count as calls with no bytes.

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace accel::comm {

enum class Collective : std::size_t { all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, send, recv, barrier };
inline constexpr std::size_t collective_kinds = 8;

constexpr std::string_view collective_name(Collective c) {
  constexpr std::array<std::string_view, collective_kinds> names{
      "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send", "recv", "barrier"};
  return names[static_cast<std::size_t>(c)];
}

/// Counts of collectives, bytes and time blocked waiting on them. Values
/// subtract, so a measurement is `after - before`.
struct Traffic {
  std::array<std::uint64_t, collective_kinds> bytes{};
  std::array<std::uint64_t, collective_kinds> calls{};
  /// Time spent blocked in waits on collectives (Pending::wait), which is
  /// where communication that did not overlap compute costs a rank time.
  std::chrono::nanoseconds blocked{0};

  std::uint64_t bytes_of(Collective c) const { return bytes[static_cast<std::size_t>(c)]; }
  std::uint64_t calls_of(Collective c) const { return calls[static_cast<std::size_t>(c)]; }
  std::uint64_t total_bytes() const {
    std::uint64_t sum = 0;
    for (auto b : bytes) sum += b;
    return sum;
  }
  friend Traffic operator-(Traffic a, const Traffic& b) {
    for (std::size_t k = 0; k < collective_kinds; ++k) a.bytes[k] -= b.bytes[k], a.calls[k] -= b.calls[k];
    a.blocked -= b.blocked;
    return a;
  }
  bool operator==(const Traffic&) const = default;
};

namespace detail {
// Atomic: ZeRO-3's hooks and CUDA's autograd threads issue collectives off
// the main thread.
struct TrafficCounters {
  std::array<std::atomic<std::uint64_t>, collective_kinds> bytes{};
  std::array<std::atomic<std::uint64_t>, collective_kinds> calls{};
  std::atomic<std::int64_t> blocked_ns{0};
};
inline TrafficCounters& process_counters() {
  static TrafficCounters counters;
  return counters;
}
}  // namespace detail

/// Everything every communicator of this process has issued so far.
inline Traffic process_traffic() {
  auto& c = detail::process_counters();
  Traffic t;
  for (std::size_t k = 0; k < collective_kinds; ++k)
    t.bytes[k] = c.bytes[k].load(std::memory_order_relaxed), t.calls[k] = c.calls[k].load(std::memory_order_relaxed);
  t.blocked = std::chrono::nanoseconds(c.blocked_ns.load(std::memory_order_relaxed));
  return t;
}

inline void record_collective(Collective c, std::uint64_t bytes) {
  auto& counters = detail::process_counters();
  counters.bytes[static_cast<std::size_t>(c)].fetch_add(bytes, std::memory_order_relaxed);
  counters.calls[static_cast<std::size_t>(c)].fetch_add(1, std::memory_order_relaxed);
}

inline void record_blocked(std::chrono::nanoseconds waited) {
  detail::process_counters().blocked_ns.fetch_add(waited.count(), std::memory_order_relaxed);
}

}  // namespace accel::comm
