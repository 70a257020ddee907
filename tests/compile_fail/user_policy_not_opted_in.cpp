// A user-written strategy that has the right shape but did not opt in.
// expect-error: specialise accel::enable_strategy_policy
// twin: user_policy_opted_in_twin.cpp
#include <accel/trainer.hpp>
struct MyStrategy {
  using engine = accel::strategy::SingleProcessEngine;
  static constexpr bool distributed = false;
};
accel::Trainer<MyStrategy> trainer;
