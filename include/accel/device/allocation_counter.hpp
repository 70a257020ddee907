#pragma once
// Bytes LibTorch really allocates in host memory, counted at the allocator:
// while a HostAllocationCounter lives, every CPU tensor's storage is
// allocated through it (the default allocator underneath), so `peak_bytes`
// is the most that was live at any instant, activations and temporaries
// included, which the resident set (VmHWM) blurs with the allocator's and
// the kernel's page reuse. The memory tests and `accel estimate-memory`'s
// checks measure with it. When the host block cache is installed
// (device/host_block_cache.hpp) it goes under the counter, which counts what
// tensors hold, not the blocks the cache keeps.

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <stdexcept>

#include "accel/compat/torch_compat.hpp"

namespace accel::device {

class HostAllocationCounter {
  struct Counts {
    std::atomic<std::int64_t> live{0};
    std::atomic<std::int64_t> peak{0};
  };

  // Hands out the inner allocator's memory and remembers its size. LibTorch's
  // raw_allocate wants the context to be the pointer itself, so what each
  // pointer holds is found again in a registry; it outlives every counter, as
  // a tensor may outlive the counter that allocated it.
  class Counting final : public compat::HostAllocatorBase {
   public:
    Counting(c10::Allocator* inner, std::shared_ptr<Counts> counts) : inner_(inner), counts_(std::move(counts)) {}
    c10::DeleterFnPtr raw_deleter() const override { return &release; }
    c10::Allocator* inner() const { return inner_.load(); }
    void set_inner(c10::Allocator* inner) { inner_.store(inner); }

   protected:
    c10::DataPtr allocate_bytes(std::size_t n) override {
      auto memory = inner_.load()->allocate(n);
      void* data = memory.get();
      if (data == nullptr) return memory;  // nothing to count (0 bytes)
      const auto bytes = static_cast<std::int64_t>(n);
      const auto device = memory.device();
      {
        std::lock_guard lock(registry().mutex);
        registry().held.emplace(data, Held{std::move(memory), bytes, counts_});
      }
      const auto live = counts_->live.fetch_add(bytes) + bytes;
      auto peak = counts_->peak.load();
      while (live > peak && !counts_->peak.compare_exchange_weak(peak, live)) {
      }
      return {data, data, &release, device};
    }

   private:
    struct Held {
      c10::DataPtr memory;
      std::int64_t bytes = 0;
      std::shared_ptr<Counts> counts;
    };
    struct Registry {
      std::mutex mutex;
      std::unordered_map<void*, Held> held;
    };
    static Registry& registry() {
      static auto* r = new Registry;  // never destroyed: tensors may be freed during exit
      return *r;
    }
    static void release(void* data) {
      Held held;
      {
        std::lock_guard lock(registry().mutex);
        auto it = registry().held.find(data);
        if (it == registry().held.end()) return;
        held = std::move(it->second);
        registry().held.erase(it);
      }
      held.counts->live.fetch_sub(held.bytes);
    }  // `held.memory` frees through the inner allocator here
    std::atomic<c10::Allocator*> inner_;
    std::shared_ptr<Counts> counts_;
  };

 public:
  /// Installs the counter as LibTorch's CPU allocator until destroyed. One
  /// at a time; tensors allocated before it are not counted.
  HostAllocationCounter() : counting_(c10::GetCPUAllocator(), counts_) {
    if (dynamic_cast<Counting*>(counting_.inner()) != nullptr)
      throw std::logic_error("accel HostAllocationCounter: one is already installed (they do not nest)");
    c10::SetCPUAllocator(&counting_, kPriority);
  }
  ~HostAllocationCounter() { c10::SetCPUAllocator(counting_.inner(), kPriority); }
  HostAllocationCounter(const HostAllocationCounter&) = delete;
  HostAllocationCounter& operator=(const HostAllocationCounter&) = delete;

  /// Bytes allocated since the counter was installed and not yet freed.
  std::int64_t live_bytes() const { return counts_->live.load(); }
  /// The most that was live at once since installation or reset_peak().
  std::int64_t peak_bytes() const { return counts_->peak.load(); }
  /// Starts a new peak from what is live now.
  void reset_peak() { counts_->peak.store(counts_->live.load()); }

  /// Puts `below` between the installed counter (if LibTorch's CPU allocator
  /// is one) and the allocator it wraps; returns that allocator, or null when
  /// no counter is installed. `below` must forward to what it returns.
  static c10::Allocator* insert_below_installed(c10::Allocator* below) {
    auto* counting = dynamic_cast<Counting*>(c10::GetCPUAllocator());
    if (counting == nullptr) return nullptr;
    auto* inner = counting->inner();
    counting->set_inner(below);
    return inner;
  }

 private:
  // Above the default registration's, so that restoring also wins.
  static constexpr std::uint8_t kPriority = 200;
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();
  Counting counting_;
};

}  // namespace accel::device
