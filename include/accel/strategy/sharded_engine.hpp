#pragma once
// The one sharded engine: ZeRO<1>, ZeRO<2>, ZeRO<3> and HybridShard are this
// class, set by three orthogonal choices (as FSDP2's fully_shard takes
// reshard_after_forward and an HSDP mesh as arguments of one engine):
//   shard_gradients   each bucket is reduce-scattered into this rank's shard
//                     (ZeRO-2, 3) instead of all-reduced whole (ZeRO-1);
//   free_parameters   a unit's full parameters exist only while it computes
//                     (ZeRO-3, NOTE [ZeRO-3 parameter life cycle] in
//                     parameter_units.hpp), with reshard_after_forward saying
//                     whether the forward frees them; otherwise every rank
//                     keeps the whole model and gathers the updated shards
//                     after each step (ZeRO-1, 2);
//   replicate group   the ranks are split into shard groups, the reduced
//                     gradient shards then averaged over the groups
//                     (HybridShard, FSDP's HYBRID_SHARD).
// Layers of it: the buckets and hooks (buckets.hpp, BucketedEngineBase), the
// host twins of cpu_offload (offload.hpp, HostOffload), the unit life cycle
// (parameter_units.hpp). Rank r of the shard group holds shard r of every
// bucket (NOTE [ZeRO shards], zero.hpp).

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
#include "accel/strategy/engine.hpp"
#include "accel/strategy/offload.hpp"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace accel::strategy {

/// What a strategy tag sets the sharded engine to.
struct ShardedSettings {
  /// The ZeRO settings every stage shares (buckets, units, offload,
  /// checkpoints); which stage it is, the choices below say.
  ZeRO<3> zero{};
  bool shard_gradients = true;
  bool free_parameters = true;
  /// HybridShard: ranks per shard group (0: LOCAL_WORLD_SIZE); nullopt: one
  /// group of every rank, no replicas.
  std::optional<int> shard_group_size;
  const char* strategy_name = "ZeRO<3>";
};

namespace detail {
class ZeRO3State;  // the units and their life cycle (parameter_units.hpp)

// Base-from-member: HybridShard's groups exist before the buckets built on one.
struct ShardingGroups {
  std::optional<std::pair<comm::Communicator, comm::Communicator>> hybrid;  // (shard group, replicate group)
};
}  // namespace detail

class ShardedEngine final : private detail::ShardingGroups, public BucketedEngineBase {
 public:
  using settings_type = ShardedSettings;
  static constexpr bool shards_optimizer_state = true;

  using EngineDefaults::check_world;
  static void check_world(const HybridShard& settings, int world_size);

  ShardedEngine(const ZeRO<1>& settings, comm::Communicator& comm);
  ShardedEngine(const ZeRO<2>& settings, comm::Communicator& comm);
  ShardedEngine(const ZeRO<3>& settings, comm::Communicator& comm);
  ShardedEngine(const HybridShard& settings, comm::Communicator& world);
  ShardedEngine(const ShardedSettings& settings, comm::Communicator& world);
  // Under free_parameters the model outlives the trainer: give it back whole
  // (a collective, as every rank destroys its trainer at the same point of
  // the program). Not while an exception unwinds: the peers may not be
  // there; the parameters then stay sharded and must not be used. Not a
  // model built on meta, which may not fit whole: it goes back to the meta
  // device (unwrap_model before, to have it whole).
  ~ShardedEngine();

  const ShardedSettings& settings() const { return settings_; }

  void prepare_model(torch::nn::Module& model);
  /// A model built by device::build_on_meta (NOTE [Models built on meta]),
  /// under free_parameters: no rank ever holds it whole. prepare_optimizer
  /// computes one unit's parameters at a time, keeps this rank's shard of
  /// them and frees the unit. Refused otherwise (EngineDefaults).
  void prepare_meta_model(torch::nn::Module& model, at::Device device);
  /// Plans the buckets by the optimizer's parameter groups (and units), moves
  /// the parameters into flat buffers and points the optimizer at this rank's shards.
  void prepare_optimizer(torch::optim::Optimizer& optimizer);

