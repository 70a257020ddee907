#pragma once
// The environment variables `accel launch` sets for its ranks and the
// library reads back: one table, shared by the command line and the Trainer
// (torch-free). Accelerate's names, so that its users' scripts and configs
// carry over.

#include <array>
#include <string_view>

namespace accel::launch::variables {

inline constexpr const char* mixed_precision = "ACCELERATE_MIXED_PRECISION";
/// accel's own: where the launcher's mixed_precision came from ("--mixed_precision",
/// "config file F"), so that a rank refusing it can say what to change.
inline constexpr const char* mixed_precision_origin = "ACCEL_MIXED_PRECISION_FROM";
inline constexpr const char* gradient_accumulation_steps = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS";
inline constexpr const char* use_cpu = "ACCELERATE_USE_CPU";
inline constexpr const char* debug_mode = "ACCELERATE_DEBUG_MODE";
inline constexpr const char* cpu_affinity = "ACCELERATE_CPU_AFFINITY";
inline constexpr const char* use_fsdp = "ACCELERATE_USE_FSDP";
inline constexpr const char* fsdp_sharding_strategy = "FSDP_SHARDING_STRATEGY";
inline constexpr const char* fsdp_version = "FSDP_VERSION";
inline constexpr const char* fsdp_reshard_after_forward = "FSDP_RESHARD_AFTER_FORWARD";
inline constexpr const char* fsdp_offload_params = "FSDP_OFFLOAD_PARAMS";
inline constexpr const char* fsdp_auto_wrap_policy = "FSDP_AUTO_WRAP_POLICY";
inline constexpr const char* fsdp_min_num_params = "FSDP_MIN_NUM_PARAMS";
inline constexpr const char* fsdp_transformer_cls_to_wrap = "FSDP_TRANSFORMER_CLS_TO_WRAP";
inline constexpr const char* fsdp_state_dict_type = "FSDP_STATE_DICT_TYPE";
inline constexpr const char* fsdp_activation_checkpointing = "FSDP_ACTIVATION_CHECKPOINTING";
/// torchrun's names: how many times `accel launch --max_restarts` has restarted the job, and its limit.
inline constexpr const char* restart_count = "TORCHELASTIC_RESTART_COUNT";
inline constexpr const char* max_restarts = "TORCHELASTIC_MAX_RESTARTS";

/// fsdp_config keys whose variable is not simply the key in capitals.
inline constexpr std::array<std::pair<std::string_view, std::string_view>, 1> fsdp_renamed = {{
    {"fsdp_transformer_layer_cls_to_wrap", fsdp_transformer_cls_to_wrap},
}};

}  // namespace accel::launch::variables
