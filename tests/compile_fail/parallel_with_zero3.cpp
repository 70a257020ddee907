// ZeRO<3> over the data dimension of a tensor/pipeline mesh is not supported.
// expect-error: Parallel<Data> takes accel::DDP, accel::ZeRO<1> or accel::ZeRO<2>
// twin: parallel_with_zero2_twin.cpp
#include <accel/trainer.hpp>
accel::Trainer<accel::Parallel<accel::ZeRO<3>>> trainer;
