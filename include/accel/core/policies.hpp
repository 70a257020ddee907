#pragma once
// The policy tags a user puts in `accel::Trainer<Strategy, Precision, Device>`.
// Each is a small aggregate carrying its settings, so a user can write
// `Trainer<DDP> t{DDP{.bucket_cap_mb = 50}}`. No LibTorch here: this header
// compiles in well under a second.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "accel/core/fwd.hpp"

namespace accel {

// ---------------------------------------------------------------- strategies

/// One process, no communication: the hand-written LibTorch loop.
struct SingleProcess {
  template <class Precision, class Device>
  using engine = strategy::SingleProcessEngine<Precision, Device>;
  static constexpr bool distributed = false;
};

/// Precision of the gradient all-reduce (Accelerate's DDP communication
/// hooks): compress to fp16/bf16 on the wire, average, decompress.
enum class CommHook { none, fp16, bf16 };

/// Data parallel: every rank holds the whole model; gradients are averaged
/// with bucketed all-reduces that overlap backward (PyTorch's Reducer).
///   accel::Trainer<accel::DDP> t{accel::DDP{.bucket_cap_mb = 50}};
struct DDP {
  double bucket_cap_mb = 25.0;       ///< cap of every bucket after the first
  double first_bucket_cap_mb = 1.0;  ///< small first bucket: communication starts early
  /// Parameters that get no gradient in a step are found by walking the
  /// autograd graph from the loss (as PyTorch does); without it such a
  /// parameter is an error that names it.
  bool find_unused_parameters = false;
  /// The set of used parameters never changes: walk the graph once, on the
  /// first step, and reuse the answer.
  bool static_graph = false;
  /// Send gradients as fp16 or bf16 (halves the bytes; bf16 needs a backend
  /// that reduces bf16: NCCL, not the Gloo of LibTorch 1.13).
  CommHook comm_hook = CommHook::none;

  template <class Precision, class Device>
  using engine = strategy::DDPEngine<Precision, Device>;
  static constexpr bool distributed = true;
  static constexpr const char* fsdp_sharding_strategy = "NO_SHARD";
};

/// How ZeRO<3> (FSDP FULL_SHARD) groups parameters into units, each gathered
/// whole just before it is used and freed after (Accelerate's fsdp_auto_wrap_policy).
enum class AutoWrapPolicy {
  NO_WRAP,                 ///< the whole model is one unit
  SIZE_BASED_WRAP,         ///< every submodule with at least min_num_params not yet wrapped
  TRANSFORMER_BASED_WRAP,  ///< every submodule whose class is in transformer_layer_cls_to_wrap
};

/// The policy of one of Accelerate's fsdp_auto_wrap_policy names; none for another.
inline std::optional<AutoWrapPolicy> auto_wrap_policy_named(std::string_view name) {
  if (name == "NO_WRAP") return AutoWrapPolicy::NO_WRAP;
  if (name == "SIZE_BASED_WRAP") return AutoWrapPolicy::SIZE_BASED_WRAP;
  if (name == "TRANSFORMER_BASED_WRAP") return AutoWrapPolicy::TRANSFORMER_BASED_WRAP;
  return std::nullopt;
}

/// What save_state writes of a ZeRO<3> / HybridShard model (Accelerate's
/// fsdp_state_dict_type): the model whole, gathered unit by unit and written
/// by one rank, or each rank's shard and an index, never whole on any rank
/// (NOTE [Sharded checkpoints]; `accel merge-weights` joins them offline).
enum class StateDictType {
  FULL_STATE_DICT,
  SHARDED_STATE_DICT,
};

/// The type of one of Accelerate's fsdp_state_dict_type names; none for another.
inline std::optional<StateDictType> state_dict_type_named(std::string_view name) {
  if (name == "FULL_STATE_DICT") return StateDictType::FULL_STATE_DICT;
  if (name == "SHARDED_STATE_DICT") return StateDictType::SHARDED_STATE_DICT;
  return std::nullopt;
}

/// ZeRO data parallelism (DeepSpeed's stages; FSDP's SHARD_GRAD_OP is stage 2
/// and FULL_SHARD stage 3): stage 1 shards the optimizer state over the
/// ranks, stage 2 the gradients too, stage 3 the parameters too. Works with
/// any elementwise torch::optim optimizer (SGD, Adam, AdamW, RMSprop, ...).
///   accel::Trainer<accel::ZeRO<2>> trainer;
///   accel::Trainer<accel::ZeRO<3>> t{accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP,
///                                                  .min_num_params = 1'000'000}};
template <int Stage>
struct ZeRO {
  static_assert(Stage >= 1 && Stage <= 3, "accel: ZeRO stages are 1, 2 and 3");
  double bucket_cap_mb = 25.0;        ///< stages 1 and 2: gradient bucket size
  double first_bucket_cap_mb = 1.0;
  bool find_unused_parameters = false;
  /// Stage 3's units; at any stage, the units activation_checkpointing checkpoints.
  AutoWrapPolicy auto_wrap_policy = AutoWrapPolicy::NO_WRAP;
  std::int64_t min_num_params = 100'000'000;                 ///< SIZE_BASED_WRAP
  std::vector<std::string> transformer_layer_cls_to_wrap{};  ///< TRANSFORMER_BASED_WRAP, e.g. {"BlockImpl"}
  /// Every unit of the auto-wrap policy runs under accel::nn::checkpoint, its
  /// activations recomputed in backward (Accelerate's
  /// fsdp_activation_checkpointing; NOTE [Checkpointing wrapped units]: a
  /// unit is reached through the torch::nn::Sequential entry that holds it).
  bool activation_checkpointing = false;
  /// The optimizer steps host-memory twins of this rank's shards, so its
  /// state never occupies the device (NOTE [CPU offload]); Accelerate's
  /// fsdp_offload_params, DeepSpeed's offload_optimizer_device: cpu.
  bool cpu_offload = false;
  /// Stage 3: what a checkpoint holds of the model. Stages 1 and 2 keep the
  /// whole model on every rank and save it whole (SHARDED_STATE_DICT is refused).
  StateDictType state_dict_type = StateDictType::FULL_STATE_DICT;

