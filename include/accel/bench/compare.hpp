#pragma once
// NOTE [Strategy comparison]
// accel::bench::compare trains the user's own model under each strategy in
// a list, in one program, and reports what each costs (bench/result.hpp).
//   auto results = accel::bench::compare(workload, {.steps = 20},
//                                        accel::DDP{}, accel::ZeRO<1>{}, accel::ZeRO<3>{},
//                                        accel::bench::Case<accel::DDP, accel::BF16>{});
// It runs on the ranks `accel launch` started, or, with Options::spawn = n
// and no launcher, forks n ranks on loopback itself.
//
// Each strategy gets a fresh Trainer, the same seed, model, optimizer and
// batches; `warmup` untimed steps, then `steps` timed ones. Strategies run
// interleaved over `rounds` rounds (round 1: A B C, round 2: A B C, ...),
// so a slow phase of a noisy machine hits all of them, and each round's
// median step is divided by the first strategy's in the same round: the
// ratios are what to read, absolute times drift.
//
// A step's time is the slowest rank's (the step ends with the loss on the
// host, so device work is included). Bytes per kind of collective are
// counted by accel's communicator as the collectives are issued
// (comm/traffic.hpp): exact, not estimated. A strategy that fails (a shape
// that does not divide, out of memory) is reported with the failing rank's
// error and the others still run; a failure on one rank only costs the
// others the collective timeout (TrainerOptions::timeout) first.

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

#include "accel/accel.hpp"
#include "accel/bench/result.hpp"
#include "accel/bench/traffic_model.hpp"
#include "accel/device/peak_memory.hpp"
#include "accel/device/threads.hpp"

