// The passing twin of precision_not_a_policy.cpp: the precision policies in the Precision slot.
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::SingleProcess, accel::FP32> fp32;
  accel_test::exercise(fp32);
  accel::Trainer<accel::SingleProcess, accel::BF16> bf16;
  accel_test::exercise(bf16);
}
