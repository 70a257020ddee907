#pragma once
// Accelerate's `accelerator.profile(ProfileKwargs(schedule_option=...))`:
// LibTorch's profiler over a schedule of training steps, one Chrome trace
// per rank and active window, which Perfetto (ui.perfetto.dev) and
// chrome://tracing open. Besides LibTorch's operators, the trace holds
// accel's own ranges: each collective as it is issued ("accel::all_reduce
// ...") and each wait for one ("accel::wait ...", the DDP/ZeRO bucket waits
// among them), named by what they were for.
//
//   accel::profiling::Profiler profiler(trainer, {.wait = 1, .warmup = 1, .active = 2, .repeat = 1,
//                                                 .output_trace_dir = "profiles"});
//   for (auto batch : loader) { trainer.step(...); profiler.step(); }
//
// The schedule is torch.profiler.schedule's: each cycle skips `wait` steps,
// runs the profiler for `warmup` steps and throws that away (the first
// steps under a profiler are slower), then records `active` steps and
// writes them to output_trace_dir/trace_rank<r>_cycle<k>.json; `repeat`
// cycles (0: until the profiler goes out of scope).
//
// It uses the profiler every LibTorch build has (the legacy one,
// torch/csrc/autograd/profiler_legacy.h), so it works on Debian's 1.13
// without Kineto; CUDA kernels are not in its traces (use Nsight Systems
// there), the CPU side of every operator and accel range is.

#include <torch/csrc/autograd/profiler_legacy.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace accel::profiling {

/// Accelerate's ProfileKwargs schedule_option, and where the traces go.
struct ProfileKwargs {
  int wait = 0;
  int warmup = 0;
  int active = 1;
  int repeat = 0;  ///< cycles; 0: until the profiler ends
  std::filesystem::path output_trace_dir = "profiles";
};

/// One trace as the profiler wrote it, rewritten in the JSON Object Format
/// of the Trace Event Format: process id = rank, named "rank r", so the
/// ranks' files line up side by side in Perfetto.
inline nlohmann::json chrome_trace(const std::string& raw, int rank) {
  nlohmann::json events = nlohmann::json::parse(raw);
  if (!events.is_array()) throw std::runtime_error("accel: the profiler's trace is not a JSON array");
  nlohmann::json out = nlohmann::json::array();
  out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (auto& event : events) {
    event["pid"] = rank;
    if (event.contains("tid") && !event["tid"].is_number()) event["tid"] = std::hash<std::string>{}(event["tid"].dump()) % 100000;
    out.push_back(std::move(event));
  }
  return {{"traceEvents", out}, {"displayTimeUnit", "ms"}};
}

class Profiler {
 public:
  Profiler(int rank, ProfileKwargs kwargs) : rank_(rank), kwargs_(std::move(kwargs)) {
    if (kwargs_.wait < 0 || kwargs_.warmup < 0 || kwargs_.active < 1 || kwargs_.repeat < 0)
      throw std::invalid_argument("accel: ProfileKwargs needs wait, warmup, repeat >= 0 and active >= 1");
    std::filesystem::create_directories(kwargs_.output_trace_dir);
    start_if_profiled(0);
  }
  /// A Trainer (anything with process_index()): one trace per rank.
  template <class Trainer>
    requires requires(const Trainer& t) { t.process_index(); }
  Profiler(const Trainer& trainer, ProfileKwargs kwargs) : Profiler(trainer.process_index(), std::move(kwargs)) {}

  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;
  /// Ends the window in progress; an active one is written, as torch.profiler does on exit.
  ~Profiler() {
    try {
      stop();
    } catch (...) {  // a destructor must not throw: the trace is lost, training is not
    }
  }

  /// One training step done: moves along the schedule.
  void step() {
    const Phase now = phase_of(step_), next = phase_of(step_ + 1);
    if (recording_ && (next != now || last_of_cycle(step_))) stop();
    ++step_;
    start_if_profiled(step_);
  }

  /// The traces written so far.
  const std::vector<std::filesystem::path>& traces() const { return traces_; }

 private:
  enum class Phase { idle, warmup, active };  // idle too once `repeat` cycles are done

  int cycle_length() const { return kwargs_.wait + kwargs_.warmup + kwargs_.active; }
  bool last_of_cycle(int step) const { return step % cycle_length() == cycle_length() - 1; }
  Phase phase_of(int step) const {
    const int within = step % cycle_length();
    if (kwargs_.repeat > 0 && step / cycle_length() >= kwargs_.repeat) return Phase::idle;
    if (within < kwargs_.wait) return Phase::idle;
    if (within < kwargs_.wait + kwargs_.warmup) return Phase::warmup;
    return Phase::active;
  }

  void start_if_profiled(int step) {
    const Phase phase = phase_of(step);
    if (recording_ || (phase != Phase::warmup && phase != Phase::active)) return;
    phase_ = phase;
    buffer_ = std::make_unique<std::ostringstream>();
    recording_ = std::make_unique<torch::autograd::profiler::RecordProfile>(*buffer_);
  }

  // Ends the recording; an active window's events go to its trace file (through a rename).
  void stop() {
    if (!recording_) return;
    recording_.reset();  // RecordProfile writes its events as it ends
    if (phase_ == Phase::active) {
      const auto path = kwargs_.output_trace_dir / ("trace_rank" + std::to_string(rank_) + "_cycle" +
                                                    std::to_string(step_ / cycle_length()) + ".json");
      const auto tmp = std::filesystem::path(path.string() + ".tmp");
      {
        std::ofstream out(tmp);
        out << chrome_trace(buffer_->str(), rank_).dump();
        if (!out) throw std::runtime_error("accel: cannot write the trace " + tmp.string());
      }
      std::filesystem::rename(tmp, path);
      traces_.push_back(path);
    }
    buffer_.reset();
  }

  int rank_;
  ProfileKwargs kwargs_;
  int step_ = 0;
  Phase phase_ = Phase::idle;
  std::unique_ptr<std::ostringstream> buffer_;
  std::unique_ptr<torch::autograd::profiler::RecordProfile> recording_;
  std::vector<std::filesystem::path> traces_;
};

}  // namespace accel::profiling
