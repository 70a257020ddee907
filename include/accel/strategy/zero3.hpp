#pragma once
// ZeRO stage 3 (FSDP FULL_SHARD): parameters, gradients and optimizer state
// are all sharded; a unit's full parameters exist only while it computes.
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
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/core/policies.hpp"
#include "accel/strategy/buckets.hpp"
#include "accel/strategy/sharded_engine.hpp"
#include "accel/strategy/zero.hpp"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace accel::strategy {

namespace detail {
class ZeRO3State;  // the units and their life cycle, in the compiled-once section below
}

class ZeRO3Engine final : public ShardedEngineBase {
 public:
  using settings_type = ZeRO<3>;

  ZeRO3Engine(const ZeRO<3>& settings, comm::Communicator& comm);
  // The model outlives the trainer: give it back whole (a collective, as
  // every rank destroys its trainer at the same point of the program). Not
  // while an exception unwinds: the peers may not be there; the parameters
  // then stay sharded and must not be used. Not a model built on meta,
  // which may not fit whole: it goes back to the meta device (unwrap_model
  // before, to have it whole).
  ~ZeRO3Engine();

  /// Gathers every unit for good and stops sharding: the model is whole on
  /// every rank again (Trainer::unwrap_model; every rank must call it).
  void unshard_permanently();

  void prepare_model(torch::nn::Module& model);
  /// A model built by device::build_on_meta (NOTE [Models built on meta]):
  /// no rank ever holds it whole. prepare_optimizer computes one unit's
  /// parameters at a time, keeps this rank's shard of them and frees the unit.
  void prepare_meta_model(torch::nn::Module& model, at::Device device);
  void prepare_optimizer(torch::optim::Optimizer& optimizer);

  void before_forward();
  void after_forward();
  void before_backward(const at::Tensor& loss);

  void synchronize_gradients() {
    reduce_gradients();
    offload_gradients();
  }
  /// The reduce-scatter alone (HybridShard averages the shards across
  /// replicas before they are offloaded).
  void reduce_gradients();
  void offload_gradients() { offload_.gradients_to_host(device_shards()); }
  /// This rank's reduced gradient shards, in device memory.
  const std::vector<at::Tensor>& device_gradient_shards() const { return grad_shards_; }

  void after_optimizer_step() { offload_.parameters_to_device(device_shards()); }

  void zero_grad(torch::optim::Optimizer&);

  /// The tensors the optimizer steps: this rank's shards, or their host
  /// twins under cpu_offload (NOTE [CPU offload]).
  const std::vector<at::Tensor>& optimizer_parameters() const override { return stepped(device_shards()); }
  /// This rank's parameter shards in device memory (the optimizer's own
  /// tensors unless cpu_offload), whose .grad are the reduced gradient shards.
  const std::vector<at::Tensor>& device_shards() const;
  void parameters_loaded() override;
  /// Under SHARDED_STATE_DICT a checkpoint holds this rank's shards
  /// (NOTE [Sharded checkpoints]); a load writes into them.
  std::optional<ShardedParameters> sharded_parameters() const override {
    if (settings_.state_dict_type != StateDictType::SHARDED_STATE_DICT) return std::nullopt;
    return held_shards();
  }
  std::optional<ShardedParameters> held_shards() const override {
    return ShardedParameters{flat_buckets(), device_shards(), model_};
  }

  /// Checkpoints: every unit gathered (all ranks call it), then released;
  /// after a load, each rank's shards are taken from the loaded parameters.
  void gather_full_parameters() override;
  void release_full_parameters(FullParameters what) override;

  // ------------------------------------------------------------ introspection
  std::size_t unit_count() const;
  const std::string& unit_name(std::size_t u) const;
  bool unit_gathered(std::size_t u) const;
  /// Bytes of full (gathered) parameters this rank holds right now.
  std::int64_t gathered_bytes() const;
  /// The largest unit's full parameters, in bytes.
  std::int64_t largest_unit_bytes() const;

 private:
  void back_to_meta();
  std::vector<std::pair<std::string, at::Tensor>> named_parameters_of(std::size_t b) const;
  void require_attached() const;
  void stop_observing();
  void launch(std::size_t b);