  void before_forward();
  void after_forward();
  void before_backward(const at::Tensor& loss);
  /// The shard group's reduction, the average over the replicas, and the
  /// gradients' copy to the host twins under cpu_offload.
  void synchronize_gradients();
  /// The updated shards back in the parameters: gathered into every rank's
  /// full model, or (free_parameters) left for the next forward to gather.
  void after_optimizer_step();
  void zero_grad(torch::optim::Optimizer&);
  /// Gathers every unit for good and stops sharding: the model is whole on
  /// every rank again (Trainer::unwrap_model; every rank must call it).
  void unshard_permanently();

  /// The tensors the optimizer steps: this rank's shard of each bucket, or
  /// their host twins under cpu_offload (NOTE [CPU offload]).
  const std::vector<at::Tensor>& optimizer_parameters() const override {
    return offload_.enabled() ? offload_.parameters() : shards_;
  }
  /// This rank's parameter shards in device memory (the optimizer's own
  /// tensors unless cpu_offload), whose .grad are the reduced gradient shards.
  const std::vector<at::Tensor>& device_shards() const { return shards_; }
  /// Host-memory tensors the optimizer steps instead of device shards (empty without cpu_offload).
  const std::vector<at::Tensor>& offloaded_parameters() const { return offload_.parameters(); }

  // ------------------------------------------------------ checkpoint hooks
  /// Rank r of the shard group holds shard r of every bucket; of replicas
  /// holding the same shard, the first group's rank writes it.
  std::optional<ShardLayout> shard_layout() const override;
  void parameters_loaded() override;
  /// Under SHARDED_STATE_DICT a checkpoint holds this rank's shards
  /// (NOTE [Sharded checkpoints]); a load writes into them.
  std::optional<ShardedParameters> sharded_parameters() const override;
  std::optional<ShardedParameters> held_shards() const override;
  /// free_parameters: every unit gathered for a checkpoint (all ranks call
  /// it), then released; after a load, each rank's shards are taken from the
  /// loaded parameters. Otherwise the model is whole already.
  void gather_full_parameters() override;
  void release_full_parameters(FullParameters what) override;

  /// Each rank holds a shard of the gradients the optimizer sees; replicas
  /// hold equal shards, so the norm is the shard group's.
  NormReduction norm_reduction() { return {state_->comm, {}}; }
  /// Elements per bucket (without padding): the checkpoint's resharding map.
  std::vector<std::int64_t> bucket_numels() const;

  // ------------------------------------------------------------ introspection
  /// free_parameters' units (none otherwise).
  std::size_t unit_count() const;
  const std::string& unit_name(std::size_t u) const;
  bool unit_gathered(std::size_t u) const;
  /// Bytes of full (gathered) unit parameters this rank holds right now (free_parameters).
  std::int64_t gathered_bytes() const;
  /// The largest unit's full parameters, in bytes.
  std::int64_t largest_unit_bytes() const;

 private:
  void average_over_replicas();
  void attach_shard_gradients();
  void start_observing();
  void stop_observing();
  void back_to_meta();
  std::vector<std::pair<std::string, at::Tensor>> named_parameters_of(std::size_t b) const;
  void require_attached() const;
  void retire_launched();
  void launch(std::size_t b);
  comm::Communicator* replicate_group() { return hybrid ? &hybrid->second : nullptr; }

  ShardedSettings settings_;
  std::vector<at::Tensor> flat_;         // per bucket: (padded,) full parameters (freed between uses: free_parameters)
  std::vector<at::Tensor> shards_;       // per bucket: (shard,) this rank's parameters, stepped by the optimizer
  std::vector<at::Tensor> grad_shards_;  // per bucket: (shard,) the reduced gradient shard (shard_gradients)
  std::vector<at::Tensor> received_;     // on Gloo: (padded,) chunks from every rank, until summed
  std::vector<comm::Pending> work_;      // per bucket: its gradient collective in flight
  HostOffload offload_;
  std::shared_ptr<detail::ZeRO3State> units_;  // free_parameters only
  torch::nn::Module* model_ = nullptr;
  std::optional<std::uint64_t> observer_;  // at::CallbackHandle
  bool detached_ = false;
  std::optional<at::Device> materialize_on_;  // set for a model built on meta
};

}  // namespace accel::strategy

