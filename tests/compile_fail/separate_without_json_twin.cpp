// A program built compiled once needs no JSON for what takes none: the
// whole training program of exercise.hpp, and the trackers without a
// configuration (accel's headers only declare nlohmann::json there).
// expect-pass
#define ACCEL_SEPARATE_COMPILATION
#include <accel/strategy/ddp.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::DDP> trainer;
  accel_test::exercise(trainer);
  trainer.init_trackers("run");
  trainer.end_training();
}
