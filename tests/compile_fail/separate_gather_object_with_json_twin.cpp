// The passing twin of separate_gather_object_without_json.cpp: with
// <nlohmann/json.hpp> included, a program built compiled once logs, starts
// its trackers with a configuration and gathers objects.
// expect-pass
#define ACCEL_SEPARATE_COMPILATION
#include <nlohmann/json.hpp>
#include <accel/strategy/ddp.hpp>
#include "exercise.hpp"
void build() {
  accel::Trainer<accel::DDP> trainer;
  accel_test::exercise(trainer);
  trainer.init_trackers("run", {{"lr", 0.1}});
  trainer.log({{"loss", 1.0}});
  (void)trainer.gather_object(std::vector<int>{trainer.process_index()});
}
