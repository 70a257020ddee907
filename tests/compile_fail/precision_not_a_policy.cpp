// A plain type in the Precision slot.
// expect-error: second Trainer parameter must be a precision policy
// twin: precision_policy_twin.cpp
#include <accel/trainer.hpp>
accel::Trainer<accel::SingleProcess, float> trainer;
