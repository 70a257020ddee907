#pragma once
// The umbrella header: everything a training program needs from accel, every
// strategy's engine included. A translation unit that uses one strategy
// compiles faster with <accel/trainer.hpp> and that strategy's header
// (bench/compile_time.sh measures both).
#include "accel/core/concepts.hpp"
#include "accel/core/policies.hpp"
#include "accel/data/dataset.hpp"
#include "accel/data/loader.hpp"
#include "accel/launch/spawn.hpp"
#include "accel/strategy/ddp.hpp"
#include "accel/strategy/hybrid_shard.hpp"
#include "accel/strategy/parallel.hpp"
#include "accel/strategy/zero.hpp"
#include "accel/strategy/zero3.hpp"
#include "accel/trainer.hpp"
