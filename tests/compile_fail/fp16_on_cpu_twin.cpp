// The passing twins of fp16_on_cpu.cpp: BF16 on CPU, FP16 on CUDA (compiled,
// not run: constructing it needs a GPU).
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::DDP, accel::BF16, accel::CPU> trainer;
  accel_test::exercise(trainer);
}
void build_cuda(accel::Trainer<accel::DDP, accel::FP16, accel::CUDA>& trainer) { accel_test::exercise(trainer); }
