// The passing twin: the same user strategy, opted in.
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
struct MyStrategy {
  using engine = accel::strategy::SingleProcessEngine;
  static constexpr bool distributed = false;
};
template <>
inline constexpr bool accel::enable_strategy_policy<MyStrategy> = true;
static_assert(accel::strategy_policy<MyStrategy>);
void build() {
  accel::Trainer<MyStrategy> trainer;
  accel_test::exercise(trainer);
}