namespace accel::bench {

/// One rank's batch for one step: what `loss` compares the model's output with.
struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

/// The user's model, optimizer, data and loss, as four callables:
///   model(tensor_group)      -> a module holder (build tensor-parallel layers on the group;
///                               a torch::nn::Sequential also runs under pipeline parallelism)
///   optimizer(parameters)    -> std::unique_ptr (or shared_ptr) to a torch::optim optimizer
///   batch(step, data_rank)   -> Batch, this data rank's share of step `step`
///   loss(outputs, targets)   -> the scalar loss; or loss(outputs, targets, tensor_group) for
///                               outputs split over the tensor group (vocab_parallel_cross_entropy)
template <class MakeModel, class MakeOptimizer, class MakeBatch, class Loss>
struct Workload {
  MakeModel model;
  MakeOptimizer optimizer;
  MakeBatch batch;
  Loss loss;
};

template <class W>
concept workload = requires(W& w, comm::Communicator& group, std::vector<at::Tensor> parameters, std::int64_t step,
                            int rank, const at::Tensor& t) {
  w.model(group)->parameters();
  { *w.optimizer(parameters) } -> std::convertible_to<torch::optim::Optimizer&>;
  { w.batch(step, rank) } -> std::convertible_to<Batch>;
  requires requires { { w.loss(t, t) } -> std::convertible_to<at::Tensor>; } ||
               requires { { w.loss(t, t, group) } -> std::convertible_to<at::Tensor>; };
};

/// One entry of a comparison: a strategy with its settings, under a
/// precision and device. A bare strategy value means Case<Strategy>.
template <class Strategy, class Precision = FP32, class Device = CPU>
struct Case {
  using strategy_type = Strategy;
  using precision_type = Precision;
  using device_type = Device;
  Strategy strategy{};
  std::string name{};  ///< empty: from the types (strategy_name)
  Precision precision{};
};

struct Options {
  int warmup = 3;  ///< untimed steps before each timed run
  int steps = 10;  ///< timed steps per strategy and round
  int rounds = 3;  ///< strategies run interleaved this many times
  std::uint64_t seed = 0;
  /// The main process appends one JSON line per strategy here ("": none).
  std::string json_lines{};
  /// The main process prints the table (bench/result.hpp's format_table).
  bool print = true;
  /// Without a launcher (no WORLD_SIZE), fork this many ranks on loopback (0: run here).
  int spawn = 0;
  /// Spawned ranks still running after this are killed and compare throws: a hang is a failure.
  std::chrono::milliseconds spawn_timeout{std::chrono::hours(1)};
  /// Each Trainer's options; gradient accumulation is always 1 (one optimizer step per step).
  TrainerOptions trainer{};
};

/// A readable name from the strategy's type and settings, e.g. "ZeRO-3+offload",
/// "Parallel<DDP>(t2 p1)", with the precision when it is not fp32.
template <class Strategy, class Precision = FP32>
std::string strategy_name(const Strategy& s) {
  std::string name;
  if constexpr (std::is_same_v<Strategy, SingleProcess>) name = "single";
  else if constexpr (std::is_same_v<Strategy, DDP>)
    name = s.comm_hook == CommHook::none ? "DDP" : s.comm_hook == CommHook::fp16 ? "DDP+fp16 hook" : "DDP+bf16 hook";
  else if constexpr (std::is_same_v<Strategy, ZeRO<1>> || std::is_same_v<Strategy, ZeRO<2>> ||
                     std::is_same_v<Strategy, ZeRO<3>>)
    name = "ZeRO-" + std::to_string(Strategy::stage) + (s.cpu_offload ? "+offload" : "");
  else if constexpr (std::is_same_v<Strategy, HybridShard>)
    name = "HybridShard" + (s.shard_group_size ? "(" + std::to_string(s.shard_group_size) + ")" : std::string());
  else if constexpr (requires { s.data; s.tensor; s.pipeline; })
    name = "Parallel<" + strategy_name(s.data) + ">(t" + std::to_string(s.tensor) + " p" + std::to_string(s.pipeline) + ")";
  else name = "custom";
  if constexpr (!std::is_same_v<Precision, FP32>) name += std::string(" ") + Precision::name;
  return name;
}

namespace detail {

template <class T>
struct as_case {
  using type = Case<T>;
  static type make(const T& strategy) { return {strategy}; }
};
template <class S, class P, class D>
struct as_case<Case<S, P, D>> {
  using type = Case<S, P, D>;
  static type make(const type& c) { return c; }
};

// What one rank measured in one run of one strategy.
struct LocalRun {
  bool ok = true;
  std::string error;
  std::vector<double> step_ms;
  comm::Traffic traffic;
  ModelStateBytes model_state;
  std::int64_t peak_memory_bytes = 0;
  int data_world = 1;
  std::int64_t samples_per_step = 0;
  std::optional<TrafficBytes> predicted;
  std::vector<std::int64_t> bucket_numels;
};

}  // namespace detail

/// One strategy set up for timing: its Trainer, the workload's model and
/// optimizer prepared, and what the formula predicts. compare() and the
/// Google Benchmark integration both drive it, one `step(i)` at a time.
template <class S, class P, class D, class W>
class TrainingRun {
 public:
  TrainingRun(W& w, const Case<S, P, D>& c, const Options& o)
      : w_(w), trainer_(c.strategy, c.precision, D{}, single_step(o.trainer)) {
    trainer_.set_seed(o.seed);
    model_.emplace(w.model(trainer_.tensor_group()));
    TrafficInputs inputs{.world = trainer_.num_processes()};
    for (const auto& p : (*model_)->parameters())
      if (p.requires_grad()) inputs.trainable_numel += p.numel(), inputs.element_size = p.element_size();
    optimizer_ = w.optimizer((*model_)->parameters());
    trainer_.prepare(*model_, *optimizer_);
    if constexpr (strategy::sharded_engine<typename Trainer<S, P, D>::engine_type>) {
      const auto layout = *trainer_.strategy_engine().shard_layout();
      inputs.shard_count = layout.count;
      inputs.bucket_numels = layout.bucket_numels;
      bucket_numels_ = layout.bucket_numels;
    }
    predicted_ = predicted_traffic<S, P>(c.strategy, inputs);
  }

