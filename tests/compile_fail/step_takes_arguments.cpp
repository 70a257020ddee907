// A step function that expects the batch as a parameter.
// expect-error: step function must take no arguments
// twin: step_returns_tensor_twin.cpp
#include <accel/trainer.hpp>
void train(accel::Trainer<>& trainer, const at::Tensor& x) {
  trainer.step([](const at::Tensor& batch) { return batch.sum(); });
  (void)x;
}