// The engine's code, compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdio>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>

#include "accel/comm/collectives.hpp"
#include "accel/comm/environment.hpp"
#include "accel/strategy/deferred_init.hpp"
#include "accel/strategy/module_tree.hpp"
#include "accel/strategy/parameter_units.hpp"
#include "accel/strategy/unit_checkpointing.hpp"

namespace accel::strategy {

namespace detail {
template <int Stage>
ShardedSettings sharded_settings(const ZeRO<Stage>& z) {
  ShardedSettings out;
  out.zero = ZeRO<3>{.bucket_cap_mb = z.bucket_cap_mb,
                     .first_bucket_cap_mb = z.first_bucket_cap_mb,
                     .find_unused_parameters = z.find_unused_parameters,
                     .auto_wrap_policy = z.auto_wrap_policy,
                     .min_num_params = z.min_num_params,
                     .transformer_layer_cls_to_wrap = z.transformer_layer_cls_to_wrap,
                     .activation_checkpointing = z.activation_checkpointing,
                     .cpu_offload = z.cpu_offload,
                     .state_dict_type = z.state_dict_type,
                     .reshard_after_forward = z.reshard_after_forward};
  out.shard_gradients = Stage >= 2;
  out.free_parameters = Stage == 3;
  out.strategy_name = Stage == 1 ? "ZeRO<1>" : Stage == 2 ? "ZeRO<2>" : "ZeRO<3>";
  return out;
}

// HybridShard's shard group: `requested` ranks, or (0) one machine's.
inline int shard_group_size_for(int requested, int world) {
  const int size = requested > 0 ? requested : comm::world_from_environment().local_world_size;
  if (size < 1 || world % size != 0)
    throw std::invalid_argument("accel HybridShard: shard groups of " + std::to_string(size) +
                                " ranks do not divide the world size " + std::to_string(world));
  return size;
}

// This rank's shard group (consecutive ranks) and replicate group (the
// ranks at the same place in every shard group).
inline std::pair<comm::Communicator, comm::Communicator> hybrid_groups(const comm::Communicator& world, int shard) {
  const int group = world.rank() / shard, place = world.rank() % shard;
  std::vector<int> shard_members, replica_members;
  for (int i = 0; i < shard; ++i) shard_members.push_back(group * shard + i);
  for (int g = 0; g < world.size() / shard; ++g) replica_members.push_back(g * shard + place);
  auto shard_group = world.subgroup("hybrid/shard/" + std::to_string(group), shard_members);
  auto replica_group = world.subgroup("hybrid/replicate/" + std::to_string(place), replica_members);
  return {std::move(shard_group), std::move(replica_group)};
}

inline std::optional<std::pair<comm::Communicator, comm::Communicator>> sharding_groups(const ShardedSettings& settings,
                                                                                       const comm::Communicator& world) {
  if (!settings.shard_group_size) return std::nullopt;
  return hybrid_groups(world, shard_group_size_for(*settings.shard_group_size, world.size()));
}

inline BucketSettings bucket_settings(const ShardedSettings& s, int shard_group_size) {
  return BucketSettings{.bucket_cap_mb = s.zero.bucket_cap_mb,
                        .first_bucket_cap_mb = s.zero.first_bucket_cap_mb,
                        .find_unused_parameters = s.zero.find_unused_parameters,
                        .pad_to_multiple = shard_group_size,
                        .strategy_name = s.strategy_name,
                        // A replicate group is HybridShard's, whose ZeRO settings are a member.
                        .find_unused_parameters_spelling =
                            s.shard_group_size ? "HybridShard{.zero = {.find_unused_parameters = true}}" : nullptr,
                        // ZeRO-3's buckets are its units (by optimizer group), whatever their size.
                        .size_capped = !s.free_parameters,
                        .lazy_gradients = s.shard_gradients,
                        .keep_step_buffers = s.free_parameters};
}
}  // namespace detail

static_assert(std::is_same_v<at::CallbackHandle, std::uint64_t>, "ShardedEngine::observer_ holds an at::CallbackHandle");

ACCEL_COMPILED_ONCE void ShardedEngine::check_world(const HybridShard& settings, int world_size) {
  detail::shard_group_size_for(settings.shard_group_size, world_size);
}

ACCEL_COMPILED_ONCE ShardedEngine::ShardedEngine(const ZeRO<1>& settings, comm::Communicator& comm)
    : ShardedEngine(detail::sharded_settings(settings), comm) {}
ACCEL_COMPILED_ONCE ShardedEngine::ShardedEngine(const ZeRO<2>& settings, comm::Communicator& comm)
    : ShardedEngine(detail::sharded_settings(settings), comm) {}
ACCEL_COMPILED_ONCE ShardedEngine::ShardedEngine(const ZeRO<3>& settings, comm::Communicator& comm)
    : ShardedEngine(detail::sharded_settings(settings), comm) {}
ACCEL_COMPILED_ONCE ShardedEngine::ShardedEngine(const HybridShard& settings, comm::Communicator& world)
    : ShardedEngine(
          [&] {
            auto s = detail::sharded_settings(settings.zero);
            s.shard_group_size = settings.shard_group_size;
            s.strategy_name = "HybridShard";
            return s;
          }(),
          world) {}

ACCEL_COMPILED_ONCE ShardedEngine::ShardedEngine(const ShardedSettings& settings, comm::Communicator& world)
    : detail::ShardingGroups{detail::sharding_groups(settings, world)},
      BucketedEngineBase(detail::bucket_settings(settings, hybrid ? hybrid->first.size() : world.size()),
                         hybrid ? hybrid->first : world),
      settings_(settings),
      offload_(settings.zero.cpu_offload) {
  static_assert(complete_engine<ShardedEngine>);
  const std::string name = settings.strategy_name;
  if (settings.free_parameters && !settings.shard_gradients)
    throw std::logic_error("accel " + name + ": freeing the parameters between uses needs sharded gradients");
  check_unit_checkpointing(settings.zero, name);
  if (!settings.free_parameters && settings.zero.state_dict_type == StateDictType::SHARDED_STATE_DICT)
    throw ConfigurationError("accel " + name +
                             ": state_dict_type SHARDED_STATE_DICT is for ZeRO<3> and HybridShard, which hold only "
                             "shards; this stage keeps the whole model on every rank and saves it whole "
                             "(FULL_STATE_DICT)");
  if (settings.free_parameters) {
#ifndef NDEBUG
    // LibTorch is built with NDEBUG; a debug build's RecordFunction::inputs()
    // asserts on a member that LibTorch never sets (a padding byte there).
    throw std::logic_error("accel " + name + ": build with -DNDEBUG (meson's release/debugoptimized with b_ndebug), "
                           "as LibTorch itself is built");
#endif
    units_ = std::make_shared<detail::ZeRO3State>(flat_, shards_);
    units_->comm = state_->comm;
    units_->pool = state_->step_buffers();
    units_->reshard_after_forward = settings.zero.reshard_after_forward;
  }
  state_->launch = [this](std::size_t b) { launch(b); };
  if (settings.shard_gradients) state_->before_allocating = [this] { retire_launched(); };
}

ACCEL_COMPILED_ONCE ShardedEngine::~ShardedEngine() {
  if (!units_) return;
  if (!detached_ && std::uncaught_exceptions() == 0 && !shards_.empty()) {
    if (units_->failure) {
      std::fprintf(stderr, "accel %s: the model stays sharded at shutdown: a collective of its training failed\n",
                   settings_.strategy_name);
    } else if (materialize_on_) {
      back_to_meta();
    } else {
      try {
        unshard_permanently();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "accel %s: could not gather the full model at shutdown: %s\n", settings_.strategy_name,
                     e.what());
      }
    }
  }
  stop_observing();
}

