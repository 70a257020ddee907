// The passing twin of fsdp_hybrid_shard.cpp: FULL_SHARD is ZeRO<3>.
// expect-pass
#include <accel/trainer.hpp>
void build() { accel::Trainer<accel::FSDP<accel::ShardingStrategy::FULL_SHARD>> trainer; }
