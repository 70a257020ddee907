// Data-parallel training throughput of accel::Trainer<accel::DDP>,
// Trainer<accel::ZeRO<1>> and Trainer<accel::ZeRO<2>>, with per-phase timing
// and this rank's model-state bytes.
//
//   ./build/tools/accel launch --num_processes 2 ./build/bench/ddp_throughput [flags]
//   ./build/bench/ddp_throughput [flags]            # one process: the compute-only reference
//
// Flags (all optional):
//   --steps N                timed steps (default 60)
//   --warmup N               untimed steps first (default 10)
//   --batch N                samples per process and step (default 64)
//   --widths a,b,c,...       MLP layer widths (default 512,1024,1024,1024,10)
//   --bucket_cap_mb X        DDP{.bucket_cap_mb} (default: accel's, 25)
//   --first_bucket_cap_mb X  DDP{.first_bucket_cap_mb} (default: accel's, 1)
//   --comm_hook none|fp16    DDP{.comm_hook}: gradients on the wire in fp16 (default none)
//   --phases N               afterwards, N steps split into phases (below; default 20, 0: none)
//   --comm_probe K           afterwards, K rounds of the same bucket all-reduces
//                            without any compute (communication floor)
//   --tag NAME               label on the RESULT line (default accel_<strategy>)
//   --strategy ddp|zero1|zero2|zero3|hybrid   Trainer<DDP> (default), Trainer<ZeRO<1|2|3>> (zero3: size-based units,
//                            --min_num_params), Trainer<HybridShard> (ZeRO-3's units, within shard groups of
//                            --shard_group_size ranks; default 0: LOCAL_WORLD_SIZE, HybridShard's own default)
//   --optimizer sgd|adam     SGD(lr=0.01) (default) or Adam(lr=1e-3)
//   --cpu_offload 1          ZeRO strategies: the optimizer steps host twins (NOTE [CPU offload]);
//                            on a CPU device this measures the offload path's copies alone
//   --memory 1               every rank prints, for the whole run (prepare included), the most host
//                            memory LibTorch had allocated at once (counted at the allocator), its
//                            peak resident set (VmHWM: that, the process's own memory and what the C
//                            library kept) and the activations' estimate (bench/memory_peaks.sh: the table),
//                            the most the host block cache held at once (in use and idle), and what
//                            glibc's malloc holds from the system at the end (mallinfo2: arena + hblkhd);
//                            with --phases, also the allocated peak within each phase (where a peak is reached)
//   --return_host_memory 1   freed host blocks over 1 MiB go back to the system (NOTE [Returning host
//                            memory], TrainerOptions::return_host_memory; the cache is then off)
//   --cache_host_memory 0    host blocks of 128 KiB or more are not kept for reuse (NOTE [Host blocks kept
//                            for reuse], TrainerOptions::cache_host_memory, on by default)
//   --build_on_meta 1        zero3: the model built on the meta device, each rank computing only its
//                            shards at prepare (NOTE [Models built on meta])
//
// The timed steps are measured by accel::bench::compare (<accel/bench.hpp>,
// NOTE [Strategy comparison]), the library's own facility, with one
// strategy and one round: the scripts interleave the runs themselves.
// Rank 0 prints every rank's model-state bytes, the bytes each kind of
// collective moved per step beside the strategy's formula, and one
// machine-readable line:
//   RESULT tag=NAME world=W global_samples_per_s=X steps_per_s=Y step_ms=Z
//          param_bytes=P grad_bytes=G optim_bytes=O
// (step_ms: the mean over steps of the slowest rank's step, comparable with
// the PyTorch scripts' slowest total time / steps; the bytes are rank 0's.)
// For a sharded engine, also its buckets as it built them, in bucket order:
//   BUCKETS tag=NAME numels=N1,N2,...
// Then every rank prints its phase times (median ms per step).
//
// The phases split Trainer::step exactly as it runs it (trainer.hpp; FP32,
// no scheduler, so unscale is a no-op): forward (under the precision's
// autocast scope), backward (trainer.backward's engine calls and
// loss.backward()), engine.synchronize_gradients() (the wait at the end of
// trainer.backward for the bucket all-reduces / reduce-scatters that backward
// launched), optimizer.step(), engine.after_optimizer_step() ("gather": ZeRO's
// all-gather of the updated parameter shards; a no-op under DDP),
// trainer.zero_grad().

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <malloc.h>  // mallinfo2

