#pragma once
// ZeRO stage 3 (FSDP FULL_SHARD): parameters, gradients and optimizer state
// all sharded, a unit's full parameters gathered only while it computes
// (NOTE [ZeRO-3 parameter life cycle], parameter_units.hpp). The same engine
// as stages 1 and 2 (sharded_engine.hpp): this header is <accel/strategy/zero.hpp>.

#include "accel/strategy/zero.hpp"
