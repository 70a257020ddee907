// The strategy comparison as Google Benchmark benchmarks
// (<accel/bench/google_benchmark.hpp>): the benchmark MLP under DDP and
// ZeRO-1/2/3, one benchmark per strategy, with bytes per collective,
// blocked time, model state and peak memory as counters.
//
//   ./build/tools/accel launch --num_processes 2 ./build/bench/strategies_gbench
//   ./build/tools/accel launch --num_processes 2 ./build/bench/strategies_gbench
//       --benchmark_filter=ZeRO --benchmark_repetitions=3 --benchmark_format=json   (one line)
//
// Flags of its own (before Google Benchmark's): --widths a,b,c (default
// 512,1024,1024,10), --batch N per rank (default 32), --steps N (default 10).

#include <ATen/ops/cross_entropy_loss.h>
#include <torch/optim/adam.h>

#include <accel/bench/google_benchmark.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

std::string take_flag(int& argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) {
      std::string value = argv[i + 1];
      for (int k = i; k + 2 <= argc; ++k) argv[k] = argv[k + 2];
      argc -= 2;
      return value;
    }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  bench::one_thread();
  std::vector<std::int64_t> widths;
  std::stringstream list(take_flag(argc, argv, "widths", "512,1024,1024,10"));
  for (std::string part; std::getline(list, part, ',');) widths.push_back(std::stoll(part));
  const std::int64_t batch = std::stoll(take_flag(argc, argv, "batch", "32"));
  const int steps = std::stoi(take_flag(argc, argv, "steps", "10"));

  std::vector<bench::Batch> batches;
  accel::bench::Workload workload{
      .model = [&](accel::comm::Communicator&) { return bench::MLP(widths); },
      .optimizer = [](std::vector<at::Tensor> parameters) {
        return std::make_unique<torch::optim::Adam>(parameters, torch::optim::AdamOptions(1e-3));
      },
      .batch = [&](std::int64_t i, int rank) {
        if (batches.empty()) batches = bench::make_batches(8, batch, widths.front(), widths.back(), 1000 + rank);
        const auto& b = batches[i % batches.size()];
        return accel::bench::Batch{b.data, b.target};
      },
      .loss = [](const at::Tensor& logits, const at::Tensor& target) { return at::cross_entropy_loss(logits, target); }};
  accel::bench::register_benchmarks(workload, {.warmup = 2, .steps = steps}, accel::DDP{}, accel::ZeRO<1>{},
                                    accel::ZeRO<2>{}, accel::ZeRO<3>{});
  return accel::bench::run_benchmarks(argc, argv);
}
