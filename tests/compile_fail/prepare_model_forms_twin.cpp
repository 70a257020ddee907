// The passing twin of prepare_not_a_model.cpp: the three forms a C++ program holds a model in.
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
struct Net : torch::nn::Module {
  Net() { fc = register_module("fc", torch::nn::Linear(2, 2)); }
  torch::nn::Linear fc{nullptr};
};
void train(accel::Trainer<>& trainer) {
  Net owned;
  auto shared = std::make_shared<Net>();
  torch::nn::Linear holder(2, 2);
  torch::optim::SGD optimizer(owned.parameters(), 0.1);
  trainer.prepare(owned, shared, holder, optimizer);
  accel_test::exercise(trainer);
}
