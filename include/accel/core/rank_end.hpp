#pragma once
// What must run before a rank's process ends even when it ends by _exit(),
// which runs no destructors: accel::spawn's ranks end that way, so that the
// parent's atexit handlers (a test runner's) do not run in them. The
// rendezvous registers its exit handshake here (NOTE [Leaving the job] in
// comm/liveness.hpp) and spawn runs it. Torch-free, one function pointer: a
// process has one job connection registry.

namespace accel::detail {

/// `ok`: the rank's function returned (false: it threw).
using RankEndHook = void (*)(bool ok) noexcept;

inline RankEndHook& rank_end_hook() noexcept {
  static RankEndHook hook = nullptr;
  return hook;
}

/// Runs what the process registered (nothing when it never joined a job).
inline void run_rank_end_hook(bool ok) noexcept {
  if (RankEndHook hook = rank_end_hook()) hook(ok);
}

}  // namespace accel::detail