  ZeRO<3> settings_;
  std::shared_ptr<detail::ZeRO3State> z3_;
  torch::nn::Module* model_ = nullptr;
  std::optional<std::uint64_t> observer_;  // at::CallbackHandle
  bool detached_ = false;
  std::optional<at::Device> materialize_on_;  // set for a model built on meta
};

}  // namespace accel::strategy

// The engine's code, compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <unordered_map>

#include "accel/comm/collectives.hpp"
#include "accel/strategy/deferred_init.hpp"
#include "accel/strategy/module_tree.hpp"
#include "accel/strategy/unit_checkpointing.hpp"

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
  comm::Communicator* comm = nullptr;
  device::BufferPool* pool = nullptr;    // the engine's (NOTE [Buffers that live as long as the engine])
  std::atomic<std::thread::id> owner{};  // the thread that trains (see NOTE above)
  std::vector<at::Tensor> flat;    // per bucket: (padded,) full parameters, storage freed between uses
  std::vector<at::Tensor> shards;  // per bucket: (shard,) this rank's parameters, own storage
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

static_assert(std::is_same_v<at::CallbackHandle, std::uint64_t>, "ZeRO3Engine::observer_ holds an at::CallbackHandle");

ACCEL_COMPILED_ONCE ZeRO3Engine::ZeRO3Engine(const ZeRO<3>& settings, comm::Communicator& comm)
    : ShardedEngineBase(BucketSettings{.find_unused_parameters = settings.find_unused_parameters,
                                        .pad_to_multiple = comm.size(),
                                        .strategy_name = "ZeRO<3>",
                                        .size_capped = false,
                                        .lazy_gradients = true,
                                        .keep_step_buffers = true},
                        comm, settings.cpu_offload),
      settings_(settings),
      z3_(std::make_shared<detail::ZeRO3State>()) {
#ifndef NDEBUG
  // LibTorch is built with NDEBUG; a debug build's RecordFunction::inputs()
  // asserts on a member that LibTorch never sets (a padding byte there).
  throw std::logic_error("accel ZeRO<3>: build with -DNDEBUG (meson's release/debugoptimized with b_ndebug), "
                         "as LibTorch itself is built");
#endif
  static_assert(complete_engine<ZeRO3Engine>);
  check_unit_checkpointing(settings, state_->settings.strategy_name);
  z3_->comm = &comm;
  z3_->pool = state_->step_buffers();
  z3_->reshard_after_forward = settings.reshard_after_forward;
  state_->launch = [this](std::size_t b) { launch(b); };
  state_->before_allocating = [this] { retire_launched(); };
}

