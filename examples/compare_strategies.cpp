// Tutorial: which strategy trains this model fastest, and in how much
// memory? accel::bench::compare trains the GPT of examples/gpt.cpp under
// each strategy in turn and prints one row per strategy: step time, samples
// per second, the ratio to the first strategy, time blocked on
// communication, per-rank model state and peak memory, and the bytes each
// kind of collective moved per step beside what the strategy's formula says.
//
//   ./build/examples/compare_strategies                       # forks 2 ranks itself
//   ./build/tools/accel launch --num_processes 2 ./build/examples/compare_strategies
//   ./build/examples/compare_strategies --steps 20 --rounds 5 --json results.jsonl
//
// Your own model: replace the four callables of the Workload below.

#include <ATen/ops/randint.h>
#include <torch/optim/adam.h>

#include <accel/bench.hpp>

#include "flags.hpp"
#include "gpt_model.hpp"

#include <cstdio>
#include <memory>
#include <string>

int main(int argc, char** argv) {
  using example::flag;
  gpt::Config config{.vocab = 256, .context = 32, .width = 128, .heads = 4, .layers = 4};
  const std::int64_t batch_per_rank = 8;

  // 1. The workload: the model (on the tensor group the strategy gives it),
  //    the optimizer, each data rank's batch of a step, and the loss.
  accel::bench::Workload workload{
      .model = [&](accel::comm::Communicator& tp) { return gpt::make_gpt(config, tp); },
      .optimizer = [](std::vector<at::Tensor> parameters) {
        return std::make_unique<torch::optim::Adam>(parameters, torch::optim::AdamOptions(1e-3));
      },
      .batch = [&](std::int64_t step, int data_rank) {
        auto generator = at::make_generator<at::CPUGeneratorImpl>(step * 1000 + data_rank);
        auto tokens = at::randint(config.vocab, {batch_per_rank, config.context + 1}, generator,
                                  at::TensorOptions().dtype(at::kLong));
        return accel::bench::Batch{tokens.narrow(1, 0, config.context), tokens.narrow(1, 1, config.context)};
      },
      // The logits stay split over the tensor group: this form of the loss gets the group.
      .loss = [](const at::Tensor& logits, const at::Tensor& targets, accel::comm::Communicator& tp) {
        return accel::nn::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), tp);
      }};

  // 2. How to measure: untimed warm-up steps, timed steps, and rounds (the
  //    strategies run interleaved, so machine noise hits them alike).
  accel::bench::Options options{.warmup = 3,
                                .steps = std::stoi(flag(argc, argv, "steps", "10")),
                                .rounds = std::stoi(flag(argc, argv, "rounds", "3")),
                                .json_lines = flag(argc, argv, "json", ""),
                                .spawn = 2};  // without `accel launch`: fork 2 ranks here

  // 3. The strategies, as values of their types (with their settings).
  accel::bench::compare(workload, options,  //
                        accel::DDP{},       //
                        accel::ZeRO<1>{}, accel::ZeRO<2>{},
                        accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP,
                                       .transformer_layer_cls_to_wrap = {"BlockImpl"}},
                        accel::Parallel<>{.tensor = 2},
                        accel::Parallel<>{.pipeline = 2, .micro_batches = 4},
                        accel::bench::Case<accel::DDP, accel::BF16>{});
  return 0;
}
