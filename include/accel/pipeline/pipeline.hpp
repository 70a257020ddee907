#pragma once
// Pipeline parallelism: a torch::nn::Sequential split into stages, one per
// rank of the pipeline group, fed with micro-batches.
//
// NOTE [Pipeline schedules]
// Stage s of p runs m micro-batches. Activations go forward to s+1 and their
// gradients back to s-1 with send/recv (a small dtype and shape header first, so the
// receiver can size its buffer). Each micro-batch's loss (last stage) is
// divided by m, so the accumulated gradients equal one step on the whole
// batch; the optimizer then steps once.
//   GPipe: all m forwards, then all m backwards (m activations held).
//   1F1B:  min(p-s-1, m) warm-up forwards, then one forward and one backward
//          in turn, then the remaining backwards: at most p micro-batches'
//          activations are held at once on any stage.
// Sends are asynchronous and waited at the end of the step; receives block,
// in the same order on both sides, so neither schedule can deadlock.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/core/policies.hpp"

namespace accel::pipeline {

using Schedule = PipelineSchedule;

struct PipelineOptions {
  int micro_batches = 4;
  Schedule schedule = Schedule::one_f_one_b;
};

/// Layers [s*n/p, (s+1)*n/p) of `model` (the same module objects, so the
/// same parameters) as stage `stage` of `stages`.
inline std::vector<torch::nn::AnyModule> split_stage(const torch::nn::Sequential& model, int stages, int stage) {
  const auto layers = static_cast<int>(model->size());
  if (layers < stages)
    throw std::invalid_argument("accel pipeline: a model of " + std::to_string(layers) +
                                " layers cannot be split into " + std::to_string(stages) + " stages");
  const int first = stage * layers / stages, last = (stage + 1) * layers / stages;
  return std::vector<torch::nn::AnyModule>(model->begin() + first, model->begin() + last);
}

class Pipeline {
 public:
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

  /// This rank's stage of `model` on the pipeline `group` (its rank is the stage).
  Pipeline(const torch::nn::Sequential& model, comm::Communicator& group, PipelineOptions options = {})
      : group_(&group), options_(options), stage_(split_stage(model, group.size(), group.rank())) {
    if (options.micro_batches < 1) throw std::invalid_argument("accel pipeline: micro_batches must be at least 1");
  }

  /// This stage's layers as a module of their own (the same layer objects).
  torch::nn::Sequential stage_module() const {
    torch::nn::Sequential module;
    for (const auto& layer : stage_) module->push_back(layer);
    return module;
  }

  /// This stage's parameters: what its optimizer steps.
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    for (const auto& layer : stage_)
      for (auto& p : layer.ptr()->parameters()) out.push_back(p);
    return out;
  }
  int stage_index() const { return group_->rank(); }
  int stages() const { return group_->size(); }
  bool first() const { return stage_index() == 0; }
  bool last() const { return stage_index() == stages() - 1; }

