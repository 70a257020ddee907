#pragma once
// Parameters freed between uses: the layer of the sharded engine
// (strategy/sharded_engine.hpp) that ZeRO-3 and HybridShard turn on.
// Included by that engine's compiled-once section only.
//
// NOTE [ZeRO-3 parameter life cycle]
// LibTorch modules have no forward hooks, so accel watches the operators
// instead: a RecordFunction observer sees each operator's inputs before it
// runs. Every unit (from the auto-wrap policy) keeps its parameters as views
// of flat buffers laid out as in NOTE [ZeRO shards]; between uses those
// buffers' storage is resized to zero bytes, while the parameter tensors
// (and any view autograd saved, e.g. weight.t()) keep their shape. When an
// operator is about to read a freed buffer, the observer all-gathers the
// unit's shards into it first (writing through a separate tensor, so the
// version counters autograd checks are untouched):
//   forward:  gathered on first use; freed when the next unit starts, and all
//             freed when the forward returns (reshard_after_forward, the
//             default; with it off, kept until the unit's backward is done);
//   backward: gathered again on first use, with the unit that ran before it
//             in the forward prefetched asynchronously (backward prefetch);
//             freed as soon as all its gradients are ready, when its
//             reduce-scatter is launched.
// The optimizer steps each rank's shard, a tensor of its own; nothing is
// gathered after the step (the next forward gathers the updated shards).
//
// Devices: a buffer's memory is freed and re-allocated through the allocator
// that made it (the CPU one, or CUDA's caching allocator, which keeps the
// blocks for reuse on the same stream). On CUDA the backward runs on
// autograd's device thread, so the observer answers every thread for device
// tensors; for host tensors only the thread that runs the training step, since
// Gloo's worker threads also touch the buffers (copying gathered chunks).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "accel/comm/collectives.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/device/buffer_pool.hpp"

namespace accel::strategy {
namespace detail {

// Frees (nbytes 0) or re-allocates a buffer's memory through the allocator it
// came from (through `pool`, which keeps it for the next use, when given);
// the tensors viewing it keep their shapes. New memory is not initialised:
// it is always overwritten by an all-gather.
inline void set_storage_bytes(c10::StorageImpl* storage, std::size_t nbytes, device::BufferPool* pool = nullptr) {
  if (nbytes == 0) {
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, storage->device()));
  } else {
    if (storage->allocator() == nullptr)
      throw std::logic_error("accel ZeRO<3>: a parameter buffer without an allocator cannot be re-allocated");
    storage->set_data_ptr_noswap(pool != nullptr ? pool->allocate(nbytes, storage->allocator(), storage->device())
                                                 : storage->allocator()->allocate(nbytes));
  }
  storage->set_nbytes(nbytes);
}

// Set while accel runs its own operators on the buffers (gathers, frees),
// which the observer must not act on. Per thread: another thread's operators
// are not ours.
inline thread_local bool zero3_busy = false;

struct BusyScope {
  bool previous = zero3_busy;
  BusyScope() { zero3_busy = true; }
  ~BusyScope() { zero3_busy = previous; }
  BusyScope(const BusyScope&) = delete;
  BusyScope& operator=(const BusyScope&) = delete;
};

// A unit's full parameters, as FSDP2's FSDPParamGroup tracks them:
//   sharded --unshard()--> unsharding --wait_for_unshard()--> unsharded --reshard()--> sharded
// (unsharding: the all-gathers are in flight, e.g. a backward prefetch). A
// unit starts unsharded: prepare has the whole model until it reshards.
enum class UnitState { sharded, unsharding, unsharded };

struct ShardedUnit {
  std::string name;
  std::vector<std::size_t> buckets;
  UnitState state = UnitState::unsharded;
  std::vector<comm::Pending> gathering;  // the in-flight all-gathers while unsharding
  std::size_t launched = 0;              // buckets whose reduce-scatter started in this backward
};

class ZeRO3State {
 public:
  ZeRO3State(std::vector<at::Tensor>& flat_buffers, std::vector<at::Tensor>& shard_tensors)
      : flat(flat_buffers), shards(shard_tensors) {}
  comm::Communicator* comm = nullptr;
  device::BufferPool* pool = nullptr;    // the engine's (NOTE [Buffers that live as long as the engine])
  std::atomic<std::thread::id> owner{};  // the thread that trains (see NOTE above)
  // The engine's, per bucket: (padded,) full parameters, their storage freed
  // between uses; (shard,) this rank's parameters, each with storage of its own.
  std::vector<at::Tensor>& flat;
  std::vector<at::Tensor>& shards;
  std::vector<std::size_t> unit_of_bucket;
  std::vector<ShardedUnit> units;
  std::unordered_map<const c10::StorageImpl*, std::size_t> unit_of_storage;
  std::vector<std::size_t> forward_order, last_forward_order;
  std::size_t root = 0;            // the unit of parameters no wrapped submodule took
  bool backward = false;
  bool held = false;               // every unit gathered for a checkpoint: no freeing until released
  bool reshard_after_forward = true;  // ZeRO<3>::reshard_after_forward
  std::size_t current = SIZE_MAX;  // the unit the forward is in

  std::size_t bytes(std::size_t b) const { return static_cast<std::size_t>(flat[b].numel() * flat[b].element_size()); }

