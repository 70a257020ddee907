// The passing twin of strategy_not_a_policy.cpp: same shape, a real policy.
// expect-pass
#include <accel/trainer.hpp>
void build() { accel::Trainer<accel::SingleProcess> trainer; }
