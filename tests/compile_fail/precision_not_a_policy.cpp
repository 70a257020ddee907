// A plain type in the Precision slot.
// expect-error: second Trainer parameter must be a precision policy
#include <accel/trainer.hpp>
accel::Trainer<accel::SingleProcess, float> trainer;
