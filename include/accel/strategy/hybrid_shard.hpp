#pragma once
// HybridShard (FSDP HYBRID_SHARD): ZeRO-3 inside each group of
// `shard_group_size` consecutive ranks, the groups replicas of each other.
// The parameter all-gathers and gradient reduce-scatters stay inside a
// group (a machine, by default); after them the gradient shards are
// averaged across the groups with one all-reduce per bucket. It is the one
// sharded engine (sharded_engine.hpp) with a replicate group.

#include "accel/strategy/sharded_engine.hpp"