  static constexpr int stage = Stage;
  template <class Precision, class Device>
  using engine = strategy::ZeROEngine<Stage, Precision, Device>;
  static constexpr bool distributed = true;
  /// FSDP's name for this stage (ZeRO-1 has none).
  static constexpr const char* fsdp_sharding_strategy =
      Stage == 3 ? "FULL_SHARD" : Stage == 2 ? "SHARD_GRAD_OP" : nullptr;
};

/// FSDP's HYBRID_SHARD: ZeRO-3 within groups of `shard_group_size`
/// consecutive ranks (0: one machine's ranks, LOCAL_WORLD_SIZE), replicated
/// across the groups, whose gradient shards are then averaged: the
/// all-gathers stay on a machine, only the gradient all-reduce crosses.
///   accel::Trainer<accel::HybridShard> t{accel::HybridShard{.shard_group_size = 8}};
struct HybridShard {
  ZeRO<3> zero{};
  int shard_group_size = 0;

  template <class Precision, class Device>
  using engine = strategy::HybridShardEngine<Precision, Device>;
  static constexpr bool distributed = true;
  static constexpr const char* fsdp_sharding_strategy = "HYBRID_SHARD";
};

/// FSDP's names for the same strategies (Accelerate's fsdp_sharding_strategy).
enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD };

namespace detail {
template <ShardingStrategy S>
struct fsdp_policy {
  using type = ZeRO<3>;
};
template <>
struct fsdp_policy<ShardingStrategy::HYBRID_SHARD> { using type = HybridShard; };
template <>
struct fsdp_policy<ShardingStrategy::SHARD_GRAD_OP> { using type = ZeRO<2>; };
template <>
struct fsdp_policy<ShardingStrategy::NO_SHARD> { using type = DDP; };
}  // namespace detail

///   accel::Trainer<accel::FSDP<accel::ShardingStrategy::FULL_SHARD>>  // = Trainer<ZeRO<3>>
template <ShardingStrategy S>
using FSDP = typename detail::fsdp_policy<S>::type;

/// Pipeline schedules (NOTE [Pipeline schedules] in pipeline/pipeline.hpp).
enum class PipelineSchedule {
  gpipe,
  one_f_one_b,
  interleaved_one_f_one_b,  ///< Megatron-LM's: virtual_stages chunks of the model per rank
};

/// Data x tensor x pipeline parallelism on a device mesh (Megatron-LM's
/// composition): `data` is the strategy over the data dimension (DDP or
/// ZeRO<1|2>), whose size is what is left of the world:
///   accel::Trainer<accel::Parallel<>> t{accel::Parallel<>{.tensor = 2}};                 // data x tensor
///   accel::Trainer<accel::Parallel<accel::ZeRO<1>>> t{{.pipeline = 2, .micro_batches = 4}};  // data x pipeline
/// Build the model's tensor-parallel layers on `trainer.tensor_group()`; a
/// pipeline needs a torch::nn::Sequential and `trainer.step(inputs, targets, loss_fn)`.
template <class Data = DDP>
struct Parallel {
  Data data{};
  int tensor = 1;
  int pipeline = 1;
  int micro_batches = 1;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  /// Chunks of the model per pipeline rank, with schedule = interleaved_one_f_one_b
  /// (Megatron-LM's virtual pipeline stages): the bubble shrinks by this factor.
  int virtual_stages = 1;

  template <class Precision, class Device>
  using engine = strategy::ParallelEngine<Data, Precision, Device>;
  static constexpr bool distributed = true;
};

// ---------------------------------------------------------------- precision

/// Full precision: no autocast, no loss scaling.
struct FP32 {
  static constexpr const char* name = "no";  // Accelerate's `mixed_precision` value
};

/// bfloat16 autocast for the forward; fp32 master weights and optimizer state.
struct BF16 {
  static constexpr const char* name = "bf16";
};

/// float16 autocast with dynamic loss scaling (PyTorch GradScaler's defaults).
struct FP16 {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  static constexpr const char* name = "fp16";
};

// ---------------------------------------------------------------- devices

/// Host memory and CPU kernels; Gloo for collectives.
struct CPU {
  static constexpr const char* name = "cpu";
};

/// The rank's local GPU (`LOCAL_RANK`); NCCL for collectives.
struct CUDA {
  static constexpr const char* name = "cuda";
};

}  // namespace accel