ACCEL_COMPILED_ONCE void ShardedEngine::prepare_model(torch::nn::Module& model) {
  if (units_ && model.parameters().empty())
    throw std::logic_error(std::string("accel ") + settings_.strategy_name + ": the model has no parameters");
  collect(model);  // equal within the shard group: its first rank's weights
  checkpoint_wrapped_units(model, settings_.zero, settings_.strategy_name);
  model_ = &model;
  // ... and across the replicas: the first group's (buffers too).
  if (auto* replicas = replicate_group())
    detail::broadcast_module_state(model, *replicas, "broadcast of the first replica's parameters at prepare");
}

ACCEL_COMPILED_ONCE void ShardedEngine::prepare_meta_model(torch::nn::Module& model, at::Device device) {
  if (!units_) return EngineDefaults::prepare_meta_model(model, device);  // refused: the whole model on every rank
  if (model.parameters().empty())
    throw std::logic_error(std::string("accel ") + settings_.strategy_name + ": the model has no parameters");
  deferred_init::check_materializable(model);  // every rank alike, before any collective
  collect(model, /*broadcast=*/false);
  agree_on_initialisers(model, *state_->comm, settings_.strategy_name);  // the shard group's first rank's generators
  if (auto* replicas = replicate_group()) agree_on_initialisers(model, *replicas, "HybridShard");  // ... and the first group's
  checkpoint_wrapped_units(model, settings_.zero, settings_.strategy_name);
  model_ = &model;
  materialize_on_ = device;
}