  /// One training step's forwards and backwards over `inputs` (read by the
  /// first stage) and `targets` (read by the last); gradients accumulate in
  /// this stage's parameters, of the mean loss times `loss_multiplier` (the
  /// FP16 loss scale over the gradient accumulation steps). Returns the mean
  /// loss, on every stage.
  double train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss_fn,
                    double loss_multiplier = 1.0) {
    loss_multiplier_ = loss_multiplier;
    const int m = options_.micro_batches;
    if (inputs.size(0) % m != 0)
      throw std::invalid_argument("accel pipeline: batch of " + std::to_string(inputs.size(0)) +
                                  " does not split into " + std::to_string(m) + " micro-batches");
    inputs_ = inputs.chunk(m);
    targets_ = targets.chunk(m);
    held_.assign(m, {});
    loss_sum_ = 0;
    in_flight_ = 0;
    peak_ = 0;
    held_bytes_ = 0;
    peak_bytes_ = 0;
    wait_seconds_ = 0;
    const auto started = std::chrono::steady_clock::now();
    if (options_.schedule == Schedule::gpipe) {
      for (int i = 0; i < m; ++i) forward(i, loss_fn);
      for (int i = m; i-- > 0;) backward(i);
    } else {
      const int warmup = std::min(stages() - stage_index() - 1, m);
      int next_forward = 0, next_backward = 0;
      for (; next_forward < warmup; ++next_forward) forward(next_forward, loss_fn);
      for (; next_forward < m; ++next_forward, ++next_backward) {
        forward(next_forward, loss_fn);
        backward(next_backward);
      }
      for (; next_backward < m; ++next_backward) backward(next_backward);
    }
    for (auto& send : sends_) send.wait();
    sends_.clear();
    kept_.clear();
    // The loss lives on the last stage; every stage reports it.
    step_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    auto loss = at::full({1}, last() ? loss_sum_ : 0.0, at::TensorOptions().dtype(at::kDouble));
    group_->broadcast(loss, stages() - 1, "broadcast of the pipeline loss");
    return loss.item<double>();
  }

  /// The most micro-batches whose activations this stage held at once in
  /// the last step (1F1B: at most the number of stages).
  int peak_in_flight() const { return peak_; }
  /// The most bytes of stage inputs and outputs held for backward at once.
  std::int64_t peak_activation_bytes() const { return peak_bytes_; }
  /// Seconds of the last step's schedule spent blocked on a neighbour (the
  /// bubble), and the schedule's whole length (the loss broadcast excluded).
  double wait_seconds() const { return wait_seconds_; }
  double step_seconds() const { return step_seconds_; }

 private:
  struct Held {
    at::Tensor input, output, loss;
  };

  void forward(int i, const LossFn& loss_fn) {
    at::Tensor input = first() ? inputs_[i] : receive(stage_index() - 1, tag(i, false)).requires_grad_(true);
    at::Tensor output = input;
    for (auto& layer : stage_) output = layer.forward(output);
    auto& held = held_[i];
    held.input = input;
    held.output = output;
    if (last()) {
      held.loss = loss_fn(output, targets_[i]) / options_.micro_batches;
      loss_sum_ += held.loss.item<double>();
    } else {
      send(output.detach(), stage_index() + 1, tag(i, false));
    }
    peak_ = std::max(peak_, ++in_flight_);
    held_bytes_ += bytes(input) + bytes(output);
    peak_bytes_ = std::max(peak_bytes_, held_bytes_);
  }

  static std::int64_t bytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

  void backward(int i) {
    auto& held = held_[i];
    if (last()) (loss_multiplier_ == 1.0 ? held.loss : held.loss * loss_multiplier_).backward();
    else held.output.backward(receive(stage_index() + 1, tag(i, true)));
    if (!first()) send(held.input.grad(), stage_index() - 1, tag(i, true));
    held_bytes_ -= bytes(held.input) + bytes(held.output);
    held = {};
    --in_flight_;
  }

  static int tag(int micro_batch, bool gradient) { return 2 * micro_batch + (gradient ? 1 : 0); }

  // A header (the dtype, the rank, then up to 7 sizes) precedes every
  // tensor: under autocast a stage's output is bf16 while its parameters
  // are fp32, and a buffer of the wrong width would take the bytes silently.
  static constexpr int header_length = 9;
  void send(const at::Tensor& t, int to, int tag) {
    if (t.dim() > header_length - 2)
      throw std::invalid_argument("accel pipeline: a stage's output has " + std::to_string(t.dim()) +
                                  " dimensions; at most " + std::to_string(header_length - 2) + " cross stages");
    std::vector<std::int64_t> header(header_length, 0);
    header[0] = static_cast<std::int64_t>(t.scalar_type());
    header[1] = t.dim();
    for (int d = 0; d < t.dim(); ++d) header[d + 2] = t.size(d);
    auto shape = at::tensor(header);
    auto data = t.contiguous();
    const std::string what = "pipeline send to stage " + std::to_string(to);
    sends_.push_back(group_->send_async(shape, to, 1000000 + tag, what));
    sends_.push_back(group_->send_async(data, to, tag, what));
    kept_.push_back(shape);
    kept_.push_back(data);
  }

  at::Tensor receive(int from, int tag) {
    auto header = at::empty({header_length}, at::TensorOptions().dtype(at::kLong));
    const std::string what = "pipeline receive from stage " + std::to_string(from);
    const auto waiting = std::chrono::steady_clock::now();
    group_->recv_async(header, from, 1000000 + tag, what).wait();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
    std::vector<std::int64_t> sizes;
    for (int d = 0; d < header[1].item<std::int64_t>(); ++d) sizes.push_back(header[d + 2].item<std::int64_t>());
    auto params = parameters();
    auto options = params.empty() ? at::TensorOptions() : params.front().options().requires_grad(false);
    auto data = at::empty(sizes, options.dtype(static_cast<at::ScalarType>(header[0].item<std::int64_t>())));
    group_->recv_async(data, from, tag, what).wait();
    return data;
  }

  comm::Communicator* group_;
  PipelineOptions options_;
  std::vector<torch::nn::AnyModule> stage_;
  std::vector<at::Tensor> inputs_, targets_;
  std::vector<Held> held_;
  std::vector<comm::Pending> sends_;
  double loss_multiplier_ = 1.0;
  std::vector<at::Tensor> kept_;  // tensors being sent stay alive until their send completes
  double loss_sum_ = 0;
  int in_flight_ = 0, peak_ = 0;
  std::int64_t held_bytes_ = 0, peak_bytes_ = 0;
  double wait_seconds_ = 0, step_seconds_ = 0;
};

}  // namespace accel::pipeline
