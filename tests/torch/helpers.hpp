#pragma once
// Shared by the LibTorch tests: tiny models, deterministic data, comparisons,
// bounded spawns and the files that failure tests report through.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <accel/accel.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace accel::testing {

/// A small MLP, identical for the same seed on every rank.
inline torch::nn::Sequential tiny_mlp(std::uint64_t seed, std::int64_t in = 8, std::int64_t hidden = 16,
                                      std::int64_t out = 4, int hidden_layers = 2) {
  at::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(in, hidden), torch::nn::Tanh());
  for (int i = 1; i < hidden_layers; ++i) {
    net->push_back(torch::nn::Linear(hidden, hidden));
    net->push_back(torch::nn::Tanh());
  }
  net->push_back(torch::nn::Linear(hidden, out));
  return net;
}

/// The data-parallel strategies an equivalence test runs through, each on the
/// ranks it needs: `check(strategy, world)` for DDP, ZeRO-1/2/3, HybridShard
/// 2x2 and ZeRO-2/3 with cpu_offload.
template <class Check>
void each_data_parallel_strategy(Check&& check) {
  check(accel::DDP{}, 2);
  check(accel::ZeRO<1>{}, 2);
  check(accel::ZeRO<2>{}, 2);
  check(accel::ZeRO<3>{}, 2);
  check(accel::HybridShard{.shard_group_size = 2}, 4);
  check(accel::ZeRO<2>{.cpu_offload = true}, 2);
  check(accel::ZeRO<3>{.cpu_offload = true}, 2);
}

/// Full Linear layers of the given (in, out) shapes, seeded alike on every
/// rank: what tensor-parallel layers are sliced from, and their reference.
inline std::vector<torch::nn::Linear> full_layers(const std::vector<std::pair<int, int>>& shapes) {
  at::manual_seed(0);
  std::vector<torch::nn::Linear> layers;
  for (auto [in, out] : shapes) layers.emplace_back(in, out);
  return layers;
}

/// A measured error, as "1.2e-07".
inline std::string sci(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1e", v);
  return text;
}

struct GlobalBatch {
  at::Tensor x, y;
};

/// The global batch of step `step`: the same on every rank.
inline GlobalBatch global_batch(std::int64_t step, std::int64_t size, std::int64_t in = 8, std::int64_t classes = 4) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randn({size, in}, gen), at::randint(classes, {size}, gen, at::TensorOptions().dtype(at::kLong))};
}

inline at::Tensor loss_of(torch::nn::Sequential& net, const at::Tensor& x, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(net->forward(x), y);
}

/// Largest absolute difference between two models' parameters.
inline double max_param_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  if (pa.size() != pb.size()) throw std::runtime_error("models differ in parameter count");
  double worst = 0;
  for (std::size_t i = 0; i < pa.size(); ++i)
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>());
  return worst;
}

