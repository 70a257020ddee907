// <accel/strategy/zero3.hpp>, kept for the programs that include it: the same
// engine as <accel/strategy/zero.hpp>, for every stage.
// expect-pass
#include <accel/strategy/zero3.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::ZeRO<1>> first;
  accel_test::exercise(first);
  accel::Trainer<accel::ZeRO<3>> trainer;
  accel_test::exercise(trainer);
}