ACCEL_COMPILED_ONCE void ShardedEngine::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  auto& s = *state_;
  const std::string name = settings_.strategy_name;
  if (model_ == nullptr || s.params.empty())
    throw std::logic_error("accel " + name + ": prepare the model before (or with) the optimizer");
  if (!shards_.empty()) throw std::logic_error("accel " + name + ": prepare() takes one optimizer per Trainer");
  if (!optimizer.state().empty())
    throw std::logic_error("accel ZeRO: prepare the optimizer before its first step (its state would be lost)");
  auto& groups = optimizer.param_groups();
  auto group_of = [&](const at::Tensor& p) { return optimizer_group_of(groups, p); };
  if (units_) {
    std::vector<std::string> unit_names;
    std::vector<std::int64_t> numels;
    for (const auto& p : s.params) numels.push_back(p.numel());
    const auto& z = settings_.zero;
    const auto unit_of_param = assign_units(module_tree(*model_, s.params), numels, z.auto_wrap_policy,
                                            z.min_num_params, z.transformer_layer_cls_to_wrap, unit_names);
    // Buckets never straddle units or optimizer groups.
    plan_buckets(group_of, [&](std::size_t i) { return static_cast<int>(unit_of_param[i]); });
    units_->units.resize(unit_names.size());
    for (std::size_t u = 0; u < unit_names.size(); ++u) units_->units[u].name = unit_names[u];
    units_->root = unit_names.size() - 1;
  } else {
    plan_buckets(group_of);
  }
  const int world = s.comm->size(), rank = s.comm->rank();
  c10::NoGradGuard no_grad;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const auto& bucket = s.buckets[b];
    if (materialize_on_) deferred_init::materialize_each(named_parameters_of(b), *materialize_on_);  // this bucket's only
    at::Tensor flat = flatten_parameters(b);  // (padded,)
    const std::int64_t shard = bucket.padded / world;
    at::Tensor mine = flat.narrow(0, rank * shard, shard);
    flat_.push_back(flat);
    // Freed parameters: the shard has storage of its own, as the flat buffer comes and goes.
    shards_.push_back((units_ ? mine.clone() : mine.detach()).requires_grad_(true));
    if (settings_.shard_gradients) grad_shards_.push_back(at::zeros({shard}, flat.options()));
    if (units_) {
      // Built on meta: the unit's full parameters go before the next is computed.
      if (materialize_on_) detail::set_storage_bytes(flat.storage().unsafeGetStorageImpl(), 0);
      const auto u = static_cast<std::size_t>(bucket.unit);
      units_->unit_of_bucket.push_back(u);
      units_->units[u].buckets.push_back(b);
      units_->unit_of_storage[flat.storage().unsafeGetStorageImpl()] = u;
    }
  }
  // Built on meta: buffers and frozen parameters, which are not sharded, whole.
  if (materialize_on_) {
    deferred_init::materialize_each(deferred_init::meta_tensors_of(*model_), *materialize_on_);
    deferred_init::forget_replaced();  // the records of the storages just replaced
  }
  if (!settings_.shard_gradients) allocate_gradients();  // ZeRO-1's are kept; sharded ones exist only within backward
  attach_shard_gradients();
  offload_.attach(shards_);
  point_optimizer_at(groups, optimizer_parameters());
  if (units_) units_->reshard_all();
  work_.resize(s.buckets.size());
  received_.resize(s.buckets.size());
  register_hooks();
  if (units_) start_observing();
}

