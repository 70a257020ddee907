#pragma once
// A collective in flight, and the errors a collective ends in. Every blocking
// wait goes through `Pending::wait`, so a failed or timed-out collective
// becomes a CollectiveError naming the operation, the rank and, where the
// liveness watch knows, the rank that is gone.

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "accel/comm/flight_recorder.hpp"
#include "accel/comm/liveness.hpp"
#include "accel/comm/traffic.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/profiling/range.hpp"

namespace accel::comm {

/// A collective failed: a peer died, timed out, or the backend refused it.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// In debug mode: the ranks of a group were about to call different
/// collectives, or the same one with different shapes (NOTE [Debug mode]).
class CollectiveMismatch : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

/// One in-flight collective; `wait()` turns a backend failure into a message
/// that says which rank waited for what (the group's n-th collective), and
/// which ranks are gone (NOTE [Naming the dead rank]).
class Pending {
 public:
  /// What a failure message says about the collective.
  struct Context {
    std::string what;
    int rank = 0;                 ///< in the world
    std::uint64_t sequence = 0;   ///< the how-manyth collective of its group
    bool point_to_point = false;  ///< a send or receive, issued after collective #sequence
    std::shared_ptr<Liveness> liveness{};
    std::uint64_t record = 0;  ///< its entry in the flight recorder (NOTE [Flight recorder])
    std::chrono::milliseconds timeout{0};  ///< the communicator's collective timeout
  };

  Pending() = default;
  /// `timeout` for work whose options carry none (send/recv): `wait` bounds
  /// itself by it instead of the backend's default (0: the backend's own bound).
  Pending(c10::intrusive_ptr<compat::Work> work, Context context,
          std::chrono::milliseconds timeout = std::chrono::milliseconds(0))
      : work_(std::move(work)), context_(std::move(context)), timeout_(timeout) {}

  bool valid() const { return static_cast<bool>(work_); }

  void wait();

 private:
  c10::intrusive_ptr<compat::Work> work_;
  Context context_;
  std::chrono::milliseconds timeout_{0};  // 0 is c10d's kNoTimeout
};

}  // namespace accel::comm

#if ACCEL_DEFINE_COMPILED_ONCE
namespace accel::comm {
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE void Pending::wait() {
  if (!work_) return;
  const profiling::Range range("accel::wait", context_.what);  // time blocked, named, in a profiler trace
  auto work = std::move(work_);
  const auto start = std::chrono::steady_clock::now();
  try {
    work->wait(timeout_);
    record_blocked(std::chrono::steady_clock::now() - start);
    FlightRecorder::instance().finish(context_.record, true);
  } catch (const std::exception& e) {
    record_blocked(std::chrono::steady_clock::now() - start);
    FlightRecorder::instance().finish(context_.record, false);
    FlightRecorder::instance().dump(context_.rank);
    if (context_.liveness) context_.liveness->mark_failed();
    const bool at_once = context_.timeout.count() > 0 && std::chrono::steady_clock::now() - start < context_.timeout / 2;
    const std::string gone = context_.liveness ? context_.liveness->diagnose(at_once) : "";
    throw CollectiveError("accel: rank " + std::to_string(context_.rank) + ": " + context_.what + " (" +
                          (context_.point_to_point ? "after " : "") + "collective #" +
                          std::to_string(context_.sequence) + " of its group) failed: " +
                          (gone.empty() ? "a peer died, or it ran past the collective timeout" : gone) + ": " +
                          e.what());
  }
}

}  // namespace accel::comm
#endif
