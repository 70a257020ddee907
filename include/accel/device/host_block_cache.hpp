#pragma once
// NOTE [Host blocks kept for reuse]
// A training step allocates and frees the same large host blocks every step:
// gradients, the optimizer's temporaries, buckets, a ZeRO-3 unit's gradients.
// glibc's malloc keeps such blocks in its heaps once it has raised its mmap
// threshold past their size (NOTE [Returning host memory]), where they
// fragment: by default a rank's resident set was 20-60% above what LibTorch
// had allocated at its peak, and ZeRO-3's above ZeRO-2's although it
// allocates less (bench/memory_peaks.sh). Giving every large block back
// (return_host_memory) makes the resident set follow the allocations, but
// each step then faults in fresh pages. CUDA's caching allocator has the
// answer for device memory; this is its host counterpart, as small as the
// problem: blocks of 128 KiB or more come from mappings of its own, kept when
// their tensor frees them. A request takes the smallest idle range that
// holds it (split: the rest stays idle), and a freed range joins its idle
// neighbours, so a step's buckets, and later its optimizer's temporaries of
// other sizes, share the same pages. A step repeats its requests, so from
// the third one on (the trainer gives back what the first left idle, NOTE
// [Host blocks after the first step], and the second maps what it needs)
// a step takes no fresh pages and calls no allocator, and
// the resident set is what was in use at the peak plus what the cache keeps
// idle. Blocks in use and idle together stay within twice the most ever in
// use at once (idle ranges over that are unmapped, largest first, before a
// new mapping), so shapes that keep changing cannot grow it without bound;
// smaller blocks stay with malloc.
// Measured (bench/memory_peaks.sh, 2 and 3 ranks, 38.8 M parameters): the worst
// rank's resident set falls with the stage (DDP > ZeRO-1 > ZeRO-2 > ZeRO-3),
// at most 8% above its formula plus the bare process (ZeRO-2's counting its two
// gradient buckets in flight; with the NOTE below, README "Memory"); steps are 1.03-1.06x as fast as with glibc's
// heaps (bench/ddp_throughput.cpp --cache_host_memory 0|1). The cache itself
// held at most 13-66 MiB more than was ever allocated (Stats::most_held),
// ZeRO-2 the most; how much varies by rank and run (ZeRO-2 with plain SGD,
// which keeps no state: 16 and 63 MiB on the two ranks of one run).
// The Trainer installs it on the CPU device (TrainerOptions::cache_host_memory,
// default on) under LibTorch's own CPU allocator only: an allocator the
// program installed is left alone. It is process-wide, and gives its idle
// blocks back when the last trainer that uses it is destroyed; from then on
// every request goes to LibTorch's allocator until a trainer uses it again
// (it stays installed: another allocator may have been installed over it).
// LibTorch's profiler does not see its blocks.

// NOTE [Host blocks after the first step]
// Prepare and an optimizer's first step allocate what no later step does:
// a ZeRO-3 model built whole and then sharded, or computed shard by shard
// on the meta device; the optimizer's state, created by its first step. The
// ranges they free, split and joined around blocks that stay, are the wrong
// sizes for the steps that follow, which map blocks beside them: ZeRO-3 on
// meta left 83 MiB idle after the first step on 2 ranks, where a step needs
// 22 MiB beyond what stays in use. So once an optimizer has taken its first
// step, the trainer gives every idle range back (release_idle): the second
// step maps what it needs, once, and later steps reuse it.
// bench/memory_peaks.sh, worst rank's resident MiB, before and after:
// ZeRO-3 on meta 613 -> 568 (2 ranks), 509 -> 477 (3 ranks); ZeRO-3 576 -> 560, 485 -> 477.

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>

#include "accel/compat/torch_compat.hpp"
#include "accel/device/allocation_counter.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define ACCEL_HOST_BLOCK_CACHE 1
#else
#define ACCEL_HOST_BLOCK_CACHE 0
#endif

namespace accel::device {

class HostBlockCache final : public compat::HostAllocatorBase {
 public:
  /// Blocks below this stay with malloc.
  static constexpr std::size_t kSmallestBlock = std::size_t{128} << 10;

  struct Stats {
    std::int64_t in_use = 0;       // bytes of blocks tensors hold
    std::int64_t idle = 0;         // bytes of blocks kept for the next request
    std::int64_t most_in_use = 0;  // the most in use at once (in_use + idle stay within twice it)
    std::int64_t most_held = 0;    // the most held at once, in use and idle: the cache's share of the resident set
    std::int64_t mapped = 0;       // blocks mapped so far
    std::int64_t unmapped = 0;     // blocks given back (over the bound, or released)
    int users = 0;                 // acquire() calls not yet released
  };

