// The passing twin of the step_* snippets: a no-argument lambda returning a tensor.
// expect-pass
#include <accel/accel.hpp>
#include "exercise.hpp"
void train(accel::Trainer<>& trainer, const at::Tensor& x) {
  trainer.step([&] { return x.sum(); });
  accel_test::exercise(trainer);
}
