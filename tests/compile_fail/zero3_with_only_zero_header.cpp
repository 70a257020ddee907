// ZeRO<3> with only <accel/strategy/zero.hpp>: every stage is the one sharded
// engine (strategy/sharded_engine.hpp), so the header of stages 1 and 2
// brings stage 3's engine too; no engine is picked by which headers a
// translation unit happened to include (issue 32 item 2: it must train).
// expect-pass
#include <accel/strategy/zero.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::ZeRO<3>> trainer;
  accel_test::exercise(trainer);
}