  /// The process's cache, installed under LibTorch's CPU allocator (and under
  /// a HostAllocationCounter if one is installed) on the first call; null
  /// where LibTorch's own allocator has been replaced by the program, or
  /// where the platform has no mmap. Each call is one user: release() gives
  /// the idle blocks back once the last user has called it.
  static HostBlockCache* acquire() {
#if ACCEL_HOST_BLOCK_CACHE
    auto& self = instance();
    std::lock_guard lock(self.mutex_);
    if (!self.installed_) {
      c10::Allocator* below = HostAllocationCounter::insert_below_installed(&self);
      if (below == nullptr) {
        below = c10::GetCPUAllocator();
        if (below != c10::GetDefaultCPUAllocator()) return nullptr;
        c10::SetCPUAllocator(&self, kPriority);
      } else if (below != c10::GetDefaultCPUAllocator()) {
        HostAllocationCounter::insert_below_installed(below);  // undo: not LibTorch's own allocator
        return nullptr;
      }
      self.below_ = below;
      self.installed_ = true;
    }
    ++self.users_;
    return &self;
#else
    return nullptr;
#endif
  }

  /// The cache if some user installed it, else null (no user added).
  static const HostBlockCache* installed() {
    auto& self = instance();
    std::lock_guard lock(self.mutex_);
    return self.installed_ ? &self : nullptr;
  }

  /// One user less; the last one's call gives every idle block back.
  void release() {
    std::lock_guard lock(mutex_);
    if (users_ > 0 && --users_ == 0) unmap_idle_until(0);
  }

  /// Gives every idle range back to the system now (the blocks in use stay).
  /// A trainer calls it once an optimizer has taken its first step (NOTE
  /// [Host blocks after the first step]).
  void release_idle() {
    std::lock_guard lock(mutex_);
    unmap_idle_until(0);
  }

  Stats stats() const {
    std::lock_guard lock(mutex_);
    auto stats = stats_;
    stats.users = users_;
    return stats;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }

 protected:
  c10::DataPtr allocate_bytes(std::size_t n) override {
#if ACCEL_HOST_BLOCK_CACHE
    if (n >= kSmallestBlock) {
      const std::size_t bytes = round_to_pages(n);
      std::lock_guard lock(mutex_);
      // With no user it stays installed (it cannot leave safely) but keeps nothing.
      if (users_ > 0) {
        void* data = take_idle(bytes);
        if (data == nullptr) data = map(bytes);
        if (data != nullptr) return {data, data, &give_back, c10::Device(c10::DeviceType::CPU)};
      }
    }
#endif
    return below_->allocate(n);  // small, unused, or the system refused a mapping: LibTorch's allocator says why
  }

 private:
  // Above the default registration's, as HostAllocationCounter's.
  static constexpr std::uint8_t kPriority = 200;

  static HostBlockCache& instance() {
    static auto* cache = new HostBlockCache;  // never destroyed: tensors may be freed during exit
    return *cache;
  }

#if ACCEL_HOST_BLOCK_CACHE
  static std::size_t round_to_pages(std::size_t n) {
    static const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    return (n + page - 1) / page * page;
  }

  // The smallest idle range that holds `bytes`; a remainder of kSmallestBlock
  // or more stays idle on its own. Ranges are split and joined again because
  // a step's sizes peak at different moments (buckets in backward, the
  // optimizer's temporaries in its step): with whole blocks only, a block of
  // one size sat idle while another was mapped, and the resident set rose 30-65%
  // above what was in use at the peak.
  void* take_idle(std::size_t bytes) {
    auto it = idle_by_size_.lower_bound(bytes);
    if (it == idle_by_size_.end()) return nullptr;
    auto* data = static_cast<char*>(it->second);
    std::size_t size = it->first;
    forget_idle(it);
    if (size - bytes >= kSmallestBlock) {
      add_idle(data + bytes, size - bytes);
      size = bytes;
    }
    in_use_.emplace(data, size);
    note_in_use(static_cast<std::int64_t>(size));
    return data;
  }

  void* map(std::size_t bytes) {
    const auto size = static_cast<std::int64_t>(bytes);
    // Blocks in use and idle stay within twice the most ever in use at once, this block included, so
    // shapes that keep changing cannot grow the cache without bound. (With whole blocks, a bound of 1x
    // unmapped and mapped again every step where sizes peak at different moments; with ranges split and
    // joined, 1.25x kept 3% less resident than 2x but still mapped a few more blocks over 40 steps.)
    unmap_idle_until(2 * std::max(stats_.most_in_use, stats_.in_use + size) - stats_.in_use - size);
    void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      unmap_idle_until(0);
      data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (data == MAP_FAILED) return nullptr;
    }
    in_use_.emplace(data, bytes);
    ++stats_.mapped;
    note_in_use(size);
    stats_.most_held = std::max(stats_.most_held, stats_.in_use + stats_.idle);  // only a mapping adds to it
    return data;
  }

