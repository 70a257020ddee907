// HYBRID_SHARD needs a device mesh accel does not have yet.
// expect-error: HYBRID_SHARD .* is not implemented yet: use FULL_SHARD
#include <accel/trainer.hpp>
accel::Trainer<accel::FSDP<accel::ShardingStrategy::HYBRID_SHARD>> trainer;