  /// sharded -> unsharding: starts the unit's all-gathers, into the
  /// engine's pool (a step's gathers) or memory of their own (`for_good`:
  /// checkpoints and unwrap_model, which must not grow the pool).
  void unshard(std::size_t u, bool for_good = false) {
    auto& unit = units[u];
    if (unit.state != UnitState::sharded) return;
    unit.state = UnitState::unsharding;
    for (auto b : unit.buckets) {
      auto target = full_buffer(b, for_good);
      // In place: this rank's row of the unit first, then the others'
      // gathered into theirs, nothing staged beside the unit (one rank: its
      // row is the whole bucket, and there is nothing to gather).
      const std::int64_t shard = shards[b].numel();
      target.narrow(0, comm->rank() * shard, shard).copy_(shards[b].detach());
      for (auto& g : comm::all_gather_rows_async(*comm, target, "all-gather of ZeRO-3 unit '" + unit.name + "'"))
        unit.gathering.push_back(std::move(g));
    }
  }

  /// unsharding -> unsharded: waits for them.
  void wait_for_unshard(std::size_t u) {
    auto& unit = units[u];
    if (unit.state != UnitState::unsharding) return;
    for (auto& pending : unit.gathering) pending.wait();
    unit.gathering.clear();
    unit.state = UnitState::unsharded;
  }

  /// Whatever the state, unsharded on return.
  void unshard_now(std::size_t u, bool for_good = false) {
    unshard(u, for_good);
    wait_for_unshard(u);
  }

  /// -> sharded: frees the full parameters (after any in-flight gather lands).
  void reshard(std::size_t u) {
    auto& unit = units[u];
    wait_for_unshard(u);
    if (unit.state != UnitState::unsharded) return;
    for (auto b : unit.buckets) set_storage_bytes(flat[b].storage().unsafeGetStorageImpl(), 0);
    unit.state = UnitState::sharded;
  }

  void reshard_all() {
    for (std::size_t u = 0; u < units.size(); ++u) reshard(u);
    current = SIZE_MAX;
  }

  // NOTE [A collective that fails inside the observer]
  // RecordFunction runs observers inside a try that logs and swallows what
  // they throw ("Exception in RecordFunction callback"), so a failed gather
  // cannot stop the operator that asked for it. The observer keeps the first
  // failure instead; from then on no unit is gathered (each further gather
  // would wait out the timeout on the same dead peer), a unit that is read
  // gets zeroed memory so the rest of the forward or backward runs on defined
  // bytes, and the engine rethrows the failure as soon as it has control back
  // (after the forward, before and after the backward, before a checkpoint).
  std::exception_ptr failure;

  void fail(std::exception_ptr error) {
    if (!failure) failure = std::move(error);
    for (auto& unit : units) unit.gathering.clear();  // their collectives failed or never will complete
  }
  void rethrow_failure() const {
    if (failure) std::rethrow_exception(failure);
  }

  // Called by the observer before an operator that reads unit `u`.
  void on_use(std::size_t u) {
    if (held) return;
    if (failure) return make_readable(u);
    if (!backward && u != current) {
      if (current != SIZE_MAX && current != root && reshard_after_forward) reshard(current);
      current = u;
      if (std::find(forward_order.begin(), forward_order.end(), u) == forward_order.end()) forward_order.push_back(u);
    }
    if (units[u].state == UnitState::unsharded) return;
    unshard_now(u);
    if (backward) {  // prefetch the unit that ran before this one in the forward
      auto it = std::find(last_forward_order.begin(), last_forward_order.end(), u);
      if (it != last_forward_order.end() && it != last_forward_order.begin()) unshard(*(it - 1));
    }
  }

 private:
  // After a failure: the unit's memory exists (zeroed) and it counts as
  // gathered, so no operator reads a freed buffer and reshard frees it.
  void make_readable(std::size_t u) {
    auto& unit = units[u];
    if (unit.state == UnitState::unsharded) return;
    for (auto b : unit.buckets) full_buffer(b).zero_();
    unit.state = UnitState::unsharded;
  }

  // Bucket b's full buffer given memory (a sharded unit's has none), as a
  // separate tensor on the parameters' storage: writing through it leaves
  // their version counters (checked by autograd) untouched.
  at::Tensor full_buffer(std::size_t b, bool for_good = false) {
    auto* storage = flat[b].storage().unsafeGetStorageImpl();
    if (storage->nbytes() != bytes(b)) set_storage_bytes(storage, bytes(b), for_good ? nullptr : pool);
    return at::empty({0}, flat[b].options()).set_(flat[b].storage(), 0, {flat[b].numel()}, {1});
  }
};

// The observer is a plain function; it finds the engines through this
// registry of every prepared ZeRO-3 model in the process.
struct ZeRO3Registry {
  std::mutex mutex;
  std::vector<ZeRO3State*> states;
};
inline ZeRO3Registry& zero3_registry() {
  static ZeRO3Registry registry;
  return registry;
}

inline std::unique_ptr<at::ObserverContext> zero3_observe(const at::RecordFunction& fn) {
  if (zero3_busy) return nullptr;
  auto& registry = zero3_registry();
  auto visit = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const auto* storage = t.storage().unsafeGetStorageImpl();
    ZeRO3State* state = nullptr;
    std::size_t unit = 0;
    {
      std::lock_guard<std::mutex> lock(registry.mutex);
      for (auto* candidate : registry.states) {
        auto it = candidate->unit_of_storage.find(storage);
        if (it == candidate->unit_of_storage.end()) continue;
        state = candidate;
        unit = it->second;
        break;
      }
    }
    if (state == nullptr) return;
    if (t.is_cpu() && std::this_thread::get_id() != state->owner) return;
    BusyScope busy;
    try {
      state->on_use(unit);
    } catch (...) {  // NOTE [A collective that fails inside the observer]
      state->fail(std::current_exception());
      state->on_use(unit);  // zeroed memory for this operator
    }
  };
  for (const auto& input : fn.inputs()) {
    if (input.isTensor()) visit(input.toTensor());
    else if (input.isTensorList())
      for (const auto& t : input.toTensorVector()) visit(t);
  }
  return nullptr;
}

}  // namespace detail

}  // namespace accel::strategy