  void note_in_use(std::int64_t size) {
    stats_.in_use += size;
    stats_.most_in_use = std::max(stats_.most_in_use, stats_.in_use);
  }

  // An idle range joins its idle neighbours: adjacent mappings are one range
  // to the kernel too (munmap and access may span them).
  void add_idle(char* data, std::size_t size) {
    auto next = idle_by_address_.lower_bound(data);
    if (next != idle_by_address_.end() && next->first == data + size) {
      const std::size_t next_size = next->second;
      forget_idle(find_by_size(next->first, next_size));
      size += next_size;
    }
    auto previous = idle_by_address_.lower_bound(data);
    if (previous != idle_by_address_.begin()) {
      previous = std::prev(previous);
      if (previous->first + previous->second == data) {
        char* previous_data = previous->first;
        const std::size_t previous_size = previous->second;
        forget_idle(find_by_size(previous_data, previous_size));
        data = previous_data;
        size += previous_size;
      }
    }
    stats_.idle += static_cast<std::int64_t>(size);
    idle_by_address_.emplace(data, size);
    idle_by_size_.emplace(size, data);
  }

  std::multimap<std::size_t, void*>::iterator find_by_size(char* data, std::size_t size) {
    auto [first, last] = idle_by_size_.equal_range(size);
    for (auto it = first; it != last; ++it)
      if (it->second == data) return it;
    return idle_by_size_.end();  // unreachable: both maps hold every idle range
  }

  // Takes an idle range out of both maps (and out of `idle`).
  void forget_idle(std::multimap<std::size_t, void*>::iterator it) {
    stats_.idle -= static_cast<std::int64_t>(it->first);
    idle_by_address_.erase(static_cast<char*>(it->second));
    idle_by_size_.erase(it);
  }

  // Unmaps idle ranges, largest first, until at most `limit` bytes are idle.
  void unmap_idle_until(std::int64_t limit) {
    while (stats_.idle > limit && !idle_by_size_.empty()) {
      auto it = std::prev(idle_by_size_.end());
      munmap(it->second, it->first);
      ++stats_.unmapped;
      forget_idle(it);
    }
  }
#else
  void unmap_idle_until(std::int64_t) {}
#endif

  // A block's tensor let it go: kept idle while the cache has users. (Also
  // LibTorch's raw_delete for any pointer raw_allocate gave out, the small
  // ones included.)
  static void give_back(void* data) {
    auto& self = instance();
    std::lock_guard lock(self.mutex_);
#if ACCEL_HOST_BLOCK_CACHE
    auto it = self.in_use_.find(data);
    if (it != self.in_use_.end()) {
      const std::size_t size = it->second;
      self.in_use_.erase(it);
      self.stats_.in_use -= static_cast<std::int64_t>(size);
      self.add_idle(static_cast<char*>(data), size);
      if (self.users_ == 0) self.unmap_idle_until(0);
      return;
    }
#endif
    if (auto deleter = self.below_->raw_deleter()) deleter(data);
  }

  mutable std::mutex mutex_;
  bool installed_ = false;
  int users_ = 0;
  c10::Allocator* below_ = nullptr;
  std::unordered_map<void*, std::size_t> in_use_;  // the blocks tensors hold, by address
  std::multimap<std::size_t, void*> idle_by_size_;  // the idle ranges (joined where adjacent), by size ...
  std::map<char*, std::size_t> idle_by_address_;   // ... and by address, to join them
  Stats stats_;
};

/// One user of the process's cache for as long as it lives (what a Trainer
/// on the CPU device holds, NOTE above); empty when `use` is false or the
/// cache cannot be installed.
class HostBlockCacheUse {
 public:
  explicit HostBlockCacheUse(bool use) : cache_(use ? HostBlockCache::acquire() : nullptr) {}
  ~HostBlockCacheUse() {
    if (cache_ != nullptr) cache_->release();
  }
  HostBlockCacheUse(const HostBlockCacheUse&) = delete;
  HostBlockCacheUse& operator=(const HostBlockCacheUse&) = delete;
  /// The cache, or null.
  HostBlockCache* get() const { return cache_; }

 private:
  HostBlockCache* cache_;
};

}  // namespace accel::device