/// Sets environment variables for a scope and puts back what was there
/// before, also when a REQUIRE or an exception leaves the scope early.
class ScopedEnv {
 public:
  ScopedEnv() = default;
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else ::unsetenv(it->first.c_str());
    }
  }
  void set(const std::string& name, const std::string& value) {
    remember(name);
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  void unset(const std::string& name) {
    remember(name);
    ::unsetenv(name.c_str());
  }

 private:
  void remember(const std::string& name) {
    if (std::none_of(saved_.begin(), saved_.end(), [&](const auto& s) { return s.first == name; })) {
      const char* before = std::getenv(name.c_str());
      saved_.emplace_back(name, before ? std::optional<std::string>(before) : std::nullopt);
    }
  }

  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

/// Removes the given paths when the scope ends, however it ends.
class RemoveOnExit {
 public:
  RemoveOnExit(std::initializer_list<std::filesystem::path> paths) : paths_(paths) {}
  RemoveOnExit(const RemoveOnExit&) = delete;
  RemoveOnExit& operator=(const RemoveOnExit&) = delete;
  ~RemoveOnExit() {
    std::error_code ignored;
    for (const auto& p : paths_) std::filesystem::remove_all(p, ignored);
  }

 private:
  std::vector<std::filesystem::path> paths_;
};

/// Throws (failing the rank, hence the spawn) when `ok` is false.
inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

/// Spawn options with a timeout: a rank that hangs fails the test instead of stalling it.
inline accel::SpawnOptions bounded(std::chrono::seconds timeout = std::chrono::seconds(90)) {
  accel::SpawnOptions options;
  options.timeout = timeout;
  return options;
}

/// A path in /tmp unique to this test process, for results the ranks write.
/// The Python whose torch matches the LibTorch under test (and, for a PyPI
/// torch, holds accelerate): tests/meson.build sets ACCEL_TEST_PYTHON.
inline std::string test_python() {
  const char* python = std::getenv("ACCEL_TEST_PYTHON");
  return python != nullptr && *python != 0 ? python : "/usr/bin/python3";
}

/// For the tests against Python packages: exits the test binary with meson's
/// SKIP (77), saying why, where test_python() cannot import `module`.
inline void require_python_module(const std::string& module) {
  const std::string probe = test_python() + " -c 'import " + module + "' 2>/dev/null";
  if (std::system(probe.c_str()) != 0) {
    std::printf("SKIP: %s has no %s (bash tools/run.sh test with ACCEL_TORCH=pypi installs it)\n",
                test_python().c_str(), module.c_str());
    std::exit(77);
  }
}
inline void require_accelerate() { require_python_module("accelerate"); }

/// What `command` prints on its standard output; throws if it exits non-zero.
inline std::string output_of(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run " + command);
  std::string text;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) text += buffer;
  if (::pclose(pipe) != 0) throw std::runtime_error(command + " failed");
  return text;
}

#ifdef ACCEL_SOURCE_ROOT  // test_torch's; the CUDA test binary has no use for the parity script
/// What `bench/accelerate_parity.py ARGS` prints (it must exit 0).
inline std::string run_accelerate_parity(const std::string& args) {
  return output_of(test_python() + " " ACCEL_SOURCE_ROOT "/bench/accelerate_parity.py " + args + " 2>/dev/null");
}
#endif

inline std::string temp_path(const std::string& name) {
  return "/tmp/accel_test_" + std::to_string(::getpid()) + "_" + name;
}

/// temp_path(name) as a directory, emptied: nothing of an earlier run left.
inline std::filesystem::path fresh_dir(const std::string& name) {
  std::filesystem::path dir = temp_path(name);
  std::filesystem::remove_all(dir);
  return dir;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

/// The file's text ("" when there is none), and the file removed.
inline std::string take_file(const std::string& path) {
  std::string text = read_file(path);
  ::unlink(path.c_str());
  return text;
}

/// Runs `collective()` and writes to `result` how it ended: "no error", or
/// "seconds=S WHAT" when it threw CollectiveError after S seconds. The
/// failure tests read it back with take_file and failure_seconds.
template <class Collective>
void report_collective_failure(const std::string& result, Collective&& collective) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    collective();
    std::ofstream(result) << "no error";
  } catch (const accel::comm::CollectiveError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::ofstream(result) << "seconds=" << s << " " << e.what();
  }
}

/// For the tests of a rank that never joins: runs `fn(rank, result)` on 2
/// ranks within 60 s, the survivor left to fail by itself, and returns (and
/// removes) what was written to `result`, a fresh temp_path(name).
template <class Fn>
std::string spawn_two_and_read_report(const std::string& name, Fn&& fn) {
  const std::string result = temp_path(name);
  auto options = bounded(std::chrono::seconds(60));
  options.stop_on_failure = false;
  accel::spawn(2, [&](int rank) { fn(rank, result); }, options);
  return take_file(result);
}

/// Whether `text` (from report_collective_failure) reports a failure.
inline bool reports_failure(const std::string& text) { return text.rfind("seconds=", 0) == 0; }

/// The seconds a reported failure took; call after reports_failure(text).
inline double failure_seconds(const std::string& text) { return std::stod(text.substr(8)); }

}  // namespace accel::testing
