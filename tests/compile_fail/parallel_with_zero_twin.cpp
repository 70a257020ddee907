// The passing twin of parallel_with_hybrid_shard.cpp: DDP and ZeRO<1|2|3> over the data
// dimension, each trained and checkpointed.
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::Parallel<accel::ZeRO<3>>> zero3{{.tensor = 2}};
  accel_test::exercise(zero3);
  accel::Trainer<accel::Parallel<accel::ZeRO<2>>> zero2{{.tensor = 2}};
  accel_test::exercise(zero2);
  accel::Trainer<accel::Parallel<accel::ZeRO<1>>> zero1{{.tensor = 2}};
  accel_test::exercise(zero1);
  accel::Trainer<accel::Parallel<accel::DDP>> ddp{{.tensor = 2}};
  accel_test::exercise(ddp);
}
