// Trainer<SingleProcess, FP32, CPU>::step against the hand-written LibTorch
// loop (zero_grad, forward, loss.backward(), optimizer.step()) on the same MLP
// (widths 512-H-H-H-10, batch 64) and the same data, one intra-op thread.
//
//   meson test -C build --benchmark --verbose         # the benchmark() target below
//   ./build/bench/bench_trainer --benchmark_repetitions=9
//       --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true  (one line)
//
// Three families, each over H in {128, 1024}:
//   BM_HandLoop/H     the plain LibTorch loop
//   BM_Trainer/H      trainer.step(...) on an identical model, optimizer and data
//   BM_Interleaved/H  both in one loop, alternating which goes first every
//                     iteration, timed separately: counters hand_ms, trainer_ms
//                     and trainer/hand. Immune to the host's speed drifting
//                     between benchmarks, so this is the ratio to trust.
// At the end, the ratio of the BM_Trainer and BM_HandLoop medians (or means)
// is printed as well.

#include <benchmark/benchmark.h>
#include <torch/optim/sgd.h>

#include <accel/trainer.hpp>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

constexpr std::int64_t kBatch = 64, kFeatures = 512, kClasses = 10;

std::vector<std::int64_t> widths_for(std::int64_t hidden) { return {kFeatures, hidden, hidden, hidden, kClasses}; }

// Both sides get the same weights (seed) and the same batches.
struct Setup {
  explicit Setup(std::int64_t hidden)
      : model((at::manual_seed(0), bench::MLP(widths_for(hidden)))),
        optimizer(model->parameters(), torch::optim::SGDOptions(0.01)),
        batches(bench::make_batches(8, kBatch, kFeatures, kClasses, 1)) {}
  bench::MLP model;
  torch::optim::SGD optimizer;
  std::vector<bench::Batch> batches;
};

inline void hand_step(Setup& s, std::size_t i) {
  s.optimizer.zero_grad();
  auto loss = bench::loss_of(s.model, s.batches[i % s.batches.size()]);
  loss.backward();
  s.optimizer.step();
}

using SingleTrainer = accel::Trainer<accel::SingleProcess, accel::FP32, accel::CPU>;

inline void trainer_step(SingleTrainer& trainer, Setup& s, std::size_t i) {
  const auto& b = s.batches[i % s.batches.size()];
  trainer.step([&] { return bench::loss_of(s.model, b); });
}

void BM_HandLoop(benchmark::State& state) {
  Setup s(state.range(0));
  for (std::size_t i = 0; i < 3; ++i) hand_step(s, i);  // warm-up: allocator, grads exist
  std::size_t i = 0;
  for (auto _ : state) hand_step(s, i++);
  state.SetItemsProcessed(state.iterations() * kBatch);
}

void BM_Trainer(benchmark::State& state) {
  Setup s(state.range(0));
  SingleTrainer trainer;
  trainer.prepare(s.model, s.optimizer);
  for (std::size_t i = 0; i < 3; ++i) trainer_step(trainer, s, i);
  std::size_t i = 0;
  for (auto _ : state) trainer_step(trainer, s, i++);
  state.SetItemsProcessed(state.iterations() * kBatch);
}

void BM_Interleaved(benchmark::State& state) {
  using Clock = std::chrono::steady_clock;
  Setup hand(state.range(0)), mine(state.range(0));
  SingleTrainer trainer;
  trainer.prepare(mine.model, mine.optimizer);
  for (std::size_t i = 0; i < 3; ++i) {
    hand_step(hand, i);
    trainer_step(trainer, mine, i);
  }
  double hand_s = 0, trainer_s = 0;
  std::size_t i = 0;
  for (auto _ : state) {
    const bool hand_first = (i & 1) == 0;
    double first = 0, second = 0;
    auto t0 = Clock::now();
    if (hand_first) hand_step(hand, i);
    else trainer_step(trainer, mine, i);
    auto t1 = Clock::now();
    if (hand_first) trainer_step(trainer, mine, i);
    else hand_step(hand, i);
    auto t2 = Clock::now();
    first = std::chrono::duration<double>(t1 - t0).count();
    second = std::chrono::duration<double>(t2 - t1).count();
    hand_s += hand_first ? first : second;
    trainer_s += hand_first ? second : first;
    state.SetIterationTime(first + second);
    ++i;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["hand_ms"] = 1e3 * hand_s / n;
  state.counters["trainer_ms"] = 1e3 * trainer_s / n;
  state.counters["trainer/hand"] = trainer_s / hand_s;
}

BENCHMARK(BM_HandLoop)->Arg(128)->Arg(1024)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_Trainer)->Arg(128)->Arg(1024)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_Interleaved)->Arg(128)->Arg(1024)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseManualTime();

// The console output, plus the Trainer/HandLoop ratio per H at the end.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& run : runs) {
      if (run.error_occurred) continue;
      const std::string key = run.run_name.function_name + "/" + run.run_name.args;
      if (run.run_type == Run::RT_Aggregate) {
        if (run.aggregate_name == "median") median_[key] = run.GetAdjustedRealTime();
      } else {
        auto& [sum, count] = iterations_[key];
        sum += run.GetAdjustedRealTime();
        ++count;
      }
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    for (const char* h : {"128", "1024"}) {
      auto value = [&](const std::string& f) -> double {
        const std::string key = f + "/" + h;
        if (auto it = median_.find(key); it != median_.end()) return it->second;
        if (auto it = iterations_.find(key); it != iterations_.end() && it->second.second > 0)
          return it->second.first / it->second.second;
        return 0;
      };
      const double hand = value("BM_HandLoop"), trainer = value("BM_Trainer");
      if (hand > 0 && trainer > 0)
        std::printf("Trainer/HandLoop step time ratio, hidden %s (%s of separate benchmarks): %.4f\n", h,
                    median_.count(std::string("BM_Trainer/") + h) ? "medians" : "means", trainer / hand);
    }
    std::fflush(stdout);
  }

 private:
  std::map<std::string, double> median_;
  std::map<std::string, std::pair<double, int>> iterations_;
};

}  // namespace

int main(int argc, char** argv) {
  bench::one_thread();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
