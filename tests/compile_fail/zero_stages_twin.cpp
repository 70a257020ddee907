// The passing twin of zero_stage_4.cpp: stages 1, 2 and 3, and their offloaded forms.
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::ZeRO<1>> one;
  accel_test::exercise(one);
  accel::Trainer<accel::ZeRO<2>> two{{.cpu_offload = true}};
  accel_test::exercise(two);
  accel::Trainer<accel::ZeRO<3>> three;
  accel_test::exercise(three);
}