#include <accel/accel.hpp>
#include <accel/device/allocation_counter.hpp>
#include <accel/device/host_memory.hpp>
#include <accel/deferred_init/meta.hpp>
#include <accel/device/peak_memory.hpp>
#include <accel/estimate/shapes.hpp>
#include <accel/bench.hpp>

#include <time.h>

#include <algorithm>
#include <iterator>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_common.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// CPU time (ms) of the whole process (every thread: compute, Gloo's workers
// and its socket loop) or of the calling thread only.
double cpu_ms(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

std::string flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) return argv[i + 1];
  return fallback;
}

std::vector<std::int64_t> parse_widths(const std::string& s) {
  std::vector<std::int64_t> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');) out.push_back(std::stoll(part));
  return out;
}

struct Stats {
  double median, p90, max, mean;
};
Stats stats_of(std::vector<double> v) {
  if (v.empty()) return {0, 0, 0, 0};
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  return {v[v.size() / 2], v[std::min(v.size() - 1, v.size() * 9 / 10)], v.back(), sum / v.size()};
}

// Rank 0's lines from the facility's result: every rank's model state, the
// bytes per step against the formula, and the RESULT line.
void report(const accel::bench::CaseResult& r, const std::string& tag) {
  for (const auto& f : r.ranks)
    std::printf("[process %d] model state bytes: parameters %lld gradients %lld optimizer_state %lld total %lld; "
                "offloaded to host %lld\n",
                f.rank, static_cast<long long>(f.parameter_bytes), static_cast<long long>(f.gradient_bytes),
                static_cast<long long>(f.optimizer_state_bytes),
                static_cast<long long>(f.parameter_bytes + f.gradient_bytes + f.optimizer_state_bytes),
                static_cast<long long>(f.offloaded_bytes));
  std::printf("%s", accel::bench::format_table({r}).c_str());
  double mean_ms = 0;
  for (double t : r.step_ms) mean_ms += t / static_cast<double>(r.step_ms.size());
  const auto& rank0 = r.ranks.front();
  std::printf("RESULT tag=%s world=%d global_samples_per_s=%.1f steps_per_s=%.2f step_ms=%.2f param_bytes=%lld "
              "grad_bytes=%lld optim_bytes=%lld\n",
              tag.c_str(), r.world, static_cast<double>(r.samples_per_step) * 1e3 / mean_ms, 1e3 / mean_ms, mean_ms,
              static_cast<long long>(rank0.parameter_bytes), static_cast<long long>(rank0.gradient_bytes),
              static_cast<long long>(rank0.optimizer_state_bytes));
  if (!r.bucket_numels.empty()) {  // a sharded engine's buckets as it built them (bench/memory_peaks.sh reads them)
    std::string numels;
    for (auto n : r.bucket_numels) numels += (numels.empty() ? "" : ",") + std::to_string(n);
    std::printf("BUCKETS tag=%s numels=%s\n", tag.c_str(), numels.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

// The bucket, offload and unit settings: HybridShard's are those of its ZeRO<3>.
template <class Strategy>
auto& sharding_settings(Strategy& settings) {
  if constexpr (std::is_same_v<Strategy, accel::HybridShard>) return settings.zero;
  else return settings;
}

// --memory 1's counter, when installed (the phase split reads its peak per phase)
accel::device::HostAllocationCounter* memory_counter = nullptr;
std::int64_t whole_run_peak = 0;  // the counter's peak before each per-phase reset

template <class Strategy>
int run(int argc, char** argv, const std::string& strategy_name) {
  const int steps = std::stoi(flag(argc, argv, "steps", "60"));
  const int warmup = std::stoi(flag(argc, argv, "warmup", "10"));
  const std::int64_t batch = std::stoll(flag(argc, argv, "batch", "64"));
  const auto widths = parse_widths(flag(argc, argv, "widths", "512,1024,1024,1024,10"));
  const int phase_steps = std::stoi(flag(argc, argv, "phases", "20"));
  const int comm_probe = std::stoi(flag(argc, argv, "comm_probe", "0"));
  const std::string tag = flag(argc, argv, "tag", "accel_" + strategy_name);
  const std::string optimizer_name = flag(argc, argv, "optimizer", "sgd");
  const bool on_meta = flag(argc, argv, "build_on_meta", "0") == "1";
  if (optimizer_name != "sgd" && optimizer_name != "adam") {
    std::fprintf(stderr, "ddp_throughput: --optimizer must be sgd or adam, got '%s'\n", optimizer_name.c_str());
    return EXIT_FAILURE;
  }

  accel::TrainerOptions options;
  options.return_host_memory = flag(argc, argv, "return_host_memory", "0") == "1";
  options.cache_host_memory = flag(argc, argv, "cache_host_memory", "1") == "1";
  Strategy settings;
  auto& sharding = sharding_settings(settings);
  sharding.bucket_cap_mb = std::stod(flag(argc, argv, "bucket_cap_mb", std::to_string(sharding.bucket_cap_mb)));
  sharding.first_bucket_cap_mb =
      std::stod(flag(argc, argv, "first_bucket_cap_mb", std::to_string(sharding.first_bucket_cap_mb)));

  if constexpr (std::is_same_v<Strategy, accel::DDP>) {
    const std::string hook = flag(argc, argv, "comm_hook", "none");
    settings.comm_hook = hook == "fp16" ? accel::CommHook::fp16 : hook == "bf16" ? accel::CommHook::bf16 : accel::CommHook::none;
  }
  if constexpr (requires { sharding.cpu_offload; }) sharding.cpu_offload = flag(argc, argv, "cpu_offload", "0") == "1";
  if constexpr (std::is_same_v<decltype(sharding), accel::ZeRO<3>&>) {
    // One unit per large layer (each 1024x1024 Linear), as FSDP's size-based wrap would.
    sharding.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP;
    sharding.min_num_params = std::stoll(flag(argc, argv, "min_num_params", "500000"));
  }
  if constexpr (std::is_same_v<Strategy, accel::HybridShard>)
    settings.shard_group_size = std::stoi(flag(argc, argv, "shard_group_size", "0"));
  // Synthetic data, different on every rank (as a sharded loader would give).
  std::vector<bench::Batch> batches;
  auto make_optimizer = [&](std::vector<at::Tensor> parameters) -> std::unique_ptr<torch::optim::Optimizer> {
    if (optimizer_name == "adam")
      return std::make_unique<torch::optim::Adam>(parameters, torch::optim::AdamOptions(1e-3));
    return std::make_unique<torch::optim::SGD>(parameters, torch::optim::SGDOptions(0.01));
  };
  auto batch_of = [&](std::int64_t i, int rank) -> const bench::Batch& {
    if (batches.empty()) batches = bench::make_batches(8, batch, widths.front(), widths.back(), 1000 + rank);
    return batches[i % batches.size()];
  };

  // The timed steps, measured by the library's facility.
  accel::bench::Workload workload{
      .model = [&](accel::comm::Communicator&) {
        return on_meta ? accel::device::build_on_meta([&] { return bench::MLP(widths); }) : bench::MLP(widths);
      },
      .optimizer = make_optimizer,
      .batch = [&](std::int64_t i, int rank) {
        const auto& b = batch_of(i, rank);
        return accel::bench::Batch{b.data, b.target};
      },
      .loss = [](const at::Tensor& logits, const at::Tensor& target) { return at::cross_entropy_loss(logits, target); }};
  const auto result =
      accel::bench::compare(workload, {.warmup = warmup, .steps = steps, .rounds = 1, .print = false, .trainer = options}, settings).front();
  const char* rank_text = std::getenv("RANK");
  const bool main_process = rank_text == nullptr || std::string(rank_text) == "0";
  if (!result.ok) {
    if (main_process) std::fprintf(stderr, "ddp_throughput: %s\n", result.error.c_str());
    return EXIT_FAILURE;
  }
  if (main_process) report(result, tag);
  if (phase_steps <= 0 && comm_probe <= 0) return EXIT_SUCCESS;

  // The phase split and the communication probe, on a Trainer of their own.
  accel::Trainer<Strategy> trainer{settings, options};
  trainer.set_seed(0);
  bench::MLP model(widths);
  auto optimizer_owner = make_optimizer(model->parameters());
  torch::optim::Optimizer& optimizer = *optimizer_owner;
  trainer.prepare(model, optimizer);
  auto& engine = trainer.strategy_engine();

  // Bucket layout, as the engine built it.
  std::map<std::string, std::int64_t> numel_of;
  for (auto& item : model->named_parameters()) numel_of[item.key()] = item.value().numel();
  std::vector<std::int64_t> bucket_numel;
  std::ostringstream layout;
  for (std::size_t b = 0; b < engine.bucket_count(); ++b) {
    std::int64_t n = 0;
    for (auto& name : engine.bucket_parameters(b)) n += numel_of.at(name);
    bucket_numel.push_back(n);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%.2f", b ? " " : "", n * 4.0 / (1024.0 * 1024.0));
    layout << buf;
  }
  trainer.print("strategy", strategy_name, "optimizer", optimizer_name, "| model", model->parameters().size(),
                "tensors, buckets (MiB):", layout.str(), "| bucket_cap_mb",
                sharding.bucket_cap_mb, "first_bucket_cap_mb", sharding.first_bucket_cap_mb);

  std::vector<double> t_fwd, t_bwd, t_sync, t_opt, t_gather, t_zero, t_total;
  // --memory 1: the allocated peak within each phase (mark(k) closes phase k and opens the next)
  constexpr const char* kPhaseNames[] = {"forward", "backward", "sync_wait", "optimizer", "gather", "zero_grad"};
  std::int64_t phase_peak[std::size(kPhaseNames)] = {};
  auto mark = [&](int closing) {
    if (memory_counter == nullptr) return;
    const auto peak = memory_counter->peak_bytes();
    if (closing >= 0) phase_peak[closing] = std::max(phase_peak[closing], peak);
    whole_run_peak = std::max(whole_run_peak, peak);
    memory_counter->reset_peak();
  };
  auto run_step = [&](int i, bool record) {
    const auto& b = batch_of(i, trainer.process_index());
    mark(-1);
    const auto t0 = Clock::now();
    at::Tensor loss;
    {
      [[maybe_unused]] auto scope = trainer.autocast();
      loss = bench::loss_of(model, b);
    }
    mark(0);
    const auto t1 = Clock::now();
    engine.set_gradient_sync(true);  // trainer.backward(loss), its wait timed apart below
    engine.before_backward(loss);
    loss.backward();
    mark(1);
    const auto t2 = Clock::now();
    engine.synchronize_gradients();  // = the end of trainer.backward(loss)
    mark(2);
    const auto t3 = Clock::now();
    optimizer.step();  // = its second half (FP32: no unscale, no scheduler here) ...
    mark(3);
    const auto t4 = Clock::now();
    engine.after_optimizer_step();  // ... then ZeRO's all-gather of the updated shards (DDP: nothing)
    mark(4);
    const auto t4g = Clock::now();
    trainer.zero_grad();
    mark(5);
    const auto t5 = Clock::now();
    if (!record) return;
    auto d = [](auto a, auto c) { return std::chrono::duration<double, std::milli>(c - a).count(); };
    t_fwd.push_back(d(t0, t1));
    t_bwd.push_back(d(t1, t2));
    t_sync.push_back(d(t2, t3));
    t_opt.push_back(d(t3, t4));
    t_gather.push_back(d(t4, t4g));
    t_zero.push_back(d(t4g, t5));
    t_total.push_back(d(t0, t5));
  };

  for (int i = 0; i < warmup; ++i) run_step(i, false);
  trainer.wait_for_everyone();
  const double process_cpu0 = cpu_ms(CLOCK_PROCESS_CPUTIME_ID), thread_cpu0 = cpu_ms(CLOCK_THREAD_CPUTIME_ID);
  const auto start = Clock::now();
  for (int i = 0; i < phase_steps; ++i) run_step(i, true);
  const double mine = ms_since(start) / std::max(phase_steps, 1);
  const double process_cpu = (cpu_ms(CLOCK_PROCESS_CPUTIME_ID) - process_cpu0) / std::max(phase_steps, 1);
  const double main_cpu = (cpu_ms(CLOCK_THREAD_CPUTIME_ID) - thread_cpu0) / std::max(phase_steps, 1);
  trainer.wait_for_everyone();

  char line[4096];
  if (phase_steps > 0) {
    auto f = stats_of(t_fwd), bw = stats_of(t_bwd), sy = stats_of(t_sync), op = stats_of(t_opt),
         g = stats_of(t_gather), z = stats_of(t_zero), tt = stats_of(t_total);
    std::snprintf(line, sizeof line,
                  "[process %d] per-step ms (median/mean): forward %.1f/%.1f backward %.1f/%.1f "
                  "sync_wait %.1f/%.1f (p90 %.1f max %.1f) optimizer %.1f/%.1f gather %.1f/%.1f (p90 %.1f max %.1f) "
                  "zero_grad %.1f/%.1f total %.1f/%.1f\n",
                  trainer.process_index(), f.median, f.mean, bw.median, bw.mean, sy.median, sy.mean, sy.p90, sy.max,
                  op.median, op.mean, g.median, g.mean, g.p90, g.max, z.median, z.mean, tt.median, tt.mean);
    std::fputs(line, stdout);
    std::printf("[process %d] CPU ms per step: whole process %.1f, training thread %.1f, other threads (Gloo) %.1f; "
                "wall %.1f\n",
                trainer.process_index(), process_cpu, main_cpu, process_cpu - main_cpu, mine);
    if (memory_counter != nullptr) {
      std::printf("[process %d] allocated peak MiB per phase:", trainer.process_index());
      for (std::size_t k = 0; k < std::size(kPhaseNames); ++k) std::printf(" %s %.1f", kPhaseNames[k], phase_peak[k] / 1048576.0);
      std::printf("; between steps %.1f, of which idle step buffers %.1f\n", memory_counter->live_bytes() / 1048576.0,
                  trainer.idle_buffer_bytes() / 1048576.0);
    }
    std::fflush(stdout);
  }

  // Communication floor: the same bucket all-reduces (persistent buffers,
  // launched back to back as backward would), with no compute at all.
  if (comm_probe > 0 && trainer.num_processes() > 1) {
    auto& comm = trainer.communicator();
    std::vector<at::Tensor> flats;
    for (auto n : bucket_numel) flats.push_back(at::randn({n}));
    std::vector<double> round_ms, round_cpu_ms;
    std::vector<std::vector<double>> single_ms(flats.size());
    for (int k = 0; k < comm_probe + 2; ++k) {
      trainer.wait_for_everyone();
      const double c0 = cpu_ms(CLOCK_PROCESS_CPUTIME_ID);
      auto t = Clock::now();
      std::vector<accel::comm::Pending> work;
      for (auto& f : flats) work.push_back(comm.all_reduce_async(f, "probe"));
      for (auto& w : work) w.wait();
      if (k >= 2) round_ms.push_back(ms_since(t));
      if (k >= 2) round_cpu_ms.push_back(cpu_ms(CLOCK_PROCESS_CPUTIME_ID) - c0);
      for (std::size_t b = 0; b < flats.size(); ++b) {  // each bucket alone, synchronously
        trainer.wait_for_everyone();
        auto tb = Clock::now();
        comm.all_reduce(flats[b], "probe");
        if (k >= 2) single_ms[b].push_back(ms_since(tb));
      }
    }
    auto r = stats_of(round_ms), rc = stats_of(round_cpu_ms);
    std::ostringstream per_bucket;
    for (std::size_t b = 0; b < flats.size(); ++b) {
      auto s = stats_of(single_ms[b]);
      char buf[128];
      std::snprintf(buf, sizeof buf, " b%zu(%.2fMiB) %.1f/%.1f/%.1f", b, bucket_numel[b] * 4.0 / 1048576.0, s.median,
                    s.p90, s.max);
      per_bucket << buf;
    }
    std::snprintf(line, sizeof line,
                  "[process %d] comm probe, no compute, %d rounds: all buckets back to back ms median %.1f p90 %.1f "
                  "max %.1f mean %.1f (process CPU ms median %.1f mean %.1f) | each bucket alone median/p90/max:%s\n",
                  trainer.process_index(), comm_probe, r.median, r.p90, r.max, r.mean, rc.median, rc.mean,
                  per_bucket.str().c_str());
    std::fputs(line, stdout);
    std::fflush(stdout);
    trainer.wait_for_everyone();
  }
  return EXIT_SUCCESS;
}

int main(int argc, char** argv) {
  bench::one_thread();
  const std::string strategy = flag(argc, argv, "strategy", "ddp");
  std::optional<accel::device::HostAllocationCounter> counter;
  if (flag(argc, argv, "memory", "0") == "1") memory_counter = &counter.emplace();
  int status = EXIT_FAILURE;
  if (strategy == "ddp") status = run<accel::DDP>(argc, argv, strategy);
  else if (strategy == "zero1") status = run<accel::ZeRO<1>>(argc, argv, strategy);
  else if (strategy == "zero2") status = run<accel::ZeRO<2>>(argc, argv, strategy);
  else if (strategy == "zero3") status = run<accel::ZeRO<3>>(argc, argv, strategy);
  else if (strategy == "hybrid") status = run<accel::HybridShard>(argc, argv, strategy);
  else
    std::fprintf(stderr, "ddp_throughput: --strategy must be ddp, zero1, zero2, zero3 or hybrid, got '%s'\n",
                 strategy.c_str());
  if (counter) {
    const char* rank = std::getenv("RANK");
    const auto widths = parse_widths(flag(argc, argv, "widths", "512,1024,1024,1024,10"));
    const auto activations =
        accel::estimate::activation_bytes(accel::estimate::MlpShape{widths}, std::stoll(flag(argc, argv, "batch", "64")));
    accel::device::HostBlockCache::Stats cache;
    if (const auto* installed = accel::device::HostBlockCache::installed()) cache = installed->stats();
    // Where the resident set is at the end, beside the cache's blocks: what
    // glibc's malloc holds from the system (its heaps, which rarely shrink,
    // and its own mappings), for the allocations that never reach LibTorch's
    // allocator (Gloo's, the small ones under the cache's smallest block).
    long long malloc_system = -1;
#if defined(__GLIBC__)
    const struct mallinfo2 heap = mallinfo2();
    malloc_system = static_cast<long long>(heap.arena + heap.hblkhd);
#endif
    std::printf("MEMORY rank=%s allocated_peak_bytes=%lld resident_peak_bytes=%lld activation_bytes=%lld "
                "cache_most_in_use_bytes=%lld cache_mapped=%lld cache_unmapped=%lld cache_most_held_bytes=%lld "
                "malloc_system_bytes=%lld\n",
                rank ? rank : "0", static_cast<long long>(std::max(whole_run_peak, counter->peak_bytes())),
                static_cast<long long>(accel::device::peak_memory_bytes(at::Device(at::kCPU))),
                static_cast<long long>(activations), static_cast<long long>(cache.most_in_use),
                static_cast<long long>(cache.mapped), static_cast<long long>(cache.unmapped),
                static_cast<long long>(cache.most_held), malloc_system);
  }
  return status;
}
