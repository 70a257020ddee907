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
//   Interleaved 1F1B (Megatron-LM's, v virtual stages per rank): the model is
//          cut into p*v chunks and rank s holds chunks s, s+p, ..., s+(v-1)p,
//          so a micro-batch crosses every rank v times (the last rank hands
//          chunk s+p-1's output back to rank 0). Forwards run in groups of p
//          micro-batches per chunk, (p-s-1)*2 + (v-1)*p of them as warm-up,
//          then one forward and one backward in turn: each rank starts after
//          a v-th of a stage's time, so the bubble falls from
//          (p-1)/(m+p-1) to (p-1)/(v*m+p-1), for v times the messages.
//          m must divide by p.
// Sends are asynchronous and waited at the end of the step; receives block.
// Every rank runs the same deterministic order, in which each receive's
// message is sent before its sender waits on anything this rank sends
// later, so no schedule deadlocks (tested with p = 2, 4 and v = 2, 3).

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
#include "accel/nn/entry_module.hpp"

namespace accel::pipeline {

using Schedule = PipelineSchedule;

struct PipelineOptions {
  int micro_batches = 4;
  Schedule schedule = Schedule::one_f_one_b;
  /// Chunks of the model per rank (interleaved 1F1B only; 1 otherwise).
  int virtual_stages = 1;
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

/// Checks the options against `stages` ranks, naming what does not fit.
inline void check_options(const PipelineOptions& options, int stages) {
  if (options.micro_batches < 1) throw std::invalid_argument("accel pipeline: micro_batches must be at least 1");
  const bool interleaved = options.schedule == Schedule::interleaved_one_f_one_b;
  if (interleaved && options.virtual_stages < 2)
    throw std::invalid_argument("accel pipeline: the interleaved 1F1B schedule needs virtual_stages of 2 or more "
                                "(with 1 it is plain 1F1B: use PipelineSchedule::one_f_one_b)");
  if (!interleaved && options.virtual_stages != 1)
    throw std::invalid_argument("accel pipeline: virtual_stages = " + std::to_string(options.virtual_stages) +
                                " needs schedule = PipelineSchedule::interleaved_one_f_one_b");
  if (interleaved && options.micro_batches % stages != 0)
    throw std::invalid_argument("accel pipeline: interleaved 1F1B runs micro-batches in groups of the " +
                                std::to_string(stages) + " stages; micro_batches = " +
                                std::to_string(options.micro_batches) + " does not divide by it");
}

/// One step of a rank's schedule: the forward or backward of micro-batch
/// `micro` through its chunk `chunk` (0 .. virtual_stages-1).
struct ScheduledPass {
  bool forward;
  int chunk;
  int micro;
};

/// Rank `stage`'s order of passes (NOTE [Pipeline schedules]).
inline std::vector<ScheduledPass> schedule_for(Schedule schedule, int stages, int stage, int micro_batches,
                                               int virtual_stages) {
  std::vector<ScheduledPass> order;
  const int m = micro_batches, p = stages, v = virtual_stages;
  if (schedule == Schedule::gpipe) {
    for (int i = 0; i < m; ++i) order.push_back({true, 0, i});
    for (int i = m; i-- > 0;) order.push_back({false, 0, i});
    return order;
  }
  // The k-th forward (backward) of this rank: micro-batches in groups of p,
  // each group through chunk 0, 1, ... (backward: the last chunk first).
  auto pass = [&](int k, bool forward) {
    const int in_group = k % (p * v), chunk = in_group / p;
    return ScheduledPass{forward, forward ? chunk : v - 1 - chunk, (k / (p * v)) * p + k % p};
  };
  const int total = m * v;
  int warmup = std::min(p - stage - 1, m);  // plain 1F1B (v = 1)
  if (v > 1) warmup = m == p ? total : std::min((p - stage - 1) * 2 + (v - 1) * p, total);
  int next_forward = 0, next_backward = 0;
  for (; next_forward < warmup; ++next_forward) order.push_back(pass(next_forward, true));
  for (; next_forward < total; ++next_forward, ++next_backward) {
    order.push_back(pass(next_forward, true));
    order.push_back(pass(next_backward, false));
  }
  for (; next_backward < total; ++next_backward) order.push_back(pass(next_backward, false));
  return order;
}

class Pipeline {
 public:
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

