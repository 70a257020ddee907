// The passing twin of parallel_with_zero3.cpp: ZeRO<1>/<2> (and DDP) over the data dimension.
// save_state / load_state do not compile under Parallel<ZeRO<...>> yet (the engine has no shard
// layout to give the checkpoint code; the engine-contract issue), so those train only.
// expect-pass
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::Parallel<accel::ZeRO<2>>> zero2{{.tensor = 2}};
  accel_test::exercise_training(zero2);
  accel::Trainer<accel::Parallel<accel::ZeRO<1>>> zero1{{.tensor = 2}};
  accel_test::exercise_training(zero1);
  accel::Trainer<accel::Parallel<accel::DDP>> ddp{{.tensor = 2}};
  accel_test::exercise(ddp);
}
