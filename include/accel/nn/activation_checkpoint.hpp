#pragma once
// NOTE [Activation checkpointing]
// torch.utils.checkpoint for LibTorch, whose C++ API has none: the forward of
// a checkpointed function runs without recording its graph, keeping only its
// inputs; backward runs it again, with the random generators and autocast as
// they were in the forward (so a dropout drops the same units), and
// back-propagates through the recomputation. Activations inside the function
// are then held only while its backward runs: a transformer checkpointed
// block by block keeps one block's activations, not all of them, for the
// price of a second forward. The gradients are bitwise those of the plain
// forward (tests/torch/test_estimate.cpp).
//
//   for (auto& block : blocks)
//     x = accel::nn::checkpoint([&](const at::Tensor& in) { return block->forward(in); }, x);
//
// The gradients reach the parameters the function uses as in a plain
// backward (their accumulation hooks run, so DDP's buckets fill as usual),
// from within the outer backward (reentrant, like PyTorch's default).

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <functional>
#include <memory>
#include <string>
#include <stdexcept>
#include <utility>
#include <vector>

#include "accel/compat/torch_compat.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/device/random_state.hpp"
#include "accel/nn/entry_module.hpp"

namespace accel::nn {

/// A function of tensors to one tensor, for checkpoint().
using CheckpointedFunction = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

namespace detail {

struct AutocastState {
  bool enabled = false;
  at::ScalarType dtype = at::kFloat;
  static AutocastState of(c10::DeviceType type) { return {compat::autocast_enabled(type), compat::autocast_dtype(type)}; }
  void apply(c10::DeviceType type) const {
    compat::set_autocast_enabled(type, enabled);
    compat::set_autocast_dtype(type, dtype);
  }
};

// The generators and autocast as a thread has them at one moment.
struct ThreadState {
  at::Device device{at::kCPU};
  std::vector<at::Tensor> random_states{};
  AutocastState cpu{}, cuda{};

  static ThreadState now(at::Device device) {
    return {device, device::random_states(device), AutocastState::of(c10::DeviceType::CPU),
            AutocastState::of(c10::DeviceType::CUDA)};
  }
  void restore() const {
    device::restore_random_states(device, random_states);
    cpu.apply(c10::DeviceType::CPU);
    cuda.apply(c10::DeviceType::CUDA);
  }
};

// What the recomputation needs: the function, and the state the forward found.
struct Replay : torch::CustomClassHolder {
  CheckpointedFunction fn;
  ThreadState forward;
};

// Sets the forward's state for its lifetime, then puts back the thread's own
// (also when the recomputation throws).
class ReplayScope {
 public:
  explicit ReplayScope(const ThreadState& forward) : own_(ThreadState::now(forward.device)) { forward.restore(); }
  ~ReplayScope() { own_.restore(); }
  ReplayScope(const ReplayScope&) = delete;
  ReplayScope& operator=(const ReplayScope&) = delete;

 private:
  ThreadState own_;
};

struct Checkpoint : torch::autograd::Function<Checkpoint> {
  // `parameters` are inputs only so that the result requires a gradient
  // when no input does; the function reads them itself.
  // (TensorLists, as a custom Function counts their tensors as its inputs.)
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<Replay> replay,
                                                at::TensorList inputs, at::TensorList parameters) {
    replay->forward = ThreadState::now(replay->forward.device);
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["replay"] = c10::IValue::make_capsule(replay);
    ctx->saved_data["parameters"] = static_cast<std::int64_t>(parameters.size());
    return {replay->fn(inputs.vec())};  // the graph is not recorded here: nothing inside is kept
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto holder = ctx->saved_data["replay"].toCapsule();  // keeps the replay alive here
    const auto* replay = static_cast<const Replay*>(holder.get());
    std::vector<at::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables())
      inputs.push_back(saved.defined() ? saved.detach().requires_grad_(saved.requires_grad()) : saved);
    at::Tensor output;
    {
      ReplayScope scope(replay->forward);
      c10::AutoGradMode enable_grad(true);
      output = replay->fn(inputs);
    }
    if (output.requires_grad()) torch::autograd::backward({output}, {grads[0]});
    torch::autograd::variable_list out{at::Tensor()};  // for the replay, not a tensor
    for (const auto& input : inputs) out.push_back(input.defined() && input.requires_grad() ? input.grad() : at::Tensor());
    // The parameters' gradients were accumulated by the backward above.
    out.resize(out.size() + static_cast<std::size_t>(ctx->saved_data["parameters"].toInt()));
    return out;
  }
};

}  // namespace detail