  /// Training step `i` on this data rank's batch; returns once the loss is on the host.
  void step(std::int64_t i) {
    auto& data = trainer_.data_group();
    Batch batch = w_.batch(i, data.rank());
    samples_per_step_ = batch.inputs.size(0) * data.size();
    auto loss = [this](const at::Tensor& outputs, const at::Tensor& targets) -> at::Tensor {
      if constexpr (requires { w_.loss(outputs, targets, trainer_.tensor_group()); })
        return w_.loss(outputs, targets, trainer_.tensor_group());
      else
        return w_.loss(outputs, targets);
    };
    if constexpr (std::is_same_v<Model, torch::nn::Sequential>)
      trainer_.step(batch.inputs, batch.targets, loss);
    else
      (void)trainer_.step([&] { return loss((*model_)->forward(batch.inputs), batch.targets); }).template item<double>();
  }

  Trainer<S, P, D>& trainer() { return trainer_; }
  const std::optional<TrafficBytes>& predicted() const { return predicted_; }
  /// The global batch of the last step: per-rank batch x data-parallel ranks.
  std::int64_t samples_per_step() const { return samples_per_step_; }
  ModelStateBytes model_state_bytes() const { return trainer_.model_state_bytes(); }
  /// The sharded engine's buckets as it built them (elements before padding); empty for the others.
  const std::vector<std::int64_t>& bucket_numels() const { return bucket_numels_; }

 private:
  static TrainerOptions single_step(TrainerOptions options) {
    options.gradient_accumulation_steps = 1;
    return options;
  }
  using Model = std::remove_cvref_t<decltype(std::declval<W&>().model(std::declval<comm::Communicator&>()))>;
  using OptimizerHandle = decltype(std::declval<W&>().optimizer(std::declval<std::vector<at::Tensor>>()));

