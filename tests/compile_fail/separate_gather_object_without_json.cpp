// Under ACCEL_SEPARATE_COMPILATION accel's headers only declare
// nlohmann::json (<accel/core/json.hpp>): gather_object, which converts
// through it, says which header to include.
// expect-error: gather_object converts through nlohmann::json: include <nlohmann/json.hpp>
// twin: separate_gather_object_with_json_twin.cpp
#define ACCEL_SEPARATE_COMPILATION
#include <accel/strategy/ddp.hpp>
#include <accel/trainer.hpp>
std::vector<int> ranks(accel::Trainer<accel::DDP>& trainer) { return trainer.gather_object(trainer.process_index()); }
