// The passing twin of engine_not_included.cpp: the Trainer and the DDP engine,
// nothing else of accel.
// expect-pass
#include <accel/strategy/ddp.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::DDP> trainer;
  accel_test::exercise(trainer);
}
