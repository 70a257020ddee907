// The passing twin of parallel_with_zero3.cpp.
// expect-pass
#include <accel/trainer.hpp>
void build() { accel::Trainer<accel::Parallel<accel::ZeRO<2>>> trainer{{.tensor = 2}}; }