  W& w_;
  Trainer<S, P, D> trainer_;
  // Declared after the trainer, so destroyed before it (as in a training program).
  std::optional<Model> model_;
  OptimizerHandle optimizer_;
  std::optional<TrafficBytes> predicted_;
  std::int64_t samples_per_step_ = 0;
  std::vector<std::int64_t> bucket_numels_;
};

namespace detail {

template <class S, class P, class D, class W>
LocalRun run_once(W& w, const Case<S, P, D>& c, const Options& o) {
  using Clock = std::chrono::steady_clock;
  LocalRun run;
  try {
    TrainingRun<S, P, D, W> training(w, c, o);
    run.predicted = training.predicted();
    run.data_world = training.trainer().data_group().size();
    std::int64_t i = 0;
    for (; i < o.warmup; ++i) training.step(i);
    device::reset_peak_memory(training.trainer().device());
    const auto before = comm::process_traffic();
    for (int k = 0; k < o.steps; ++k, ++i) {
      const auto start = Clock::now();
      training.step(i);
      run.step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
    run.traffic = comm::process_traffic() - before;
    run.peak_memory_bytes = device::peak_memory_bytes(training.trainer().device());
    run.samples_per_step = training.samples_per_step();
    run.model_state = training.model_state_bytes();
    run.bucket_numels = training.bucket_numels();
  } catch (const std::exception& e) {
    run.ok = false;
    run.error = e.what();
  }
  return run;
}

// Every rank's string, on every rank (lengths first, then the padded bytes).
inline std::vector<std::string> all_gather_strings(comm::Communicator& world, const std::string& mine) {
  at::Tensor bytes = at::empty({static_cast<std::int64_t>(mine.size())}, at::TensorOptions().dtype(at::kByte));
  std::copy(mine.begin(), mine.end(), bytes.data_ptr<std::uint8_t>());
  std::vector<std::string> out;
  for (const auto& b : comm::all_gather_ragged(world, bytes, "all-gather of benchmark errors"))
    out.emplace_back(reinterpret_cast<const char*>(b.data_ptr<std::uint8_t>()), static_cast<std::size_t>(b.numel()));
  return out;
}

inline std::vector<at::Tensor> all_gather_doubles(comm::Communicator& world, const std::vector<double>& values,
                                                  const char* what) {
  at::Tensor mine = at::tensor(values, at::TensorOptions().dtype(at::kDouble));
  return world.all_gather(mine, what);
}

// Folds one run of every rank into `result`; false if any rank failed.
inline bool merge(comm::Communicator& world, const LocalRun& run, CaseResult& result, double& round_median) {
  const auto errors = all_gather_strings(world, run.ok ? "" : run.error.empty() ? "failed" : run.error);
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      result.ok = false;
      result.error = errors[r].find("rank ") != std::string::npos ? errors[r]
                                                                   : "rank " + std::to_string(r) + ": " + errors[r];
      return false;
    }
  std::vector<double> slowest = run.step_ms;
  for (const auto& t : all_gather_doubles(world, run.step_ms, "all-gather of benchmark step times"))
    for (std::size_t k = 0; k < slowest.size(); ++k) slowest[k] = std::max(slowest[k], t[k].item<double>());
  round_median = median_of(slowest);
  result.step_ms.insert(result.step_ms.end(), slowest.begin(), slowest.end());
  std::vector<double> figures;
  for (std::size_t k = 0; k < comm::collective_kinds; ++k)
    figures.push_back(static_cast<double>(run.traffic.bytes[k])), figures.push_back(static_cast<double>(run.traffic.calls[k]));
  figures.push_back(std::chrono::duration<double, std::milli>(run.traffic.blocked).count());
  figures.push_back(static_cast<double>(run.peak_memory_bytes));
  for (auto bytes : {run.model_state.parameters, run.model_state.gradients, run.model_state.optimizer_state,
                     run.model_state.offloaded_total()})
    figures.push_back(static_cast<double>(bytes));
  const auto all = all_gather_doubles(world, figures, "all-gather of benchmark figures");
  const bool first_round = result.ranks.empty();
  result.ranks.resize(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    auto& f = result.ranks[r];
    const auto v = [&](std::size_t k) { return all[r][static_cast<std::int64_t>(k)].item<double>(); };
    f.rank = static_cast<int>(r);
    for (std::size_t k = 0; k < comm::collective_kinds; ++k)
      f.bytes[k] = static_cast<std::uint64_t>(v(2 * k)), f.calls[k] = static_cast<std::uint64_t>(v(2 * k + 1));
    const std::size_t tail = 2 * comm::collective_kinds;
    f.blocked_ms_per_step = run.step_ms.empty() ? 0 : v(tail) / static_cast<double>(run.step_ms.size());
    f.peak_memory_bytes = std::max(first_round ? 0 : f.peak_memory_bytes, static_cast<std::int64_t>(v(tail + 1)));
    f.parameter_bytes = static_cast<std::int64_t>(v(tail + 2));
    f.gradient_bytes = static_cast<std::int64_t>(v(tail + 3));
    f.optimizer_state_bytes = static_cast<std::int64_t>(v(tail + 4));
    f.offloaded_bytes = static_cast<std::int64_t>(v(tail + 5));
    f.model_state_bytes = f.parameter_bytes + f.gradient_bytes + f.optimizer_state_bytes + f.offloaded_bytes;
  }
  result.world = world.size();
  result.data_world = run.data_world;
  result.samples_per_step = run.samples_per_step;
  result.predicted = run.predicted;
  result.bucket_numels = run.bucket_numels;
  return true;
}

template <class W, class... Cases>
std::vector<CaseResult> compare_here(W& w, const Options& o, const Cases&... cases) {
  const auto info = comm::world_from_environment();
  // Runs one round of strategy k on every rank and folds it into its result.
  std::vector<std::function<bool(CaseResult&, double&)>> runners;
  std::vector<CaseResult> results;
  auto add = [&](const auto& c) {
    using C = std::remove_cvref_t<decltype(c)>;
    runners.push_back([&w, &o, &info, c](CaseResult& result, double& round_median) {
      // The Trainers' own process group (shared per process), for the figures.
      auto world = comm::Communicator::connect(info, device::traits<typename C::device_type>::backend, o.trainer.timeout);
      return merge(world, run_once(w, c, o), result, round_median);
    });
    CaseResult result;
    result.name = c.name.empty() ? strategy_name<typename C::strategy_type, typename C::precision_type>(c.strategy) : c.name;
    result.steps = o.steps;
    results.push_back(std::move(result));
  };
  (add(as_case<Cases>::make(cases)), ...);

  std::vector<std::vector<double>> medians(results.size(), std::vector<double>(o.rounds, 0.0));
  for (int round = 0; round < o.rounds; ++round)
    for (std::size_t k = 0; k < results.size(); ++k)
      if (results[k].ok) runners[k](results[k], medians[k][round]);
  for (std::size_t k = 0; k < results.size(); ++k) {
    auto& r = results[k];
    if (!r.ok) continue;
    r.median_ms = median_of(r.step_ms);
    r.p90_ms = percentile_of(r.step_ms, 90);
    r.samples_per_s = r.median_ms > 0 ? static_cast<double>(r.samples_per_step) / (r.median_ms / 1e3) : 0;
    if (!results.front().ok) continue;
    for (int round = 0; round < o.rounds; ++round) r.ratio_by_round.push_back(medians[k][round] / medians[0][round]);
    r.ratio = median_of(r.ratio_by_round);
  }
  if (info.rank == 0) {
    if (o.print) std::printf("%s", format_table(results).c_str()), std::fflush(stdout);
    if (!o.json_lines.empty()) {
      std::ofstream out(o.json_lines, std::ios::app);
      for (const auto& r : results) out << to_json(r).dump() << "\n";
      if (!out) throw std::runtime_error("accel::bench: cannot write " + o.json_lines);
    }
  }
  return results;
}

}  // namespace detail

/// Trains `w` under each strategy (values such as accel::DDP{} or
/// accel::ZeRO<3>{...}, or Case<Strategy, Precision, Device>{...}) and
/// returns, on every rank, what each cost (NOTE [Strategy comparison]).
/// The main process prints the table and writes the JSON lines.
template <class W, class... Strategies>
  requires workload<W> && (sizeof...(Strategies) > 0)
std::vector<CaseResult> compare(W& w, const Options& o, const Strategies&... strategies) {
  if (o.warmup < 0 || o.steps < 1 || o.rounds < 1)
    throw std::invalid_argument("accel::bench: needs warmup >= 0, steps >= 1 and rounds >= 1");
  if (o.spawn <= 0 || std::getenv("WORLD_SIZE")) return detail::compare_here(w, o, strategies...);
  // No launcher: fork the ranks here; rank 0 hands the results back in a file.
  const auto handoff = std::filesystem::temp_directory_path() /
                       ("accel_bench_" + std::to_string(::getpid()) + ".jsonl");
  std::filesystem::remove(handoff);
  SpawnOptions spawn_options;
  spawn_options.timeout = o.spawn_timeout;
  spawn(o.spawn, [&](int rank) {
    // A forked rank keeps the parent's thread pools, sized for the whole
    // machine: one thread each, as under `accel launch` (OMP_NUM_THREADS=1).
    device::limit_cpu_threads(spawn_options.threads_per_process);
    auto results = detail::compare_here(w, o, strategies...);
    if (rank != 0) return;
    std::ofstream out(handoff);
    for (const auto& r : results) out << to_json(r).dump() << "\n";
  }, spawn_options);
  std::vector<CaseResult> results;
  std::ifstream in(handoff);
  for (std::string line; std::getline(in, line);) results.push_back(case_from_json(nlohmann::json::parse(line)));
  std::filesystem::remove(handoff);
  return results;
}

}  // namespace accel::bench
