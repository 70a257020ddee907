#pragma once
// The umbrella header: everything a training program needs from accel.
#include "accel/core/concepts.hpp"
#include "accel/core/policies.hpp"
#include "accel/data/dataset.hpp"
#include "accel/data/loader.hpp"
#include "accel/launch/spawn.hpp"
#include "accel/trainer.hpp"
