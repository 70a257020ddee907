// Precompiled once per compile-fail run (run.py): the LibTorch headers accel's
// own headers and exercise.hpp include. Parsing them is half of every
// snippet's cost (measured: 80 s -> 34 s a snippet against LibTorch 1.13).
// No accel header here: which accel headers a snippet includes is what
// several snippets test.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
