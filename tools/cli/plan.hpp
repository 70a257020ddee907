#pragma once
// Turns layered settings into the concrete job this machine runs: how many
// local ranks, their global numbers, and the environment every rank gets.
// All consistency checks live here, so `accel config` refuses exactly what
// `accel launch` would refuse, and every message names the flag or file key.

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "accel/launch/variables.hpp"
#include "cli/settings.hpp"

namespace accel::cli {

inline constexpr int default_main_process_port = 29500;

struct JobPlan {
  int num_processes = 1;  ///< whole job
  int num_machines = 1;
  int machine_rank = 0;
  int local_processes = 1;  ///< on this machine
  int first_rank = 0;       ///< global rank of this machine's local rank 0
  std::string main_process_ip = "127.0.0.1";
  int main_process_port = default_main_process_port;
  bool port_given = false;  ///< false: the launcher may pick a free port on one machine
  std::string distributed_type = "NO";
  std::optional<int> omp_num_threads;  ///< unset: the ranks inherit the launcher's
  /// Variables every rank gets besides torchrun's per-rank ones.
  std::vector<std::pair<std::string, std::string>> job_env;
  std::optional<std::chrono::milliseconds> timeout;
  std::chrono::milliseconds monitor_interval{50};
  int max_restarts = 0;  ///< whole-job restarts after a rank fails (torchrun's --max_restarts)
  bool quiet = false;
};

namespace detail {

inline std::string env_text(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "true" : "false";
  return value.dump();
}

inline std::string upper(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return text;
}

/// Whether this machine has NVIDIA GPUs, without any GPU library: the driver
/// lists one folder per GPU.
inline bool has_nvidia_gpus() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/driver/nvidia/gpus", ec);
  return !ec && it != std::filesystem::directory_iterator();
}

// fsdp_config key -> variable: the key in capitals, but for the renamed ones.
inline std::string fsdp_variable(const std::string& key) {
  for (const auto& [from, to] : accel::launch::variables::fsdp_renamed)
    if (key == from) return std::string(to);
  return upper(key);
}

// Accelerate's variables for the nested sections (launch.py's prepare_*_env).
inline void add_section_env(const LaunchSettings& s, const std::string& distributed_type,
                            std::vector<std::pair<std::string, std::string>>& env) {
  bool deepspeed = distributed_type == "DEEPSPEED";
  for (const auto& [key, value] : s.deepspeed_config)
    if (key != "gradient_accumulation_steps") deepspeed = true;
  if (deepspeed) {
    env.emplace_back("ACCELERATE_USE_DEEPSPEED", "true");
    static const std::array<std::pair<const char*, const char*>, 7> names = {{
        {"zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE"},
        {"offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"},
        {"offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"},
        {"gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING"},
        {"zero3_init_flag", "ACCELERATE_DEEPSPEED_ZERO3_INIT"},
        {"zero3_save_16bit_model", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"},
        {"deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE"},
    }};
    for (const auto& [key, name] : names)
      if (auto it = s.deepspeed_config.find(key); it != s.deepspeed_config.end())
        env.emplace_back(name, env_text(it->second));
  }
  if (distributed_type == "FSDP" || !s.fsdp_config.empty()) {
    env.emplace_back(accel::launch::variables::use_fsdp, "true");
    for (const auto& [key, value] : s.fsdp_config)  // fsdp_sharding_strategy -> FSDP_SHARDING_STRATEGY
      env.emplace_back(fsdp_variable(key), env_text(value));
  }
  if (distributed_type == "MEGATRON_LM" || !s.megatron_lm_config.empty()) {
    env.emplace_back("ACCELERATE_USE_MEGATRON_LM", "true");
    for (const auto& [key, value] : s.megatron_lm_config) env.emplace_back(upper(key), env_text(value));
  }
  if (!s.parallelism_config.empty()) {
    env.emplace_back("ACCELERATE_USE_PARALLELISM_CONFIG", "true");
    for (const auto& [key, value] : s.parallelism_config) env.emplace_back(upper(key), env_text(value));
  }
}

}  // namespace detail

/// The distributed_type `accel config` records when none was given, the way
/// `accelerate config default` chooses it: NO for one process, else
/// MULTI_GPU when this machine has GPUs and --cpu was not given, else MULTI_CPU.
inline std::string default_distributed_type(const LaunchSettings& s) {
  if (s.distributed_type) return *s.distributed_type;
  if (s.num_processes.value_or(1) <= 1 && s.num_machines.value_or(1) <= 1) return "NO";
  if (!s.use_cpu.value_or(false) && detail::has_nvidia_gpus()) return "MULTI_GPU";
  return "MULTI_CPU";
}

/// Checks the settings and works out this machine's share of the job.
inline JobPlan resolve_plan(const LaunchSettings& s) {
  JobPlan plan;
  auto num = [&](const char* key, int value) { return s.describe(key, std::to_string(value)); };
  auto at_least = [&](const char* key, int value, int min) {
    if (value < min) throw UsageError(num(key, value) + " must be at least " + std::to_string(min));
  };
  plan.num_processes = s.num_processes.value_or(1);
  plan.num_machines = s.num_machines.value_or(1);
  plan.machine_rank = s.machine_rank.value_or(0);
  at_least("num_processes", plan.num_processes, 1);
  at_least("num_machines", plan.num_machines, 1);
  at_least("machine_rank", plan.machine_rank, 0);
  if (plan.machine_rank >= plan.num_machines)
    throw UsageError(num("machine_rank", plan.machine_rank) + " must be below " +
                     num("num_machines", plan.num_machines) + " (machine ranks count from 0)");
  if (plan.num_processes % plan.num_machines != 0)
    throw UsageError(num("num_processes", plan.num_processes) + " is not divisible by " +
                     num("num_machines", plan.num_machines) +
                     " (num_processes is the total over all machines, as in Accelerate)");
  plan.local_processes = plan.num_processes / plan.num_machines;
  plan.first_rank = plan.machine_rank * plan.local_processes;

  plan.main_process_ip = s.main_process_ip.value_or("127.0.0.1");
  if (plan.main_process_ip.empty()) throw UsageError(s.describe("main_process_ip", "''") + " is empty");
  plan.port_given = s.main_process_port.has_value();
  plan.main_process_port = s.main_process_port.value_or(default_main_process_port);
  if (plan.main_process_port < 1 || plan.main_process_port > 65535)
    throw UsageError(num("main_process_port", plan.main_process_port) + " is not a TCP port (1-65535)");

  const std::string compute = s.compute_environment.value_or("LOCAL_MACHINE");
  if (compute != "LOCAL_MACHINE")
    throw UsageError(s.describe("compute_environment", compute) + " is not supported; accel launches on " +
                     "the local machine (LOCAL_MACHINE) only");
  plan.distributed_type = s.distributed_type.value_or(plan.num_processes > 1 ? "MULTI_CPU" : "NO");
  static const std::array<const char*, 12> known_types = {"NO",       "MULTI_CPU", "MULTI_GPU", "MULTI_XPU",
                                                          "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU",
                                                          "DEEPSPEED", "FSDP",      "MEGATRON_LM", "XLA"};
  if (std::find(known_types.begin(), known_types.end(), plan.distributed_type) == known_types.end())
    throw UsageError(s.describe("distributed_type", plan.distributed_type) +
                     " is not one of Accelerate's distributed types (NO, MULTI_CPU, MULTI_GPU, DEEPSPEED, FSDP, ...)");

  // Exported only when asked for: the program's compiled precision wins over a default (as in Accelerate).
  if (s.mixed_precision) {
    const std::string& precision = *s.mixed_precision;
    if (precision != "no" && precision != "fp16" && precision != "bf16")
      throw UsageError(s.describe("mixed_precision", precision) + " must be one of no, fp16, bf16" +
                       (precision == "fp8" ? " (accel has no fp8)" : ""));
    plan.job_env.emplace_back(accel::launch::variables::mixed_precision, precision);
    auto origin = s.origin.find("mixed_precision");
    plan.job_env.emplace_back(accel::launch::variables::mixed_precision_origin,
                              origin == s.origin.end() ? std::string("--mixed_precision") : origin->second);
  }

  if (s.gradient_accumulation_steps) {
    at_least("gradient_accumulation_steps", *s.gradient_accumulation_steps, 1);
    plan.job_env.emplace_back(accel::launch::variables::gradient_accumulation_steps,
                              std::to_string(*s.gradient_accumulation_steps));
  }
  if (s.use_cpu.value_or(false)) plan.job_env.emplace_back(accel::launch::variables::use_cpu, "true");
  if (s.debug.value_or(false)) plan.job_env.emplace_back(accel::launch::variables::debug_mode, "true");
  if (s.enable_cpu_affinity.value_or(false)) plan.job_env.emplace_back(accel::launch::variables::cpu_affinity, "1");
  if (s.gpu_ids && *s.gpu_ids != "all" && !s.gpu_ids->empty())
    plan.job_env.emplace_back("CUDA_VISIBLE_DEVICES", *s.gpu_ids);
  detail::add_section_env(s, plan.distributed_type, plan.job_env);

  if (s.num_cpu_threads_per_process) {
    at_least("num_cpu_threads_per_process", *s.num_cpu_threads_per_process, 1);
    plan.omp_num_threads = *s.num_cpu_threads_per_process;
  } else if (plan.local_processes > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    plan.omp_num_threads = 1;  // torchrun's default: N ranks must not each take every core
  }

  auto seconds = [&](const char* key, double value) {
    if (!(value > 0)) {
      std::ostringstream text;
      text << value;
      throw UsageError(s.describe(key, text.str()) + " must be more than 0 seconds");
    }
    return std::chrono::milliseconds(std::max<long long>(1, static_cast<long long>(value * 1000.0 + 0.5)));
  };
  if (s.monitor_interval) plan.monitor_interval = seconds("monitor_interval", *s.monitor_interval);
  if (s.timeout) plan.timeout = seconds("timeout", *s.timeout);
  if (s.max_restarts) {
    if (*s.max_restarts < 0) throw UsageError(s.describe("max_restarts", std::to_string(*s.max_restarts)) +
                                              " must be 0 or more");
    plan.max_restarts = *s.max_restarts;
  }
  plan.quiet = s.quiet;
  return plan;
}

}  // namespace accel::cli
