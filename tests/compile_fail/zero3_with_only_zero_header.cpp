// ZeRO<3> is its own engine (ZeRO3Engine, <accel/strategy/zero3.hpp>): with
// only the stage-1/2 header the Trainer says which header to include, rather
// than run the stage-2 engine on a stage-3 strategy.
// expect-error: this Trainer's strategy engine is not included: .*ZeRO<3>: <accel/strategy/zero3.hpp>
// twin: zero3_header_twin.cpp
#include <accel/strategy/zero.hpp>
#include <accel/trainer.hpp>
accel::Trainer<accel::ZeRO<3>> trainer;