ACCEL_COMPILED_ONCE void ShardedEngine::before_forward() {
  if (!units_) return;
  require_attached();
  units_->owner = std::this_thread::get_id();  // whichever thread trains now
  units_->backward = false;
  units_->forward_order.clear();
  units_->current = SIZE_MAX;
}

ACCEL_COMPILED_ONCE void ShardedEngine::after_forward() {
  if (!units_ || detached_) return;  // unwrapped: the model stays whole
  units_->rethrow_failure();
  units_->last_forward_order = units_->forward_order;
  if (units_->reshard_after_forward) units_->reshard_all();  // else each unit goes once its backward is done
}

ACCEL_COMPILED_ONCE void ShardedEngine::before_backward(const at::Tensor& loss) {
  require_attached();
  if (shards_.empty())
    throw std::logic_error(std::string("accel ") + settings_.strategy_name +
                           ": no optimizer was prepared: call trainer.prepare(model, optimizer) first");
  if (units_) {
    units_->owner = std::this_thread::get_id();
    units_->rethrow_failure();
    if (units_->last_forward_order.empty()) units_->last_forward_order = units_->forward_order;
    units_->backward = true;
    for (auto& unit : units_->units) unit.launched = 0;
  }
  mark_unused_ready(loss);
}

ACCEL_COMPILED_ONCE void ShardedEngine::synchronize_gradients() {
  if (units_) units_->rethrow_failure();  // a gather of the backward failed
  wait_for_buckets(work_, [&](std::size_t b) {
    if (settings_.shard_gradients) finish_reduce_scatter(b, grad_shards_[b], received_[b]);
  });
  if (settings_.shard_gradients) {
    release_full_gradients();
    set_shards_hold_reduced(true);
  }
  if (units_) {
    units_->backward = false;
    units_->reshard_all();
  }
  average_over_replicas();
  offload_.gradients_to_host(shards_);  // the averaged shards, under cpu_offload
}

ACCEL_COMPILED_ONCE void ShardedEngine::average_over_replicas() {
  auto* replicas = replicate_group();
  if (replicas == nullptr || !replicas->distributed()) return;
  std::vector<comm::Pending> pending;
  for (auto& shard : shards_) {
    at::Tensor grad = shard.mutable_grad();
    grad.div_(replicas->size());
    pending.push_back(replicas->all_reduce_async(grad, "all-reduce of HybridShard gradient shards across replicas"));
  }
  for (auto& p : pending) p.wait();
}

ACCEL_COMPILED_ONCE void ShardedEngine::after_optimizer_step() {
  auto& s = *state_;
  offload_.parameters_to_device(shards_);
  if (units_ || !s.comm->distributed()) return;  // freed parameters: the next forward gathers the updated shards
  // In place, every bucket at once: each shard is its own row of the flat
  // parameters, and nothing is staged beside them (comm/collectives.hpp).
  std::vector<comm::Pending> gathers;
  for (std::size_t b = 0; b < flat_.size(); ++b)
    for (auto& g : comm::all_gather_rows_async(*s.comm, flat_[b],
                                               "all-gather of ZeRO parameter bucket " + std::to_string(b)))
      gathers.push_back(std::move(g));
  for (auto& g : gathers) g.wait();
}

