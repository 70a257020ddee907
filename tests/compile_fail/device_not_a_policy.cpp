// A plain type in the Device slot.
// expect-error: third Trainer parameter must be a device policy
// twin: device_policy_twin.cpp
#include <accel/trainer.hpp>
accel::Trainer<accel::SingleProcess, accel::FP32, int> trainer;
