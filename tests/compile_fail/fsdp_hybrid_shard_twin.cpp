// HYBRID_SHARD is its own policy (ZeRO-3 within groups, replicated across).
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
static_assert(std::is_same_v<accel::FSDP<accel::ShardingStrategy::HYBRID_SHARD>, accel::HybridShard>);
void build() {
  accel::Trainer<accel::FSDP<accel::ShardingStrategy::HYBRID_SHARD>> trainer{{.shard_group_size = 2}};
  accel_test::exercise(trainer);
}
