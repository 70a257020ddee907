// Precompiled for the LibTorch test binary: the library and the LibTorch
// headers every test file includes (doctest stays out: see doctest_torch.hpp).
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <accel/accel.hpp>
