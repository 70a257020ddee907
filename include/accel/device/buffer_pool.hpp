#pragma once
// NOTE [Buffers that live as long as the engine]
// ZeRO-3 needs full-size host buffers only within a step: a gathered unit's
// parameters, a bucket's full gradients, Gloo's receive buffer of a
// reduce-scatter. Freed and allocated again every step, they left glibc's
// heaps holding the freed blocks (NOTE [Returning host memory]): a ZeRO-3
// rank's resident set grew past a DDP rank's. The engine keeps them instead,
// as FSDP2 keeps its all-gather and reduce-scatter buffers: a block freed by
// its tensor goes back to this pool, and the next request takes the smallest
// idle block that holds it if that block is at most twice its size (the same
// unit or bucket next step, or a smaller buffer of the step), else a new one.
// The step repeats its requests, so the pool settles after the first step at
// about what the step has in flight at once. Measured on 2 ranks (38.8 M
// parameters, 8 steps, README "Memory"): ZeRO-3's resident set halves, and
// return_host_memory's cost falls from 0.75x to 0.93x of the default's speed.
// The price is in the allocated peak, reached early in backward, where the
// activations peak: the pool holds the most the step ever has in flight
// (there, 72.2 MiB: four unit-size blocks, two of the first layer's, two of
// the last's), where freeing buffers had only part of it live at that moment
// (55.6 MiB): 374.4 -> 391.0 MiB (+4.4%; `ddp_throughput --memory 1` prints
// the peak per phase). A tighter fit (<= 1.25x) kept more (82.3 MiB), any
// larger block hardly less (68.0). The resident set, which is what a host
// runs out of, falls by 40-50%. ZeRO-2 does not use it: its
// blocks freed and re-allocated did not grow its resident set, and keeping
// them raised both its allocated peak (+26 MiB) and its resident set.
// Device memory is not pooled here: CUDA's caching allocator already keeps
// freed blocks for reuse on their stream, and it knows the streams, which
// this pool does not.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace accel::device {

class BufferPool {
  struct Shared;
  // One block of the pool: the memory, and where it goes back when its
  // tensor lets go of it (the pool, or the system once the pool is closed).
  struct Block {
    c10::DataPtr memory;
    std::size_t bytes = 0;
    c10::Allocator* allocator = nullptr;
    std::shared_ptr<Shared> pool;
  };
  struct Shared {
    std::mutex mutex;
    bool open = true;
    std::int64_t idle = 0;  // the blocks no tensor uses now
    std::map<c10::Allocator*, std::multimap<std::size_t, std::unique_ptr<Block>>> idle_blocks;  // by size
  };

 public:
  BufferPool() : shared_(std::make_shared<Shared>()) {}
  /// Idle blocks are freed now; a block still in use is freed when its tensor lets it go.
  ~BufferPool() {
    std::lock_guard lock(shared_->mutex);
    shared_->open = false;
    shared_->idle_blocks.clear();
    shared_->idle = 0;
  }
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// `bytes` of memory from `allocator`, given back to the pool when the
  /// DataPtr is destroyed. Host memory only (NOTE above): any other device's
  /// allocator is called directly.
  c10::DataPtr allocate(std::size_t bytes, c10::Allocator* allocator, c10::Device device) {
    if (bytes == 0 || device.type() != c10::DeviceType::CPU) return allocator->allocate(bytes);
    std::unique_ptr<Block> block;
    {
      std::lock_guard lock(shared_->mutex);
      auto& idle = shared_->idle_blocks[allocator];
      auto it = idle.lower_bound(bytes);
      if (it != idle.end() && it->first / 2 <= bytes) {
        block = std::move(it->second);
        idle.erase(it);
        shared_->idle -= static_cast<std::int64_t>(block->bytes);
      }
    }
    if (!block) block = std::make_unique<Block>(Block{allocator->allocate(bytes), bytes, allocator, shared_});
    void* data = block->memory.get();
    return {data, block.release(), &give_back, device};
  }

  /// An uninitialised 1-D host tensor of `numel` elements on pooled memory
  /// (other devices: at::empty).
  at::Tensor empty(std::int64_t numel, const at::TensorOptions& options) {
    if (options.device().type() != c10::DeviceType::CPU) return at::empty({numel}, options);
    const auto bytes = static_cast<std::size_t>(numel) * options.dtype().itemsize();
    c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<std::int64_t>(bytes),
                         allocate(bytes, c10::GetCPUAllocator(), options.device()), nullptr, false);
    return at::empty({0}, options).set_(storage, 0, {numel}, {1});
  }

  /// Frees the idle blocks now (the pool stays open: later requests take new
  /// ones). For an engine that ends its steps: the whole model it gathers then
  /// takes the step buffers' memory instead of adding to it.
  void release_idle() {
    std::lock_guard lock(shared_->mutex);
    shared_->idle_blocks.clear();
    shared_->idle = 0;
  }

  /// Bytes of the blocks no tensor uses now: what the pool keeps beyond the
  /// tensors that hold its memory (between ZeRO-3 steps, all of it).
  std::int64_t idle_bytes() const {
    std::lock_guard lock(shared_->mutex);
    return shared_->idle;
  }

 private:
  static void give_back(void* context) {
    std::unique_ptr<Block> block(static_cast<Block*>(context));
    auto pool = std::move(block->pool);
    std::lock_guard lock(pool->mutex);
    if (!pool->open) return;  // the pool is gone: the block's memory goes back to the system
    block->pool = pool;
    pool->idle += static_cast<std::int64_t>(block->bytes);
    const std::size_t bytes = block->bytes;
    pool->idle_blocks[block->allocator].emplace(bytes, std::move(block));
  }

  std::shared_ptr<Shared> shared_;
};

}  // namespace accel::device