/// `fn(inputs)` without keeping its activations: they are recomputed in
/// backward (NOTE [Activation checkpointing]). When no input requires a
/// gradient (the first layers, fed the data), pass the parameters `fn`
/// uses, so that the result does and backward reaches them.
inline at::Tensor checkpoint(CheckpointedFunction fn, const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& parameters = {}) {
  if (!c10::GradMode::is_enabled()) return fn(inputs);  // nothing would be kept anyway
  auto replay = c10::make_intrusive<detail::Replay>();
  replay->fn = std::move(fn);
  for (const auto& t : inputs)
    if (t.defined()) {
      replay->forward.device = t.device();
      break;
    }
  bool any_requires_grad = false;
  for (const auto& t : inputs) any_requires_grad = any_requires_grad || (t.defined() && t.requires_grad());
  const std::vector<at::Tensor> needed = any_requires_grad ? std::vector<at::Tensor>{} : parameters;
  return detail::Checkpoint::apply(replay, at::TensorList(inputs), at::TensorList(needed))[0];
}

/// The one-tensor form: `fn(input)`.
inline at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                             const std::vector<at::Tensor>& parameters = {}) {
  return checkpoint(CheckpointedFunction([fn](const std::vector<at::Tensor>& in) { return fn(in[0]); }),
                    std::vector<at::Tensor>{input}, parameters);
}

/// A Sequential entry that runs its module under accel::nn::checkpoint.
class CheckpointedEntryImpl : public torch::nn::Module {
 public:
  CheckpointedEntryImpl(torch::nn::AnyModule entry, std::string path)
      : torch::nn::Module("accel::CheckpointedEntry"), entry_(std::move(entry)), path_(std::move(path)) {}

  at::Tensor forward(const at::Tensor& input) {
    std::vector<at::Tensor> parameters;  // used when the input needs no gradient (the data)
    for (const auto& p : entry_.ptr()->parameters())
      if (p.requires_grad()) parameters.push_back(p);
    return checkpoint([this](const at::Tensor& in) { return run(in); }, input, parameters);
  }

  /// The module this entry checkpoints.
  std::shared_ptr<torch::nn::Module> module() const { return entry_.ptr(); }
  const std::string& path() const { return path_; }

 private:
  at::Tensor run(const at::Tensor& input) {
    try {
      return entry_.forward<at::Tensor>(input);
    } catch (const c10::Error& e) {
      throw std::runtime_error("accel activation_checkpointing: the Sequential entry '" + path_ +
                               "' (checkpointed, so called with one tensor for one tensor) failed: " +
                               e.what_without_backtrace());
    }
  }

  torch::nn::AnyModule entry_;
  std::string path_;
};

}  // namespace accel::nn

#if ACCEL_DEFINE_COMPILED_ONCE
namespace accel::nn {

ACCEL_COMPILED_ONCE std::shared_ptr<torch::nn::Module> entry_module(const torch::nn::AnyModule& entry) {
  if (auto* checkpointed = dynamic_cast<CheckpointedEntryImpl*>(entry.ptr().get())) return checkpointed->module();
  return entry.ptr();
}

}  // namespace accel::nn
#endif  // ACCEL_DEFINE_COMPILED_ONCE
