#pragma once
// What each strategy tag is, analysed once (Kokkos analyses a policy into
// named traits the same way): its FSDP name, and where its ZeRO settings
// live. Code that needs either asks strategy_traits<S> instead of probing the
// tag's shape with `requires`, so a new tag is described in one place.
// Torch-free.

#include <optional>

#include "accel/core/policies.hpp"

namespace accel {

/// A tag with neither (SingleProcess, a user's own strategy).
template <class S>
struct strategy_traits {
  /// FSDP's name for the strategy (Accelerate's fsdp_sharding_strategy), if it has one.
  static constexpr std::optional<ShardingStrategy> sharding = std::nullopt;
  /// The ZeRO stage of its data dimension; 0: the data engine shards nothing.
  static constexpr int zero_stage = 0;
  /// Its ZeRO settings (auto-wrap units, offload, checkpoints); nullptr: none.
  static constexpr ZeRO<3>* zero_settings(S&) { return nullptr; }
  /// A device mesh (Parallel<>), whose data strategy is one of its settings.
  static constexpr bool mesh = false;
};

template <>
struct strategy_traits<DDP> {
  static constexpr std::optional<ShardingStrategy> sharding = ShardingStrategy::NO_SHARD;
  static constexpr int zero_stage = 0;
  static constexpr ZeRO<3>* zero_settings(DDP&) { return nullptr; }
  static constexpr bool mesh = false;
};

template <int Stage>
struct strategy_traits<ZeRO<Stage>> {
  /// ZeRO-1 has no FSDP name.
  static constexpr std::optional<ShardingStrategy> sharding =
      Stage == 3   ? std::optional(ShardingStrategy::FULL_SHARD)
      : Stage == 2 ? std::optional(ShardingStrategy::SHARD_GRAD_OP)
                   : std::nullopt;
  static constexpr int zero_stage = Stage;
  static constexpr ZeRO<Stage>* zero_settings(ZeRO<Stage>& s) { return &s; }
  static constexpr bool mesh = false;
};

template <>
struct strategy_traits<HybridShard> {
  static constexpr std::optional<ShardingStrategy> sharding = ShardingStrategy::HYBRID_SHARD;
  static constexpr int zero_stage = 3;
  static constexpr ZeRO<3>* zero_settings(HybridShard& s) { return &s.zero; }
  static constexpr bool mesh = false;
};

/// The mesh has no FSDP name; its data dimension's settings are its ZeRO settings.
template <class Data>
struct strategy_traits<Parallel<Data>> {
  static constexpr std::optional<ShardingStrategy> sharding = std::nullopt;
  static constexpr int zero_stage = strategy_traits<Data>::zero_stage;
  static constexpr auto* zero_settings(Parallel<Data>& s) { return strategy_traits<Data>::zero_settings(s.data); }
  static constexpr bool mesh = true;
};

}  // namespace accel
