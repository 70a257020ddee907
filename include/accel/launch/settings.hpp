#pragma once
// What `accel launch` tells the ranks through the environment, read back:
// gradient accumulation, mixed precision and the FSDP settings (the names
// are in launch/variables.hpp, which the command line shares). A setting
// that contradicts the compiled policies, or cannot be read, is a
// ConfigurationError naming the variable. Compiled once; only
// with_launcher_fsdp_settings sees the Strategy type.

#include <algorithm>
#include <cctype>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>

#include "accel/comm/environment.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/core/errors.hpp"
#include "accel/core/policies.hpp"
#include "accel/core/strategy_traits.hpp"
#include "accel/launch/variables.hpp"

namespace accel::launch {

int accumulation_steps(const std::optional<int>& configured);

// As in Accelerate, the precision in the program wins over the launcher's
// default: `accel launch` exports ACCELERATE_MIXED_PRECISION only when the
// user asked for one (a flag, or a key in a config file). Where that request
// disagrees with the compiled Precision policy, refuse instead of silently
// training in another precision, and say what to change.
void check_launcher_precision(const char* compiled);

// FSDP_VERSION (`--fsdp_version`): 1, Accelerate's default, or 2. As in
// Accelerate, they spell the sharding choice differently:
//   1: FSDP_SHARDING_STRATEGY, a name or Accelerate's 1-4 numbering, must
//      name the compiled strategy (unset: FSDP_RESHARD_AFTER_FORWARD, if it
//      holds a name, is read as one; false there is refused: it is FSDP2's);
//   2: FSDP_RESHARD_AFTER_FORWARD, true or false, is ZeRO<3>'s and
//      HybridShard's reshard_after_forward; false also accepts ZeRO<2>
//      (SHARD_GRAD_OP, which keeps the parameters whole anyway).
//      FSDP_SHARDING_STRATEGY is ignored, as Accelerate ignores it there
//      (its launcher always exports one).
// `compiled`: the strategy's FSDP name, none if it is not an FSDP strategy.
void check_launcher_sharding(std::optional<ShardingStrategy> compiled);
/// FSDP2's reshard_after_forward, if the launcher set it (FSDP_VERSION 2).
std::optional<bool> launcher_reshard_after_forward();

// `accel launch` with an fsdp_config exports Accelerate's FSDP_* variables;
// as Accelerate's FSDP plugin does, they set the strategy's fields:
//   FSDP_OFFLOAD_PARAMS            true/false  -> cpu_offload (any ZeRO stage, HybridShard)
//   FSDP_AUTO_WRAP_POLICY          NO_WRAP | SIZE_BASED_WRAP | TRANSFORMER_BASED_WRAP   (ZeRO-3 units)
//   FSDP_MIN_NUM_PARAMS            an integer                                           (SIZE_BASED_WRAP)
//   FSDP_TRANSFORMER_CLS_TO_WRAP   class names, comma-separated                         (TRANSFORMER_BASED_WRAP)
//   FSDP_STATE_DICT_TYPE           FULL_STATE_DICT | SHARDED_STATE_DICT                 (ZeRO-3, HybridShard)
//   FSDP_ACTIVATION_CHECKPOINTING  true/false  -> activation_checkpointing (any ZeRO stage, HybridShard)
// A value that cannot be read, or offload for a strategy that shards no
// optimizer state, is a ConfigurationError naming the variable.
bool launcher_flag(const char* name);

/// Debug mode (NOTE [Debug mode] in comm/checked_group.hpp): the Trainer's
/// option when set, else ACCELERATE_DEBUG_MODE (`accel launch --debug`).
inline bool debug_mode(const std::optional<bool>& configured) {
  return configured ? *configured : launcher_flag(variables::debug_mode);
}

// FSDP_AUTO_WRAP_POLICY, FSDP_MIN_NUM_PARAMS, FSDP_TRANSFORMER_CLS_TO_WRAP,
// into a ZeRO stage's settings (the fields every stage has).
void apply_launcher_wrap_policy(AutoWrapPolicy& policy, std::int64_t& min_num_params,
                                std::vector<std::string>& classes_to_wrap);
template <int Stage>
void apply_launcher_wrap_policy(ZeRO<Stage>& zero) {
  apply_launcher_wrap_policy(zero.auto_wrap_policy, zero.min_num_params, zero.transformer_layer_cls_to_wrap);
}

// FSDP_STATE_DICT_TYPE: SHARDED_STATE_DICT only where the model is sharded
// (`sharded_model`); none when the variable is not set.
std::optional<StateDictType> launcher_state_dict_type(bool sharded_model);
template <class Strategy>
void apply_launcher_state_dict_type(Strategy& strategy) {
  const auto type = launcher_state_dict_type(strategy_traits<Strategy>::zero_stage == 3);
  if constexpr (strategy_traits<Strategy>::zero_stage == 3)
    if (type) strategy_traits<Strategy>::zero_settings(strategy)->state_dict_type = *type;
}

template <class Strategy>
Strategy with_launcher_fsdp_settings(Strategy strategy) {
  auto* zero = strategy_traits<Strategy>::zero_settings(strategy);
  if (zero != nullptr) apply_launcher_wrap_policy(*zero);
  apply_launcher_state_dict_type(strategy);
  // Checked against the strategy by check_launcher_sharding.
  if (const auto reshard = launcher_reshard_after_forward(); reshard && zero != nullptr) zero->reshard_after_forward = *reshard;
  if (launcher_flag(variables::fsdp_activation_checkpointing)) {
    if (zero == nullptr)
      throw ConfigurationError("accel: the launcher asked for fsdp_activation_checkpointing=true but this program's "
                               "Trainer strategy has no wrapped units: use accel::ZeRO<N> or an accel::FSDP strategy "
                               "with an auto-wrap policy, or call accel::nn::checkpoint in the model's forward");
    zero->activation_checkpointing = true;
  }
  if (!launcher_flag(variables::fsdp_offload_params)) return strategy;
  using traits = strategy_traits<Strategy>;
  if (zero != nullptr && !traits::mesh) zero->cpu_offload = true;
  else if (traits::mesh)
    throw ConfigurationError("accel: the launcher asked for fsdp_offload_params=true, which accel does not apply to a "
                             "Parallel<> strategy: set the data strategy's cpu_offload in the program, or launch "
                             "without it");
  else
    throw ConfigurationError("accel: the launcher asked for fsdp_offload_params=true but this program's Trainer "
                             "strategy shards no optimizer state: use accel::ZeRO<N> or an accel::FSDP strategy");
  return strategy;
}


/// The launcher's checks for a Trainer<Strategy, Precision, ...>.
template <class Strategy, class Precision>
void check_launcher_settings() {
  check_launcher_precision(Precision::name);
  check_launcher_sharding(strategy_traits<Strategy>::sharding);
}

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE void apply_launcher_wrap_policy(AutoWrapPolicy& policy, std::int64_t& min_num_params,
                                                    std::vector<std::string>& classes_to_wrap) {
  if (auto requested = comm::process_environment(variables::fsdp_auto_wrap_policy)) {
    const auto named = auto_wrap_policy_named(*requested);
    if (!named)
      throw ConfigurationError("accel: FSDP_AUTO_WRAP_POLICY='" + *requested + "' is not " +
                               one_of(auto_wrap_policy_names));
    policy = *named;
  }
  if (auto count = comm::process_environment(variables::fsdp_min_num_params)) {
    std::size_t used = 0;
    long long n = -1;
    try {
      n = std::stoll(*count, &used);
    } catch (const std::exception&) {
    }
    if (n < 0 || used != count->size())
      throw ConfigurationError("accel: FSDP_MIN_NUM_PARAMS='" + *count + "' is not a non-negative integer");
    min_num_params = n;
  }
  if (auto classes = comm::process_environment(variables::fsdp_transformer_cls_to_wrap)) {
    classes_to_wrap.clear();
    std::stringstream list(*classes);
    for (std::string name; std::getline(list, name, ',');) {
      name.erase(0, name.find_first_not_of(" \t"));
      name.erase(name.find_last_not_of(" \t") + 1);
      if (!name.empty()) classes_to_wrap.push_back(name);
    }
  }
}

ACCEL_COMPILED_ONCE std::optional<StateDictType> launcher_state_dict_type(bool sharded_model) {
  auto requested = comm::process_environment(variables::fsdp_state_dict_type);
  if (!requested) return std::nullopt;
  const auto type = state_dict_type_named(*requested);
  if (!type)
    throw ConfigurationError("accel: FSDP_STATE_DICT_TYPE='" + *requested + "' is not " +
                             one_of(state_dict_type_names));
  if (!sharded_model && *type == StateDictType::SHARDED_STATE_DICT)
    throw ConfigurationError("accel: the launcher asked for fsdp_state_dict_type=SHARDED_STATE_DICT but this "
                             "program's Trainer strategy keeps the whole model on every rank: use accel::ZeRO<3> or "
                             "accel::HybridShard, or FULL_STATE_DICT");
  return type;
}

ACCEL_COMPILED_ONCE int accumulation_steps(const std::optional<int>& configured) {
  auto from_env = comm::process_environment(variables::gradient_accumulation_steps);
  int steps = 1;
  if (configured) {
    steps = *configured;
  } else if (from_env) {
    try {
      steps = std::stoi(*from_env);
    } catch (const std::exception&) {
      throw ConfigurationError("accel: ACCELERATE_GRADIENT_ACCUMULATION_STEPS='" + *from_env + "' is not an integer");
    }
  }
  if (steps < 1)
    throw ConfigurationError("accel: gradient_accumulation_steps must be at least 1, got " + std::to_string(steps));
  return steps;
}

ACCEL_COMPILED_ONCE void check_launcher_precision(const char* compiled) {
  auto requested = comm::process_environment(variables::mixed_precision);
  if (!requested || *requested == compiled) return;
  const auto origin = comm::process_environment(variables::mixed_precision_origin);
  const std::string where = !origin                     ? std::string("the environment")
                            : origin->starts_with("--") ? "accel launch " + *origin + " " + *requested
                                                        : "mixed_precision in " + *origin;
  throw ConfigurationError(std::string("accel: mixed_precision=") + *requested + " was asked for (by " + where +
                           ") but this program's Trainer is compiled with mixed_precision=" + compiled +
                           ": launch with --mixed_precision " + compiled + " (or without asking for one), or " +
                           "change the Trainer's Precision policy");
}

namespace detail {
inline int launcher_fsdp_version() {
  const auto version = comm::process_environment(variables::fsdp_version);
  if (!version || *version == "1") return 1;
  if (*version == "2") return 2;
  throw ConfigurationError("accel: FSDP_VERSION='" + *version + "' is not 1 or 2");
}

inline std::string compiled_name(std::optional<ShardingStrategy> compiled) {
  return compiled ? "FSDP " + std::string(name_of(sharding_strategy_names, *compiled)) : "not an FSDP strategy";
}
}  // namespace detail

ACCEL_COMPILED_ONCE std::optional<bool> launcher_reshard_after_forward() {
  if (detail::launcher_fsdp_version() != 2 || !comm::process_environment(variables::fsdp_reshard_after_forward))
    return std::nullopt;
  return launcher_flag(variables::fsdp_reshard_after_forward);
}

ACCEL_COMPILED_ONCE void check_launcher_sharding(std::optional<ShardingStrategy> compiled) {
  if (detail::launcher_fsdp_version() == 2) {
    const auto reshard = launcher_reshard_after_forward();
    if (!reshard) return;
    using enum ShardingStrategy;
    const bool fits = compiled == FULL_SHARD || compiled == HYBRID_SHARD || (!*reshard && compiled == SHARD_GRAD_OP);
    if (!fits)
      throw ConfigurationError(
          std::string("accel: the launcher asked for FSDP2 with fsdp_reshard_after_forward=") +
          (*reshard ? "true" : "false") + " but this program's Trainer strategy is " + detail::compiled_name(compiled) +
          ": FSDP2 shards the parameters, use accel::ZeRO<3> or accel::HybridShard" +
          (*reshard ? "" : " (or accel::ZeRO<2>, FSDP1's SHARD_GRAD_OP)") + ", or change the config");
    return;
  }
  auto requested = comm::process_environment(variables::fsdp_sharding_strategy);
  std::string variable = "fsdp_sharding_strategy";
  if (!requested) {  // Accelerate's FSDP1 reads a strategy name there too
    requested = comm::process_environment(variables::fsdp_reshard_after_forward);
    if (!requested) return;
    variable = "fsdp_reshard_after_forward";
    if (*requested == "true") return;  // FSDP1's default, which Accelerate's launcher always exports
    if (*requested == "false")
      throw ConfigurationError("accel: the launcher asked for fsdp_reshard_after_forward=false, which is FSDP2's "
                               "setting: launch with --fsdp_version 2 (or, with FSDP1, fsdp_sharding_strategy "
                               "SHARD_GRAD_OP)");
  }
  std::string name = *requested;
  if (name.size() == 1 && name[0] >= '1' && name[0] <= '4') name = sharding_strategy_names[name[0] - '1'].name;
  const auto asked = value_named(sharding_strategy_names, name);
  if (!asked)
    throw ConfigurationError("accel: " + variable + "='" + *requested + "' is not " + one_of(sharding_strategy_names) +
                             " (or 1-4)");
  if (asked != compiled)
    throw ConfigurationError("accel: the launcher asked for " + variable + "=" + name +
                             " but this program's Trainer strategy is " + detail::compiled_name(compiled) +
                             ": use accel::FSDP<accel::ShardingStrategy::" + name + "> or change the config");
}

ACCEL_COMPILED_ONCE bool launcher_flag(const char* name) {
  auto value = comm::process_environment(name);
  if (!value) return false;
  std::string v = *value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0" || v.empty()) return false;
  throw ConfigurationError(std::string("accel: ") + name + "='" + *value + "' is not true or false");
}

#endif

}  // namespace accel::launch
