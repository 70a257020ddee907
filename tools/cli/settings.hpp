#pragma once
// What `accel launch` and `accel config` are told, before defaults are
// applied: every field is optional so that a config file and the command line
// can be layered (the command line wins, as in Accelerate) and so that
// `accel config` writes only what it was given plus documented defaults.
// Field names are Accelerate's config keys and flag names, unchanged.

#include <map>
#include <optional>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace accel::cli {

/// A mistake in what the user typed or wrote in a config file; `accel` prints
/// it on one line after "accel <command>: " and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One nested section of an Accelerate config (fsdp_config, ...): key -> value.
using Section = std::map<std::string, nlohmann::json>;

struct LaunchSettings {
  // Top-level keys of Accelerate's config file (and the flags of the same name).
  std::optional<std::string> compute_environment;
  std::optional<std::string> distributed_type;
  std::optional<std::string> mixed_precision;
  std::optional<bool> use_cpu;
  std::optional<bool> debug;
  std::optional<int> num_processes;  ///< total over all machines, as in Accelerate
  std::optional<int> num_machines;
  std::optional<int> machine_rank;
  std::optional<std::string> main_process_ip;
  std::optional<int> main_process_port;
  std::optional<std::string> rdzv_backend;
  std::optional<bool> same_network;
  std::optional<std::string> gpu_ids;
  std::optional<bool> enable_cpu_affinity;
  /// Accelerate nests it in deepspeed_config; accel also takes it at top level.
  std::optional<int> gradient_accumulation_steps;

  // Nested sections, forwarded to the ranks as environment variables.
  Section deepspeed_config;
  Section fsdp_config;
  Section megatron_lm_config;
  Section parallelism_config;

  // Launch-only flags: not config keys in Accelerate, so never written to a file.
  std::optional<int> num_cpu_threads_per_process;
  std::optional<double> monitor_interval;  ///< seconds
  std::optional<int> max_restarts;
  std::optional<double> timeout;           ///< seconds
  bool quiet = false;

  /// Where each value came from: the flag ("--num_processes") or the file
  /// ("config file /path"), so that a later consistency error points at it.
  std::map<std::string, std::string> origin;

  /// "--num_processes 3", or "num_processes 3 (config file F)", or
  /// "--num_processes 1 (default)" for a value nobody gave.
  std::string describe(const std::string& key, const std::string& value) const {
    auto it = origin.find(key);
    if (it == origin.end()) return "--" + key + " " + value + " (default)";
    if (it->second.starts_with("--")) return it->second + " " + value;
    return key + " " + value + " (" + it->second + ")";
  }

  /// Layers `over` on top of this: every value `over` has replaces ours.
  void override_with(const LaunchSettings& over) {
    auto take = [](auto& mine, const auto& theirs) {
      if (theirs) mine = theirs;
    };
    take(compute_environment, over.compute_environment);
    take(distributed_type, over.distributed_type);
    take(mixed_precision, over.mixed_precision);
    take(use_cpu, over.use_cpu);
    take(debug, over.debug);
    take(num_processes, over.num_processes);
    take(num_machines, over.num_machines);
    take(machine_rank, over.machine_rank);
    take(main_process_ip, over.main_process_ip);
    take(main_process_port, over.main_process_port);
    take(rdzv_backend, over.rdzv_backend);
    take(same_network, over.same_network);
    take(gpu_ids, over.gpu_ids);
    take(enable_cpu_affinity, over.enable_cpu_affinity);
    take(gradient_accumulation_steps, over.gradient_accumulation_steps);
    take(num_cpu_threads_per_process, over.num_cpu_threads_per_process);
    take(monitor_interval, over.monitor_interval);
    take(max_restarts, over.max_restarts);
    take(timeout, over.timeout);
    quiet = quiet || over.quiet;
    for (auto [mine, theirs] : {std::pair{&deepspeed_config, &over.deepspeed_config},
                                std::pair{&fsdp_config, &over.fsdp_config},
                                std::pair{&megatron_lm_config, &over.megatron_lm_config},
                                std::pair{&parallelism_config, &over.parallelism_config}})
      for (const auto& [key, value] : *theirs) (*mine)[key] = value;
    for (const auto& [key, value] : over.origin) origin[key] = value;
  }
};

}  // namespace accel::cli
