// <accel/trainer.hpp> brings only the default strategy's engine: a Trainer<DDP>
// without <accel/strategy/ddp.hpp> says which header to include.
// expect-error: this Trainer's strategy engine is not included: include the strategy's header
// twin: engine_included_twin.cpp
#include <accel/trainer.hpp>
accel::Trainer<accel::DDP> trainer;
