// The passing twin of zero3_with_only_zero_header.cpp: ZeRO<3>'s own header.
// expect-pass
#include <accel/strategy/zero3.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::ZeRO<3>> trainer;
  accel_test::exercise(trainer);
}
