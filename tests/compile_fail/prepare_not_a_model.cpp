// prepare() given something that is neither a model, an optimizer nor a scheduler (a raw pointer to a model).
// expect-error: prepare\(\) takes models, optimizers
// twin: prepare_model_forms_twin.cpp
#include <accel/trainer.hpp>
#include <torch/nn/modules/linear.h>
void train(accel::Trainer<>& trainer) {
  auto* model = new torch::nn::LinearImpl(2, 2);
  trainer.prepare(model);
}
