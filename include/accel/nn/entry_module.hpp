#pragma once
// What the pipeline asks of activation checkpointing: the module a
// Sequential entry runs. Declared apart from nn/activation_checkpoint.hpp,
// whose autograd-function headers (torch/csrc/autograd/custom_function.h and,
// with LibTorch 2.x, compiled autograd's) a translation unit compiled once
// then need not parse: Trainer<Parallel<ZeRO<1>>> cost 1.41x the plain loop
// with LibTorch 2.15 with them, the other strategies 1.13-1.19x.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <memory>

#include "accel/core/compiled_once.hpp"

namespace accel::nn {

/// The module a Sequential entry runs: the one it checkpoints
/// (CheckpointedEntryImpl), if it does.
ACCEL_COMPILED_ONCE std::shared_ptr<torch::nn::Module> entry_module(const torch::nn::AnyModule& entry);

}  // namespace accel::nn

#if ACCEL_DEFINE_COMPILED_ONCE
#include "accel/nn/activation_checkpoint.hpp"
#endif
