#pragma once
// The engine contract: what the Trainer may ask of a strategy's engine.
//
// NOTE [Engine contract]
// A strategy tag names its engine (`S::engine<Precision, Device>`); the
// Trainer talks to that engine only through the members below, called
// unconditionally, never probed with `requires`: a missing piece is a compile
// error at the engine, not a silent no-op at run time.
//   Required of every engine (concept `engine`):
//     settings_type, shards_optimizer_state,
//     prepare_model, prepare_optimizer, before_backward, synchronize_gradients,
//     after_optimizer_step, set_gradient_sync, zero_grad, optimizer_parameters;
//     and the engine the Trainer holds is `final` (concept complete_engine).
//   Checkpoint hooks (class CheckpointHooks, the one list of them: the
//   checkpoint code, compiled once, calls them through it):
//     shard_layout() (set exactly when shards_optimizer_state: how many
//     shards, which one is this rank's, the bucket sizes a checkpoint needs
//     to reshard), the model part this rank holds, the full-parameter life
//     cycle, a sharded checkpoint's parameters, optimizer_parameters.
//   Customisation points, with the defaults EngineDefaults documents below:
//     forward hooks, the groups of a mesh, gradient-norm reduction, the idle
//     step buffers,
//     the pipelined step, cpu_offload's host tensors.
// An engine that wraps another (HybridShard around ZeRO-3, Parallel around
// its data engine) derives from ForwardingEngine, which forwards the inner
// engine's customisation points (all but the mesh groups, the pipelined
// step and preparing a model built on meta, which only the outermost engine
// can do): a point added here is added
// there too, and wrappers forward it without anyone remembering to.

#include <ATen/core/Tensor.h>

#include <concepts>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "accel/comm/communicator.hpp"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace accel::strategy {

/// How a sharded engine cuts the optimizer's state over ranks.
struct ShardLayout {
  int count = 1;  ///< shards the state is cut into
  int rank = 0;   ///< the shard this rank holds
  /// Whether this rank writes its shard to a checkpoint (replicas holding
  /// the same shard, HybridShard's other groups, do not).
  bool writer = true;
  /// Elements per bucket before padding: the map for resharding.
  std::vector<std::int64_t> bucket_numels;
};

/// Which part of the model this rank holds: tensor and pipeline parallelism
/// cut the model into parts, data-parallel replicas hold the same part.
struct ModelPart {
  int index = 0;
  int count = 1;
  /// Whether this rank writes the part to a checkpoint (its first replica).
  bool writer = true;
  /// How the model is cut, to name it when a checkpoint's cut differs.
  std::string layout = "whole";
  /// The pipeline's stages: each holds other layers (tensor ranks hold
  /// slices of the same layers).
  int pipeline_stages = 1;
  /// Under a pipeline, this rank's stage: the module its engine prepared,
  /// the same layer objects as the model's, under the stage's own names.
  /// nullptr where this rank holds every layer.
  torch::nn::Module* stage = nullptr;

  /// This rank's coordinate along the tensor-parallel cut.
  int tensor_index() const { return index % (count / pipeline_stages); }
};

/// Which ranks' gradient-norm contributions make up the global norm.
struct NormReduction {
  /// Reduce the partial norms over this group (nullptr: every rank already
  /// holds every gradient, the local norm is the global one).
  comm::Communicator* group = nullptr;
  /// Per optimizer parameter, a 0/1 mask (a scalar, or one per element)
  /// that excludes what an equal copy on another rank counts already (a
  /// replica). Empty: everything counted.
  std::vector<at::Tensor> masks;
};

/// Where one parameter lies in a flat bucket (NOTE [ZeRO shards]).
struct FlatParameter {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;
};
/// A flat bucket: its real and padded sizes, and its parameters.
struct FlatBucket {
  std::int64_t numel = 0;
  std::int64_t padded = 0;
  std::vector<FlatParameter> parameters;
};
/// What a sharded checkpoint holds of this rank (NOTE [Sharded checkpoints]):
/// the buckets' plan and this rank's shard of each (the engine's own
/// tensors: a load writes into them), and the module the engine prepared,
/// whose names the plan uses (a pipeline stage's, not the whole model's).
struct ShardedParameters {
  std::vector<FlatBucket> buckets;
  std::vector<at::Tensor> shards;
  torch::nn::Module* module = nullptr;
};