ACCEL_COMPILED_ONCE void ShardedEngine::zero_grad(torch::optim::Optimizer&) {
  offload_.zero_grad();
  if (!settings_.shard_gradients) {
    for (auto& bucket : state_->buckets) bucket.grad.zero_();
    state_->attach_grad_views();
    return;
  }
  for (auto& g : grad_shards_) g.zero_();
  set_shards_hold_reduced(false);
  if (units_) return;
  for (auto& bucket : state_->buckets)  // those a no_sync micro-step left
    if (bucket.grad.defined()) bucket.grad.zero_();
  state_->attach_grad_views();
}

ACCEL_COMPILED_ONCE void ShardedEngine::unshard_permanently() {
  if (!units_ || detached_) return;
  units_->rethrow_failure();
  {
    detail::BusyScope busy;
    units_->reshard_all();  // a unit gathered into the pool (mid-step) is gathered again into memory of its own
  }
  // No step follows (unwrap_model, the destructor): the whole model takes the
  // idle step buffers' memory instead of adding to it (under the host block
  // cache, the units fit the ranges they free). Kept, they raised ZeRO-3's
  // resident peak at the Trainer's end by the units they hold, above its
  // steps' (bench/memory_peaks.sh, 3 ranks: 555 -> 485 MiB). A checkpoint's
  // gather keeps them: the next step takes them as they are.
  if (auto* pool = state_->step_buffers()) pool->release_idle();
  gather_full_parameters();
  stop_observing();
  detached_ = true;
}

ACCEL_COMPILED_ONCE std::optional<ShardLayout> ShardedEngine::shard_layout() const {
  return ShardLayout{state_->comm->size(), state_->comm->rank(), !hybrid || hybrid->second.rank() == 0,
                     bucket_numels()};
}

ACCEL_COMPILED_ONCE std::vector<std::int64_t> ShardedEngine::bucket_numels() const {
  std::vector<std::int64_t> out;
  for (const auto& bucket : state_->buckets) out.push_back(bucket.numel);
  return out;
}

ACCEL_COMPILED_ONCE void ShardedEngine::parameters_loaded() {
  if (units_) units_->reshard_all();  // a full parameter buffer gathered before the load holds the old values
  offload_.parameters_from_device(shards_);
}

ACCEL_COMPILED_ONCE std::optional<ShardedParameters> ShardedEngine::sharded_parameters() const {
  if (settings_.zero.state_dict_type != StateDictType::SHARDED_STATE_DICT) return std::nullopt;
  return held_shards();
}

ACCEL_COMPILED_ONCE std::optional<ShardedParameters> ShardedEngine::held_shards() const {
  if (!units_) return std::nullopt;  // every rank holds the whole model
  return ShardedParameters{flat_buckets(), shards_, model_};
}

ACCEL_COMPILED_ONCE void ShardedEngine::gather_full_parameters() {
  if (!units_) return;
  units_->rethrow_failure();
  detail::BusyScope busy;
  for (std::size_t u = 0; u < units_->units.size(); ++u) units_->unshard_now(u, /*for_good=*/true);
  units_->held = true;
}

ACCEL_COMPILED_ONCE void ShardedEngine::release_full_parameters(FullParameters what) {
  if (!units_) return;
  detail::BusyScope busy;
  units_->held = false;
  if (what == FullParameters::loaded) {
    c10::NoGradGuard no_grad;
    for (std::size_t b = 0; b < shards_.size(); ++b) {
      const std::int64_t shard = shards_[b].numel();
      shards_[b].copy_(flat_[b].narrow(0, state_->comm->rank() * shard, shard));
    }
  }
  units_->reshard_all();
}

ACCEL_COMPILED_ONCE std::size_t ShardedEngine::unit_count() const { return units_ ? units_->units.size() : 0; }
ACCEL_COMPILED_ONCE const std::string& ShardedEngine::unit_name(std::size_t u) const {
  if (!units_) throw std::out_of_range("accel ShardedEngine: no units (the parameters are not freed between uses)");
  return units_->units.at(u).name;
}
ACCEL_COMPILED_ONCE bool ShardedEngine::unit_gathered(std::size_t u) const {
  return units_ && units_->units.at(u).state == detail::UnitState::unsharded;
}

ACCEL_COMPILED_ONCE std::int64_t ShardedEngine::gathered_bytes() const {
  if (!units_) return 0;
  std::int64_t total = 0;
  for (const auto& f : flat_) total += static_cast<std::int64_t>(f.storage().nbytes());
  return total;
}

