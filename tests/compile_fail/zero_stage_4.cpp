// There is no ZeRO stage 4.
// expect-error: ZeRO stages are 1, 2 and 3
// twin: zero_stages_twin.cpp
#include <accel/trainer.hpp>
accel::Trainer<accel::ZeRO<4>> trainer;
