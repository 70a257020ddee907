#pragma once
// The policy tags a user puts in `accel::Trainer<Strategy, Precision, Device>`.
// Each is a small aggregate carrying its settings, so a user can write
// `Trainer<DDP> t{DDP{.bucket_cap_mb = 50}}`. No LibTorch here: this header
// compiles in well under a second.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "accel/core/fwd.hpp"

namespace accel {

// ---------------------------------------------------------------- Accelerate's names

/// One of Accelerate's names for a setting's value. Each FSDP setting has
/// one table of them, below its enum: the policies, the ranks' reading of
/// the launcher's FSDP_* variables, and the command line (flags, the config
/// wizard, the estimator) all read that table, so no name is spelled twice.
template <class Enum>
struct Named {
  std::string_view name;
  Enum value;
};

/// The value a table gives `name`; none if it has no such name.
template <class Enum, std::size_t N>
constexpr std::optional<Enum> value_named(const std::array<Named<Enum>, N>& table, std::string_view name) {
  for (const auto& entry : table)
    if (entry.name == name) return entry.value;
  return std::nullopt;
}
/// The name a table gives `value`.
template <class Enum, std::size_t N>
constexpr std::string_view name_of(const std::array<Named<Enum>, N>& table, Enum value) {
  for (const auto& entry : table)
    if (entry.value == value) return entry.name;
  return {};
}
/// The names of a table, in its order (the command line's choices).
template <class Enum, std::size_t N>
std::vector<std::string> names_in(const std::array<Named<Enum>, N>& table) {
  std::vector<std::string> out;
  for (const auto& entry : table) out.emplace_back(entry.name);
  return out;
}
/// "A, B or C", for a sentence that says what is accepted.
template <class Enum, std::size_t N>
std::string one_of(const std::array<Named<Enum>, N>& table) {
  std::string out;
  for (std::size_t i = 0; i < N; ++i)
    out += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::string(table[i].name);
  return out;
}

/// FSDP's names for accel's data-parallel strategies (Accelerate's
/// fsdp_sharding_strategy; its 1-4 numbering is this order).
enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD };
inline constexpr std::array<Named<ShardingStrategy>, 4> sharding_strategy_names{{
    {"FULL_SHARD", ShardingStrategy::FULL_SHARD},
    {"SHARD_GRAD_OP", ShardingStrategy::SHARD_GRAD_OP},
    {"NO_SHARD", ShardingStrategy::NO_SHARD},
    {"HYBRID_SHARD", ShardingStrategy::HYBRID_SHARD},
}};

// ---------------------------------------------------------------- strategies

/// One process, no communication: the hand-written LibTorch loop.
struct SingleProcess {
  using engine = strategy::SingleProcessEngine;
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

  using engine = strategy::DDPEngine;
  static constexpr bool distributed = true;
};

/// How ZeRO<3> (FSDP FULL_SHARD) groups parameters into units, each gathered
/// whole just before it is used and freed after (Accelerate's fsdp_auto_wrap_policy).
enum class AutoWrapPolicy {
  NO_WRAP,                 ///< the whole model is one unit
  SIZE_BASED_WRAP,         ///< every submodule with at least min_num_params not yet wrapped
  TRANSFORMER_BASED_WRAP,  ///< every submodule whose class is in transformer_layer_cls_to_wrap
};

/// Accelerate's fsdp_auto_wrap_policy names, in the order its wizard offers them.
inline constexpr std::array<Named<AutoWrapPolicy>, 3> auto_wrap_policy_names{{
    {"TRANSFORMER_BASED_WRAP", AutoWrapPolicy::TRANSFORMER_BASED_WRAP},
    {"SIZE_BASED_WRAP", AutoWrapPolicy::SIZE_BASED_WRAP},
    {"NO_WRAP", AutoWrapPolicy::NO_WRAP},
}};
/// The policy of one of Accelerate's fsdp_auto_wrap_policy names; none for another.
constexpr std::optional<AutoWrapPolicy> auto_wrap_policy_named(std::string_view name) {
  return value_named(auto_wrap_policy_names, name);
}

/// What save_state writes of a ZeRO<3> / HybridShard model (Accelerate's
/// fsdp_state_dict_type): the model whole, gathered unit by unit and written
/// by one rank, or each rank's shard and an index, never whole on any rank
/// (NOTE [Sharded checkpoints]; `accel merge-weights` joins them offline).
enum class StateDictType {
  FULL_STATE_DICT,
  SHARDED_STATE_DICT,
};

/// Accelerate's fsdp_state_dict_type names (LOCAL_STATE_DICT has no counterpart).
inline constexpr std::array<Named<StateDictType>, 2> state_dict_type_names{{
    {"FULL_STATE_DICT", StateDictType::FULL_STATE_DICT},
    {"SHARDED_STATE_DICT", StateDictType::SHARDED_STATE_DICT},
}};
/// The type of one of Accelerate's fsdp_state_dict_type names; none for another.
constexpr std::optional<StateDictType> state_dict_type_named(std::string_view name) {
  return value_named(state_dict_type_names, name);
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
  /// Stage 3 (FSDP2's reshard_after_forward; Accelerate's
  /// --fsdp_reshard_after_forward with --fsdp_version 2): free each unit's
  /// full parameters as the forward leaves it and gather them again for its
  /// backward (true), or keep them from the forward until the unit's backward
  /// is done (false: one all-gather per unit and step instead of two, for
  /// every unit's full parameters held from the forward into the backward).
  bool reshard_after_forward = true;

  static constexpr int stage = Stage;
  /// Every stage is the one sharded engine (strategy/sharded_engine.hpp), set
  /// by the stage's choices: gradients sharded from stage 2, parameters freed
  /// between uses at stage 3 (a field added here is copied in its sharded_settings).
  using engine = strategy::ShardedEngine;
  static constexpr bool distributed = true;
};

/// FSDP's HYBRID_SHARD: ZeRO-3 within groups of `shard_group_size`
/// consecutive ranks (0: one machine's ranks, LOCAL_WORLD_SIZE), replicated
/// across the groups, whose gradient shards are then averaged: the
/// all-gathers stay on a machine, only the gradient all-reduce crosses.
///   accel::Trainer<accel::HybridShard> t{accel::HybridShard{.shard_group_size = 8}};
struct HybridShard {
  ZeRO<3> zero{};
  int shard_group_size = 0;

  using engine = strategy::ShardedEngine;  // with a replicate group
  static constexpr bool distributed = true;
};

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

  using engine = strategy::ParallelEngine<Data>;
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