ACCEL_COMPILED_ONCE std::int64_t ShardedEngine::largest_unit_bytes() const {
  if (!units_) return 0;
  std::int64_t largest = 0;
  for (const auto& unit : units_->units) {
    std::int64_t sum = 0;
    for (auto b : unit.buckets) sum += static_cast<std::int64_t>(units_->bytes(b));
    largest = std::max(largest, sum);
  }
  return largest;
}

ACCEL_COMPILED_ONCE void ShardedEngine::attach_shard_gradients() {
  auto& s = *state_;
  for (std::size_t b = 0; b < shards_.size(); ++b) {
    if (settings_.shard_gradients) {
      shards_[b].mutable_grad() = grad_shards_[b];
    } else {  // a view of the all-reduced bucket
      const std::int64_t shard = shards_[b].numel();
      shards_[b].mutable_grad() = s.buckets[b].grad.narrow(0, s.comm->rank() * shard, shard);
    }
  }
}

ACCEL_COMPILED_ONCE void ShardedEngine::start_observing() {
  units_->owner = std::this_thread::get_id();
  {
    auto& registry = detail::zero3_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    registry.states.push_back(units_.get());
  }
  observer_ = at::addGlobalCallback(at::RecordFunctionCallback(&detail::zero3_observe).needsInputs(true));
}

ACCEL_COMPILED_ONCE void ShardedEngine::stop_observing() {
  if (observer_) at::removeCallback(*observer_);
  observer_.reset();
  auto& registry = detail::zero3_registry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  std::erase(registry.states, units_.get());
}

ACCEL_COMPILED_ONCE void ShardedEngine::back_to_meta() {
  detail::BusyScope busy;
  c10::NoGradGuard no_grad;
  for (auto& p : state_->params) {
    p.mutable_grad() = at::Tensor();
    deferred_init::return_to_meta(p);
  }
}

ACCEL_COMPILED_ONCE auto ShardedEngine::named_parameters_of(std::size_t b) const
    -> std::vector<std::pair<std::string, at::Tensor>> {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto i : state_->buckets[b].params) out.emplace_back(state_->names[i], state_->params[i]);
  return out;
}

ACCEL_COMPILED_ONCE void ShardedEngine::require_attached() const {
  if (detached_)
    throw std::logic_error(std::string("accel ") + settings_.strategy_name +
                           ": the model was unwrapped (unwrap_model): training with this trainer is over");
}

// Lazy buckets: the launched ones' reduce-scatters landed, summed, their full gradients dropped.
ACCEL_COMPILED_ONCE void ShardedEngine::retire_launched() {
  retire_launched_buckets(work_, [&](std::size_t b) { finish_reduce_scatter(b, grad_shards_[b], received_[b]); });
}

ACCEL_COMPILED_ONCE void ShardedEngine::launch(std::size_t b) {
  auto& s = *state_;
  auto& grad = s.buckets[b].grad;
  const std::string what = std::string(settings_.shard_gradients ? "reduce-scatter" : "all-reduce") + " of " +
                           settings_.strategy_name + " gradient bucket " + std::to_string(b) + " (" +
                           std::to_string(grad.numel() * grad.element_size()) + " bytes)";
  if (!settings_.shard_gradients) {
    pre_divide(grad);
    work_[b] = s.comm->all_reduce_async(grad, what);
    return;
  }
  // Before this bucket's collective allocates its buffers (NOTE [Gradient buckets]).
  retire_launched();
  if (units_) {
    // The unit's gradients are complete: its backward is over, free its
    // parameters (first, for the same reason).
    const std::size_t u = units_->unit_of_bucket[b];
    if (++units_->units[u].launched == units_->units[u].buckets.size()) {
      detail::BusyScope busy;
      units_->reshard(u);
    }
  }
  pre_divide(grad);
  work_[b] = reduce_scatter_bucket(b, grad_shards_[b], received_[b], what);
}

}  // namespace accel::strategy
#endif  // ACCEL_DEFINE_COMPILED_ONCE
