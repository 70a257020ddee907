// A type that is not a strategy policy in the Strategy slot.
// expect-error: first Trainer parameter must be a strategy policy
// twin: strategy_not_a_policy_twin.cpp
#include <accel/trainer.hpp>
struct NotAPolicy {};
accel::Trainer<NotAPolicy> trainer;