/// Whether the full parameters, gathered for a checkpoint, were overwritten
/// (a load: each rank's shard must be taken from them) or only read.
enum class FullParameters { unchanged, loaded };

/// The engine's part in a checkpoint, with the defaults of an engine that
/// holds the whole model on every rank. Virtual: save_state, load_state and
/// save_model are compiled once and reach every engine through it (the leaf
/// engines are `final`, so the Trainer's own calls are direct).
class CheckpointHooks {
 public:
  virtual ~CheckpointHooks() = default;
  /// How the optimizer state is cut over ranks; empty where it is replicated.
  virtual std::optional<ShardLayout> shard_layout() const { return std::nullopt; }
  /// The tensors the optimizer steps (a sharded engine's shards).
  virtual const std::vector<at::Tensor>& optimizer_parameters() const = 0;
  /// Default: every rank holds the whole model; the world's rank 0 writes it.
  virtual ModelPart model_part(const comm::Communicator& world) const { return {0, 1, world.rank() == 0, "whole"}; }
  /// Checkpoints: every rank calls gather, then release; the full model is in
  /// the prepared module between them. Default: it always is.
  virtual void gather_full_parameters() {}
  virtual void release_full_parameters(FullParameters) {}
  /// The model's parameters were overwritten (a checkpoint was loaded).
  virtual void parameters_loaded() {}
  /// Checkpoints hold this rank's shards instead of the whole model
  /// (SHARDED_STATE_DICT). Default: none, the model is saved whole.
  virtual std::optional<ShardedParameters> sharded_parameters() const { return std::nullopt; }
  /// This rank's shards whatever the checkpoint setting (save_model writes
  /// from them). Default: none, every rank holds the whole model.
  virtual std::optional<ShardedParameters> held_shards() const { return std::nullopt; }

 protected:
  CheckpointHooks() = default;
  CheckpointHooks(const CheckpointHooks&) = default;
  CheckpointHooks& operator=(const CheckpointHooks&) = default;
  CheckpointHooks(CheckpointHooks&&) = default;
  CheckpointHooks& operator=(CheckpointHooks&&) = default;
};

/// The customisation points' defaults, for an engine that needs nothing
/// there: it derives from this and hides what it implements.
class EngineDefaults : public CheckpointHooks {
 public:
  /// Checked before any rank connects, so every rank fails alike and at once.
  template <class Settings>
  static void check_world(const Settings&, int /*world_size*/) {}
  /// A model built by device::build_on_meta (NOTE [Models built on meta]),
  /// its values still to come, prepared to train on `device`. Default:
  /// refused, as this engine keeps the whole model on every rank.
  void prepare_meta_model(torch::nn::Module&, at::Device) {
    throw std::logic_error(
        "accel: the model was built on the meta device (accel::device::build_on_meta); only ZeRO<3> and HybridShard "
        "compute its parameters shard by shard. This strategy keeps the whole model on every rank: call "
        "accel::device::materialize(model) before prepare, or build the model normally");
  }
  /// Around the user's forward pass (ZeRO-3 gathers and frees parameters there).
  void before_forward() {}
  void after_forward() {}
  /// unwrap_model: the model whole on every rank, for good.
  void unshard_permanently() {}
  /// cpu_offload's host tensors the optimizer steps, and the device shards they mirror.
  const std::vector<at::Tensor>& offloaded_parameters() const { return none(); }
  const std::vector<at::Tensor>& device_shards() const { return none(); }
  /// Default: the local gradient norm is the global one.
  NormReduction norm_reduction() { return {}; }
  /// Host memory kept for the step's buffers and unused now (NOTE [Buffers
  /// that live as long as the engine]). Default: none kept.
  std::int64_t idle_buffer_bytes() const { return 0; }
  /// The ranks that read different data, and the group tensor-parallel
  /// layers use (nullptr: the world, and one rank).
  comm::Communicator* data_group() { return nullptr; }
  comm::Communicator* tensor_group() { return nullptr; }
  /// Pipeline parallelism runs its own schedule of forwards and backwards.
  bool pipelined() const { return false; }
  template <class LossFn>
  double pipeline_step(const at::Tensor&, const at::Tensor&, LossFn&&, double /*loss_multiplier*/, bool /*sync*/) {
    throw std::logic_error("accel: pipeline_step on an engine without pipeline parallelism");
  }

