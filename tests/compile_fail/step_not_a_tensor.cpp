// A step function that returns a float instead of the loss tensor.
// expect-error: step function must return the loss as a torch::Tensor
#include <accel/trainer.hpp>
void train(accel::Trainer<>& trainer) {
  trainer.step([] { return 1.0f; });
}
