// The passing twin of device_not_a_policy.cpp: the device policies in the Device slot
// (CUDA compiled, not run: constructing it needs a GPU).
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::SingleProcess, accel::FP32, accel::CPU> trainer;
  accel_test::exercise(trainer);
}
void build_cuda(accel::Trainer<accel::DDP, accel::FP32, accel::CUDA>& trainer) { accel_test::exercise(trainer); }