ACCEL_COMPILED_ONCE ZeRO3Engine::~ZeRO3Engine() {
  if (!detached_ && std::uncaught_exceptions() == 0 && !z3_->shards.empty()) {
    if (z3_->failure) {
      std::fprintf(stderr, "accel ZeRO<3>: the model stays sharded at shutdown: a collective of its training failed\n");
    } else if (materialize_on_) {
      back_to_meta();
    } else {
      try {
        unshard_permanently();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "accel ZeRO<3>: could not gather the full model at shutdown: %s\n", e.what());
      }
    }
  }
  stop_observing();
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::unshard_permanently() {
  if (detached_) return;
  z3_->rethrow_failure();
  {
    detail::BusyScope busy;
    z3_->reshard_all();  // a unit gathered into the pool (mid-step) is gathered again into memory of its own
  }
  gather_full_parameters();
  stop_observing();
  detached_ = true;
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::prepare_model(torch::nn::Module& model) {
  if (model.parameters().empty()) throw std::logic_error("accel ZeRO<3>: the model has no parameters");
  collect(model);
  checkpoint_wrapped_units(model, settings_, state_->settings.strategy_name);
  model_ = &model;
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::prepare_meta_model(torch::nn::Module& model, at::Device device) {
  if (model.parameters().empty()) throw std::logic_error("accel ZeRO<3>: the model has no parameters");
  deferred_init::check_materializable(model);  // every rank alike, before any collective
  collect(model, /*broadcast=*/false);
  agree_on_initialisers(model, *state_->comm, state_->settings.strategy_name);
  checkpoint_wrapped_units(model, settings_, state_->settings.strategy_name);
  model_ = &model;
  materialize_on_ = device;
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  auto& s = *state_;
  if (model_ == nullptr) throw std::logic_error("accel ZeRO<3>: prepare the model before (or with) the optimizer");
  if (!optimizer.state().empty())
    throw std::logic_error("accel ZeRO: prepare the optimizer before its first step (its state would be lost)");
  std::vector<std::string> unit_names;
  std::vector<std::int64_t> numels;
  for (const auto& p : s.params) numels.push_back(p.numel());
  const auto unit_of_param = assign_units(module_tree(*model_, s.params), numels, settings_.auto_wrap_policy,
                                          settings_.min_num_params, settings_.transformer_layer_cls_to_wrap, unit_names);
  auto& groups = optimizer.param_groups();
  // Buckets never straddle units or optimizer groups.
  plan_buckets([&](const at::Tensor& p) { return optimizer_group_of(groups, p); },
               [&](std::size_t i) { return static_cast<int>(unit_of_param[i]); });
  auto& z = *z3_;
  z.units.resize(unit_names.size());
  for (std::size_t u = 0; u < unit_names.size(); ++u) z.units[u].name = unit_names[u];
  z.root = unit_names.size() - 1;
  const int world = s.comm->size(), rank = s.comm->rank();
  c10::NoGradGuard no_grad;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    auto& bucket = s.buckets[b];
    const std::size_t u = static_cast<std::size_t>(bucket.unit);
    if (materialize_on_) deferred_init::materialize_each(named_parameters_of(b), *materialize_on_);  // this bucket's only
    at::Tensor flat = flatten_parameters(b);  // (padded,)
    const std::int64_t shard = bucket.padded / world;
    z.flat.push_back(flat);
    z.shards.push_back(flat.narrow(0, rank * shard, shard).clone().requires_grad_(true));
    // Built on meta: the unit's full parameters go before the next is computed.
    if (materialize_on_) detail::set_storage_bytes(flat.storage().unsafeGetStorageImpl(), 0);
    allocate_gradient_shards(shard, flat.options());
    z.unit_of_bucket.push_back(u);
    z.units[u].buckets.push_back(b);
    z.unit_of_storage[flat.storage().unsafeGetStorageImpl()] = u;
  }
  // Built on meta: buffers and frozen parameters, which are not sharded, whole.
  if (materialize_on_) {
    deferred_init::materialize_each(deferred_init::meta_tensors_of(*model_), *materialize_on_);
    deferred_init::forget_replaced();  // the records of the storages just replaced
  }
  for (std::size_t b = 0; b < s.buckets.size(); ++b) z.shards[b].mutable_grad() = grad_shards_[b];
  offload_.attach(z.shards);
  point_optimizer_at(groups, optimizer_parameters());
  z.reshard_all();
  size_collectives();
  register_hooks();
  z.owner = std::this_thread::get_id();
  {
    auto& registry = detail::zero3_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    registry.states.push_back(z3_.get());
  }
  observer_ = at::addGlobalCallback(at::RecordFunctionCallback(&detail::zero3_observe).needsInputs(true));
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::before_forward() {
  require_attached();
  z3_->owner = std::this_thread::get_id();  // whichever thread trains now
  z3_->backward = false;
  z3_->forward_order.clear();
  z3_->current = SIZE_MAX;
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::after_forward() {
  if (detached_) return;  // unwrapped: the model stays whole
  z3_->rethrow_failure();
  z3_->last_forward_order = z3_->forward_order;
  if (z3_->reshard_after_forward) z3_->reshard_all();  // else each unit goes once its backward is done
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::before_backward(const at::Tensor& loss) {
  require_attached();
  z3_->owner = std::this_thread::get_id();
  if (z3_->shards.empty())
    throw std::logic_error("accel ZeRO<3>: no optimizer was prepared: call trainer.prepare(model, optimizer) first");
  z3_->rethrow_failure();
  if (z3_->last_forward_order.empty()) z3_->last_forward_order = z3_->forward_order;
  z3_->backward = true;
  for (auto& unit : z3_->units) unit.launched = 0;
  mark_unused_ready(loss);
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::reduce_gradients() {
  z3_->rethrow_failure();  // a gather of the backward failed
  wait_for_buckets(work_, [&](std::size_t b) { finish_reduce_scatter(b, grad_shards_[b], received_[b]); });
  release_full_gradients();
  set_shards_hold_reduced(true);
  z3_->backward = false;
  z3_->reshard_all();
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::zero_grad(torch::optim::Optimizer&) {
  for (auto& g : grad_shards_) g.zero_();
  set_shards_hold_reduced(false);
  offload_.zero_grad();
}

ACCEL_COMPILED_ONCE const std::vector<at::Tensor>& ZeRO3Engine::device_shards() const { return z3_->shards; }

ACCEL_COMPILED_ONCE void ZeRO3Engine::parameters_loaded() {
  z3_->reshard_all();  // a full parameter buffer gathered before the load holds the old values
  offload_.parameters_from_device(z3_->shards);
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::gather_full_parameters() {
  z3_->rethrow_failure();
  detail::BusyScope busy;
  for (std::size_t u = 0; u < z3_->units.size(); ++u) z3_->unshard_now(u, /*for_good=*/true);
  z3_->held = true;
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::release_full_parameters(FullParameters what) {
  auto& z = *z3_;
  detail::BusyScope busy;
  z.held = false;
  if (what == FullParameters::loaded) {
    c10::NoGradGuard no_grad;
    for (std::size_t b = 0; b < z.shards.size(); ++b) {
      const std::int64_t shard = z.shards[b].numel();
      z.shards[b].copy_(z.flat[b].narrow(0, state_->comm->rank() * shard, shard));
    }
  }
  z.reshard_all();
}

ACCEL_COMPILED_ONCE std::size_t ZeRO3Engine::unit_count() const { return z3_->units.size(); }
ACCEL_COMPILED_ONCE const std::string& ZeRO3Engine::unit_name(std::size_t u) const { return z3_->units.at(u).name; }
ACCEL_COMPILED_ONCE bool ZeRO3Engine::unit_gathered(std::size_t u) const {
  return z3_->units.at(u).state == detail::UnitState::unsharded;
}

ACCEL_COMPILED_ONCE std::int64_t ZeRO3Engine::gathered_bytes() const {
  std::int64_t total = 0;
  for (const auto& f : z3_->flat) total += static_cast<std::int64_t>(f.storage().nbytes());
  return total;
}

ACCEL_COMPILED_ONCE std::int64_t ZeRO3Engine::largest_unit_bytes() const {
  std::int64_t largest = 0;
  for (const auto& unit : z3_->units) {
    std::int64_t sum = 0;
    for (auto b : unit.buckets) sum += static_cast<std::int64_t>(z3_->bytes(b));
    largest = std::max(largest, sum);
  }
  return largest;
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::back_to_meta() {
  detail::BusyScope busy;
  c10::NoGradGuard no_grad;
  for (auto& p : state_->params) {
    p.mutable_grad() = at::Tensor();
    deferred_init::return_to_meta(p);
  }
}

ACCEL_COMPILED_ONCE auto ZeRO3Engine::named_parameters_of(std::size_t b) const
    -> std::vector<std::pair<std::string, at::Tensor>> {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto i : state_->buckets[b].params) out.emplace_back(state_->names[i], state_->params[i]);
  return out;
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::require_attached() const {
  if (detached_) throw std::logic_error("accel ZeRO<3>: the model was unwrapped (unwrap_model): training with this trainer is over");
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::stop_observing() {
  if (observer_) at::removeCallback(*observer_);
  observer_.reset();
  auto& registry = detail::zero3_registry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  std::erase(registry.states, z3_.get());
}

ACCEL_COMPILED_ONCE void ZeRO3Engine::launch(std::size_t b) {
  auto& s = *state_;
  // Before this bucket's collective allocates its buffers (NOTE [Gradient buckets]).
  retire_launched();
  // The unit's gradients are complete: its backward is over, free its parameters (first, for the same reason).
  auto& unit = z3_->units[z3_->unit_of_bucket[b]];
  if (++unit.launched == unit.buckets.size()) {
    detail::BusyScope busy;
    z3_->reshard(z3_->unit_of_bucket[b]);
  }
  auto& grad = s.buckets[b].grad;
  pre_divide(grad);
  work_[b] = reduce_scatter_bucket(b, grad_shards_[b], received_[b],
                                   "reduce-scatter of ZeRO-3 gradient bucket " + std::to_string(b));
}

}  // namespace accel::strategy
#endif  // ACCEL_DEFINE_COMPILED_ONCE