 protected:
  static const std::vector<at::Tensor>& none() {
    static const std::vector<at::Tensor> empty;
    return empty;
  }
};

/// What every engine provides.
template <class E>
concept engine = std::derived_from<E, EngineDefaults> &&
                 requires(E& e, const E& ce, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const at::Tensor& loss) {
                   typename E::settings_type;
                   { E::shards_optimizer_state } -> std::convertible_to<bool>;
                   e.prepare_model(model);
                   e.prepare_optimizer(optimizer);
                   e.before_backward(loss);
                   e.synchronize_gradients();
                   e.after_optimizer_step();
                   e.set_gradient_sync(true);
                   e.zero_grad(optimizer);
                   { ce.optimizer_parameters() } -> std::same_as<const std::vector<at::Tensor>&>;
                 };

/// An engine whose optimizer state is cut over ranks (its shard_layout()
/// says how).
template <class E>
concept sharded_engine = engine<E> && E::shards_optimizer_state;

/// The check every engine passes where it is defined: the contract, and
/// nothing more can be derived from it (the `final` leaf that Trainer holds).
template <class E>
concept complete_engine = engine<E> && std::is_final_v<E>;

/// The customisation points of an engine that wraps `Inner`, forwarded to it.
/// The wrapper constructs `inner_` and overrides what it changes.
template <class Inner>
class ForwardingEngine : public EngineDefaults {
 public:
  template <class... Args>
  explicit ForwardingEngine(Args&&... args) : inner_(std::forward<Args>(args)...) {}

  // The checkpoint hooks (`override`: one whose signature changes there fails to compile here).
  std::optional<ShardLayout> shard_layout() const override { return inner_.shard_layout(); }
  const std::vector<at::Tensor>& optimizer_parameters() const override { return inner_.optimizer_parameters(); }
  ModelPart model_part(const comm::Communicator& world) const override { return inner_.model_part(world); }
  void gather_full_parameters() override { inner_.gather_full_parameters(); }
  void release_full_parameters(FullParameters what) override { inner_.release_full_parameters(what); }
  void parameters_loaded() override { inner_.parameters_loaded(); }
  std::optional<ShardedParameters> sharded_parameters() const override { return inner_.sharded_parameters(); }
  std::optional<ShardedParameters> held_shards() const override { return inner_.held_shards(); }

  void before_forward() { inner_.before_forward(); }
  void after_forward() { inner_.after_forward(); }
  void unshard_permanently() { inner_.unshard_permanently(); }
  const std::vector<at::Tensor>& offloaded_parameters() const { return inner_.offloaded_parameters(); }
  const std::vector<at::Tensor>& device_shards() const { return inner_.device_shards(); }
  NormReduction norm_reduction() { return inner_.norm_reduction(); }
  std::int64_t idle_buffer_bytes() const { return inner_.idle_buffer_bytes(); }

  void prepare_optimizer(torch::optim::Optimizer& optimizer) { inner_.prepare_optimizer(optimizer); }
  void before_backward(const at::Tensor& loss) { inner_.before_backward(loss); }
  void synchronize_gradients() { inner_.synchronize_gradients(); }
  void after_optimizer_step() { inner_.after_optimizer_step(); }
  void set_gradient_sync(bool sync) { inner_.set_gradient_sync(sync); }
  void zero_grad(torch::optim::Optimizer& optimizer) { inner_.zero_grad(optimizer); }

 protected:
  Inner inner_;
};

}  // namespace accel::strategy
