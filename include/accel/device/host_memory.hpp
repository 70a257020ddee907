#pragma once
// NOTE [Returning host memory]
// glibc's malloc serves a block from a mapping of its own (given back to the
// system when freed) only above a threshold, and it raises that threshold to
// the size of every such block freed, up to 32 MiB; from then on blocks of
// that size come from its heaps (one per thread that allocates: Gloo's
// workers have theirs), where freed memory stays resident. A strategy that
// frees and re-allocates bucket-sized host buffers every step (ZeRO-3's
// gathered units, the lazy gradient buckets, Gloo's receive buffers) then
// keeps far more resident than it has allocated: ZeRO-3 on 2 ranks held
// 1.2-1.7 GB resident for 0.42 GB allocated, more than DDP's 0.9 GB
// (bench/memory_peaks.sh, 38.8 M parameters). A fixed threshold of 1 MiB
// (which also stops the raising) makes every larger block a mapping of its
// own, so the resident set follows what is allocated (0.59 GB); the price is
// fresh pages, faulted in, for each such block: ZeRO-3's steps took 1.8x as
// long on the development VM, DDP's 2% longer. So it is a choice, not the
// default: TrainerOptions{.return_host_memory = true} on the CPU device. The
// default keeps large blocks in accel's own cache instead (NOTE [Host blocks
// kept for reuse] in host_block_cache.hpp), which gets the resident set down
// with no fresh pages per step. A
// threshold set in the environment (MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES)
// is left as it is.

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace accel::device {

/// Large freed host blocks go back to the system (NOTE above); once per
/// process, and never over a threshold the environment set. Returns whether
/// the threshold is accel's.
inline bool return_freed_host_memory() {
#if defined(__GLIBC__)
  static const bool applied = [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
        (tunables != nullptr && std::strstr(tunables, "mmap_threshold") != nullptr))
      return false;
    return mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1;
  }();
  return applied;
#else
  return false;
#endif
}

}  // namespace accel::device
