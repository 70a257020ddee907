// A step function that returns a float instead of the loss tensor.
// expect-error: step function must return the loss as a torch::Tensor
// twin: step_returns_tensor_twin.cpp
#include <accel/trainer.hpp>
void train(accel::Trainer<>& trainer) {
  trainer.step([] { return 1.0f; });
}
