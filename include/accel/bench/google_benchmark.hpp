#pragma once
// The strategy comparison as Google Benchmark benchmarks, so a user's own
// benchmark binary keeps its filters, repetitions and JSON output:
//   accel::bench::register_benchmarks(workload, {.warmup = 3, .steps = 20},
//                                     accel::DDP{}, accel::ZeRO<2>{}, accel::ZeRO<3>{});
//   return accel::bench::run_benchmarks(argc, argv);   // instead of BENCHMARK_MAIN()
// Each benchmark, "accel/<strategy>", is one Trainer; an iteration is one
// training step. Counters (per step, this rank's; the main process reports):
// samples/s (the global batch), <collective>_bytes and the formula's
// predicted_<collective>_bytes, blocked_ms, model_state_bytes, peak_memory_bytes.
//
// Under `accel launch` every rank must run the same steps in the same
// order, so the iteration count is fixed (Options::steps) and random
// interleaving, whose order differs per process, is refused.

#include <benchmark/benchmark.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/bench/compare.hpp"

namespace accel::bench {

namespace detail {

template <class W, class S, class P, class D>
void register_one(W& w, const Options& o, const Case<S, P, D>& c) {
  const std::string name = "accel/" + (c.name.empty() ? strategy_name<S, P>(c.strategy) : c.name);
  auto run = [&w, o, c](benchmark::State& state) {
    try {
      TrainingRun<S, P, D, W> training(w, c, o);
      std::int64_t i = 0;
      for (; i < o.warmup; ++i) training.step(i);
      device::reset_peak_memory(training.trainer().device());
      const auto before = comm::process_traffic();
      for (auto _ : state) training.step(i++);
      const auto traffic = comm::process_traffic() - before;
      const double steps = static_cast<double>(state.iterations());
      state.counters["samples/s"] = benchmark::Counter(static_cast<double>(training.samples_per_step()),
                                                       benchmark::Counter::kIsIterationInvariantRate);
      for (std::size_t k = 0; k < comm::collective_kinds; ++k) {
        const std::string kind(comm::collective_name(static_cast<comm::Collective>(k)));
        const double formula = training.predicted() ? static_cast<double>((*training.predicted())[k]) : 0;
        if (traffic.bytes[k]) state.counters[kind + "_bytes"] = static_cast<double>(traffic.bytes[k]) / steps;
        if (formula) state.counters["predicted_" + kind + "_bytes"] = formula;
      }
      state.counters["blocked_ms"] = std::chrono::duration<double, std::milli>(traffic.blocked).count() / steps;
      const auto model_state = training.model_state_bytes();
      state.counters["model_state_bytes"] = static_cast<double>(model_state.total() + model_state.offloaded_total());
      state.counters["peak_memory_bytes"] = static_cast<double>(device::peak_memory_bytes(training.trainer().device()));
    } catch (const std::exception& e) {
      state.SkipWithError(e.what());
    }
  };
  benchmark::RegisterBenchmark(name.c_str(), run)
      ->Iterations(o.steps)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

// Reports nothing: the non-main ranks run the benchmarks in step with the
// main process, which alone prints.
class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace detail

/// One Google Benchmark per strategy (values or Case<...>), see above.
template <class W, class... Strategies>
  requires workload<W>
void register_benchmarks(W& w, const Options& o, const Strategies&... strategies) {
  (detail::register_one(w, o, detail::as_case<Strategies>::make(strategies)), ...);
}

/// benchmark::Initialize and RunSpecifiedBenchmarks, on every rank, with
/// only the main process reporting (its console and --benchmark_out).
inline int run_benchmarks(int argc, char** argv) {
  const char* rank_text = std::getenv("RANK");
  const bool main_process = !rank_text || std::string(rank_text) == "0";
  const char* world_text = std::getenv("WORLD_SIZE");
  const bool several = world_text && std::atoi(world_text) > 1;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (several && arg.rfind("--benchmark_enable_random_interleaving", 0) == 0 &&
        arg != "--benchmark_enable_random_interleaving=false")
      throw std::invalid_argument("accel::bench: --benchmark_enable_random_interleaving shuffles each rank "
                                  "differently, and ranks must run the same steps together; use "
                                  "--benchmark_repetitions (accel::bench::compare interleaves strategies itself)");
    if (!main_process && arg.rfind("--benchmark_out", 0) == 0) continue;  // one writer
    args.push_back(argv[i]);
  }
  int count = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&count, args.data());
  if (main_process) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    detail::SilentReporter silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  return 0;
}

}  // namespace accel::bench