  /// This rank's stage of `model` on the pipeline `group` (its rank is the
  /// stage); under interleaved 1F1B its virtual_stages chunks.
  Pipeline(const torch::nn::Sequential& model, comm::Communicator& group, PipelineOptions options = {})
      : group_(&group), options_(options) {
    check_options(options, group.size());
    const int p = group.size(), v = options.virtual_stages;
    for (int j = 0; j < v; ++j) chunks_.push_back(split_stage(model, p * v, group.rank() + j * p));
  }

  /// This stage's layers as a module of their own (the same layer objects),
  /// every chunk's in order; a checkpointed layer (NOTE [Checkpointing
  /// wrapped units]) is called as such and registered as the layer it runs.
  torch::nn::Sequential stage_module() const {
    torch::nn::Sequential module;
    for (const auto& chunk : chunks_)
      for (const auto& layer : chunk) {
        module->push_back(layer);
        if (auto runs = nn::entry_module(layer); runs != layer.ptr())
          module->replace_module(std::to_string(module->size() - 1), runs);
      }
    return module;
  }

  /// This stage's parameters: what its optimizer steps.
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    for (const auto& chunk : chunks_)
      for (const auto& layer : chunk)
        for (auto& p : nn::entry_module(layer)->parameters()) out.push_back(p);
    return out;
  }
  int virtual_stages() const { return options_.virtual_stages; }
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
    held_.assign(static_cast<std::size_t>(m) * chunks_.size(), {});
    loss_sum_ = 0;
    in_flight_ = 0;
    peak_ = 0;
    held_bytes_ = 0;
    peak_bytes_ = 0;
    wait_seconds_ = 0;
    const auto started = std::chrono::steady_clock::now();
    for (const auto& pass : schedule_for(options_.schedule, stages(), stage_index(), m, options_.virtual_stages)) {
      if (pass.forward) forward(pass.chunk, pass.micro, loss_fn);
      else backward(pass.chunk, pass.micro);
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

  // Chunk j of this rank is the model's chunk c = s + j*p of p*v; its input
  // comes from chunk c-1 on the previous rank (rank p-1 for rank 0), its
  // output goes to chunk c+1 on the next. Messages are tagged by the chunk
  // they are for, so every (chunk, micro-batch, direction) has its own.
  int global_chunk(int j) const { return stage_index() + j * stages(); }
  int chunk_count() const { return stages() * options_.virtual_stages; }
  int previous_rank() const { return (stage_index() + stages() - 1) % stages(); }
  int next_rank() const { return (stage_index() + 1) % stages(); }
  Held& held(int j, int i) { return held_[static_cast<std::size_t>(j) * options_.micro_batches + i]; }

  void forward(int j, int i, const LossFn& loss_fn) {
    const int c = global_chunk(j);
    at::Tensor input = c == 0 ? inputs_[i] : receive(previous_rank(), tag(c, i, false)).requires_grad_(true);
    at::Tensor output = input;
    for (auto& layer : chunks_[j]) output = layer.forward(output);
    auto& held = this->held(j, i);
    held.input = input;
    held.output = output;
    if (c == chunk_count() - 1) {
      held.loss = loss_fn(output, targets_[i]) / options_.micro_batches;
      loss_sum_ += held.loss.item<double>();
    } else {
      send(output.detach(), next_rank(), tag(c + 1, i, false));
    }
    peak_ = std::max(peak_, ++in_flight_);
    held_bytes_ += bytes(input) + bytes(output);
    peak_bytes_ = std::max(peak_bytes_, held_bytes_);
  }

  static std::int64_t bytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

  void backward(int j, int i) {
    const int c = global_chunk(j);
    auto& held = this->held(j, i);
    if (c == chunk_count() - 1) (loss_multiplier_ == 1.0 ? held.loss : held.loss * loss_multiplier_).backward();
    else held.output.backward(receive(next_rank(), tag(c, i, true)));
    if (c != 0) send(held.input.grad(), previous_rank(), tag(c - 1, i, true));
    held_bytes_ -= bytes(held.input) + bytes(held.output);
    held = {};
    --in_flight_;
  }

  // The message for chunk `chunk`: its input (forward) or its output's gradient.
  int tag(int chunk, int micro_batch, bool gradient) const {
    return 2 * (chunk * options_.micro_batches + micro_batch) + (gradient ? 1 : 0);
  }

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
  std::vector<std::vector<torch::nn::AnyModule>> chunks_;  // this rank's, in model order
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
