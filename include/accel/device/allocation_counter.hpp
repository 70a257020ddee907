#pragma once
// Bytes LibTorch really allocates in host memory, counted at the allocator:
// while a HostAllocationCounter lives, every CPU tensor's storage is
// allocated through it (the default allocator underneath), so `peak_bytes`
// is the most that was live at any instant, activations and temporaries
// included, which the resident set (VmHWM) blurs with the allocator's and
// the kernel's page reuse. The memory tests and `accel estimate-memory`'s
// checks measure with it.

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

   protected:
    c10::DataPtr allocate_bytes(std::size_t n) override {
      auto memory = inner_->allocate(n);
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
    c10::Allocator* inner_;
    std::shared_ptr<Counts> counts_;
  };

 public:
  /// Installs the counter as LibTorch's CPU allocator until destroyed. One
  /// at a time; tensors allocated before it are not counted.
  HostAllocationCounter() : inner_(c10::GetCPUAllocator()), counting_(inner_, counts_) {
    if (dynamic_cast<Counting*>(inner_) != nullptr)
      throw std::logic_error("accel HostAllocationCounter: one is already installed (they do not nest)");
    c10::SetCPUAllocator(&counting_, kPriority);
  }
  ~HostAllocationCounter() { c10::SetCPUAllocator(inner_, kPriority); }
  HostAllocationCounter(const HostAllocationCounter&) = delete;
  HostAllocationCounter& operator=(const HostAllocationCounter&) = delete;

  /// Bytes allocated since the counter was installed and not yet freed.
  std::int64_t live_bytes() const { return counts_->live.load(); }
  /// The most that was live at once since installation or reset_peak().
  std::int64_t peak_bytes() const { return counts_->peak.load(); }
  /// Starts a new peak from what is live now.
  void reset_peak() { counts_->peak.store(counts_->live.load()); }

 private:
  // Above the default registration's, so that restoring also wins.
  static constexpr std::uint8_t kPriority = 200;
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();
  c10::Allocator* inner_;
  Counting counting_;
};

}  // namespace accel::device
