// The passing twin of strategy_not_a_policy.cpp: same shape, a real policy.
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::SingleProcess> trainer;
  accel_test::exercise(trainer);
  accel::Trainer<accel::DDP> ddp;
  accel_test::exercise(ddp);
}
