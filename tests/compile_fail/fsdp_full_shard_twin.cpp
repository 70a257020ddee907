// FSDP's FULL_SHARD is ZeRO<3>, and trains and checkpoints as such.
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
static_assert(std::is_same_v<accel::FSDP<accel::ShardingStrategy::FULL_SHARD>, accel::ZeRO<3>>);
void build() {
  accel::Trainer<accel::FSDP<accel::ShardingStrategy::FULL_SHARD>> trainer;
  accel_test::exercise(trainer);
}
