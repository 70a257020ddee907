#pragma once
// Accelerate's find_executable_batch_size: run a step at a batch size, and
// on running out of memory retry at a smaller one (0.9 of it, Accelerate's
// rule), until one fits. Unlike Accelerate's, every rank retries together:
// after each attempt the ranks agree (one all-reduce of a flag) whether any
// of them ran out, so they all move to the same next size and none trains
// on with a batch the others gave up.
//
// A rank that runs out of memory inside a collective's partner operation
// (after another rank has entered one) cannot be rescued this way: the
// others wait in that collective until its timeout, which then ends the job
// with a CollectiveError. Out of memory before the first collective of the
// attempt (the forward pass, typically) is what this catches.

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "accel/comm/communicator.hpp"

namespace accel::device {

/// Whether `error` says the device (or the host allocator) ran out of
/// memory: c10::OutOfMemoryError, std::bad_alloc, or the messages Accelerate
/// also recognises (CUDA's " out of memory", the CPU allocator's, cuDNN's
/// workspace failure).
inline bool is_out_of_memory(const std::exception& error) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&error) || dynamic_cast<const std::bad_alloc*>(&error)) return true;
  const std::string what = error.what();
  for (const char* sign : {" out of memory", "DefaultCPUAllocator: can't allocate memory",
                           "DefaultCPUAllocator: not enough memory", "CUDNN_STATUS_NOT_SUPPORTED"})
    if (what.find(sign) != std::string::npos) return true;
  return false;
}

/// Accelerate's default: 90% of the failed size.
inline std::int64_t reduce_batch_size(std::int64_t batch_size) { return static_cast<std::int64_t>(batch_size * 0.9); }

/// Calls `attempt(batch_size)` from `starting_batch_size` down until no rank
/// runs out of memory, and returns its result. Every rank of `comm` must
/// call it. `release` runs after a failed attempt (free cached device
/// memory); `reduce` gives the next size. Throws when the size reaches 0.
template <class Attempt>
auto find_executable_batch_size(comm::Communicator& comm, std::int64_t starting_batch_size, Attempt&& attempt,
                                const std::function<void()>& release = {},
                                const std::function<std::int64_t(std::int64_t)>& reduce = reduce_batch_size) {
  using Result = std::invoke_result_t<Attempt&, std::int64_t>;
  std::int64_t batch_size = starting_batch_size;
  while (true) {
    if (batch_size <= 0)
      throw std::runtime_error("accel: find_executable_batch_size: no executable batch size found, reached zero "
                               "(starting from " + std::to_string(starting_batch_size) + ")");
    // One path for both kinds of attempt: a void one yields an empty tag.
    struct Ran {};
    auto call = [&]() {
      if constexpr (std::is_void_v<Result>) {
        attempt(batch_size);
        return Ran{};
      } else {
        return attempt(batch_size);
      }
    };
    std::optional<decltype(call())> result;
    try {
      result.emplace(call());
    } catch (const std::exception& e) {
      if (!is_out_of_memory(e)) throw;
    }
    // Whether any rank ran out: every rank takes the same branch.
    at::Tensor ran_out = at::full({1}, result ? 0.0f : 1.0f);
    comm.all_reduce_max(ran_out, "find_executable_batch_size (batch size " + std::to_string(batch_size) + ")");
    if (ran_out.item<float>() == 0) {
      if constexpr (std::is_void_v<Result>) return;
      else return std::move(*result);
    }
    if (release) release();
    const std::int64_t next = reduce(batch_size);
    if (next >= batch_size)
      throw std::invalid_argument("accel: find_executable_batch_size: the reduce function must return a smaller "
                                  "size than " + std::to_string(batch_size) + ", got " + std::to_string(next));
    batch_size = next;
  }
}

}  // namespace accel::device
