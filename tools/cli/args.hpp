#pragma once
// The flags of `accel launch` / `accel config`, in one table that both the
// parser and --help read, so the usage text cannot drift from what is parsed.
// Names are Accelerate's (`--num_processes`, ...); both `--flag value` and
// `--flag=value` work, and everything after the program belongs to it.

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "accel/core/policies.hpp"
#include "cli/settings.hpp"

namespace accel::cli {

enum class FlagScope {
  config_key,   ///< an Accelerate config key: `accel config` writes it
  launch_only,  ///< only meaningful while launching
  general,      ///< --config_file, --quiet, --help
};

struct FlagSpec {
  std::string_view name;        ///< "--num_processes"
  std::string_view short_name;  ///< "-q" or empty
  std::string_view metavar;     ///< empty for a switch (takes no value)
  std::string_view group;       ///< heading in --help
  FlagScope scope;
  std::string_view help;
  /// Stores the value (already known to be present) into the settings; throws
  /// UsageError naming the flag when it does not parse.
  std::function<void(LaunchSettings&, const std::string& flag, const std::string& value)> apply;

  bool is_switch() const { return metavar.empty(); }
};

namespace detail {

inline int parse_int_flag(const std::string& flag, const std::string& text) {
  int value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc{} || ptr != end)
    throw UsageError(flag + " expects an integer, got '" + text + "'");
  return value;
}

inline double parse_seconds_flag(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value))
    throw UsageError(flag + " expects a number of seconds, got '" + text + "'");
  return value;
}

// Setters for the table: each records the flag as the value's origin.
template <class Field>
auto int_setter(Field field, std::string key) {
  return [field, key](LaunchSettings& s, const std::string& flag, const std::string& value) {
    s.*field = parse_int_flag(flag, value);
    s.origin[key] = flag;
  };
}
template <class Field>
auto seconds_setter(Field field, std::string key) {
  return [field, key](LaunchSettings& s, const std::string& flag, const std::string& value) {
    s.*field = parse_seconds_flag(flag, value);
    s.origin[key] = flag;
  };
}
template <class Field>
auto string_setter(Field field, std::string key) {
  return [field, key](LaunchSettings& s, const std::string& flag, const std::string& value) {
    s.*field = value;
    s.origin[key] = flag;
  };
}
template <class Field>
auto switch_setter(Field field, std::string key) {
  return [field, key](LaunchSettings& s, const std::string& flag, const std::string&) {
    s.*field = true;
    s.origin[key] = flag;
  };
}

// Accelerate's --fsdp_* flags: each sets the key of the same name in
// fsdp_config (forwarded to the ranks as FSDP_* variables), checked against
// the values Accelerate accepts.
inline auto fsdp_setter(std::string key, std::vector<std::string> choices) {
  return [key, choices](LaunchSettings& s, const std::string& flag, const std::string& value) {
    if (!choices.empty() && std::find(choices.begin(), choices.end(), value) == choices.end()) {
      std::string allowed;
      for (const auto& c : choices) allowed += (allowed.empty() ? "" : ", ") + c;
      throw UsageError(flag + " must be one of " + allowed + ", got '" + value + "'");
    }
    if (value == "true" || value == "false") s.fsdp_config[key] = value == "true";
    else if (key == "fsdp_min_num_params" || key == "fsdp_version") s.fsdp_config[key] = parse_int_flag(flag, value);
    else s.fsdp_config[key] = value;
    s.origin["fsdp_config." + key] = flag;
  };
}

}  // namespace detail

/// Every flag accel knows. `--config_file` and `--help` are handled by the
/// parser itself; their entries exist for --help.
inline const std::vector<FlagSpec>& flag_table() {
  using S = LaunchSettings;
  using namespace detail;
  static const std::vector<FlagSpec> table = {
      {"--cpu", "", "", "Hardware", FlagScope::config_key,
       "run on CPU only (config key use_cpu; sets ACCELERATE_USE_CPU=true)", switch_setter(&S::use_cpu, "use_cpu")},
      {"--multi_gpu", "", "", "Hardware", FlagScope::config_key, "distributed_type MULTI_GPU",
       [](S& s, const std::string& flag, const std::string&) {
         s.distributed_type = "MULTI_GPU";
         s.origin["distributed_type"] = flag;
       }},
      {"--mixed_precision", "", "{no,fp16,bf16}", "Resources", FlagScope::config_key,
       "ACCELERATE_MIXED_PRECISION for every rank (default no)", string_setter(&S::mixed_precision, "mixed_precision")},
      {"--num_processes", "", "N", "Resources", FlagScope::config_key,
       "processes in the whole job, over all machines (default 1)", int_setter(&S::num_processes, "num_processes")},
      {"--num_machines", "", "N", "Resources", FlagScope::config_key, "machines in the job (default 1)",
       int_setter(&S::num_machines, "num_machines")},
      {"--num_cpu_threads_per_process", "", "N", "Resources", FlagScope::launch_only,
       "OMP_NUM_THREADS for every rank (default: 1 when a machine runs more than one process and "
       "OMP_NUM_THREADS is not already set, as torchrun does)",
       int_setter(&S::num_cpu_threads_per_process, "num_cpu_threads_per_process")},
      {"--enable_cpu_affinity", "", "", "Resources", FlagScope::config_key, "sets ACCELERATE_CPU_AFFINITY=1",
       switch_setter(&S::enable_cpu_affinity, "enable_cpu_affinity")},
      {"--gradient_accumulation_steps", "", "N", "Resources", FlagScope::config_key,
       "ACCELERATE_GRADIENT_ACCUMULATION_STEPS for every rank",
       int_setter(&S::gradient_accumulation_steps, "gradient_accumulation_steps")},
      {"--gpu_ids", "", "LIST", "Distributed", FlagScope::config_key,
       "GPUs to use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES; default all)", string_setter(&S::gpu_ids, "gpu_ids")},
      {"--same_network", "", "", "Distributed", FlagScope::config_key,
       "all machines share a network (accepted for Accelerate compatibility)",
       switch_setter(&S::same_network, "same_network")},
      {"--machine_rank", "", "N", "Distributed", FlagScope::config_key, "this machine's index, 0-based (default 0)",
       int_setter(&S::machine_rank, "machine_rank")},
      {"--main_process_ip", "", "ADDR", "Distributed", FlagScope::config_key,
       "address of machine 0, MASTER_ADDR (default 127.0.0.1)", string_setter(&S::main_process_ip, "main_process_ip")},
      {"--main_process_port", "", "PORT", "Distributed", FlagScope::config_key,
       "port on machine 0, MASTER_PORT (default 29500; on one machine a free port if 29500 is taken "
       "and no port was given)",
       int_setter(&S::main_process_port, "main_process_port")},
      {"--rdzv_backend", "", "NAME", "Distributed", FlagScope::config_key,
       "rendezvous backend; accel's is static (default static)", string_setter(&S::rdzv_backend, "rdzv_backend")},
      {"--monitor_interval", "", "SECONDS", "Distributed", FlagScope::launch_only,
       "time between liveness checks of the ranks (default 0.05)",
       seconds_setter(&S::monitor_interval, "monitor_interval")},
      {"--max_restarts", "", "N", "Distributed", FlagScope::launch_only,
       "when a rank fails, stop every rank and start the job again, up to N times, as torchrun does "
       "(default 0); the program resumes from its newest checkpoint (Trainer::load_latest_state)",
       int_setter(&S::max_restarts, "max_restarts")},
      {"--timeout", "", "SECONDS", "Distributed", FlagScope::launch_only,
       "kill the whole job and fail after this long (default: no limit)", seconds_setter(&S::timeout, "timeout")},
      {"--use_fsdp", "", "", "FSDP", FlagScope::config_key, "distributed_type FSDP (sets ACCELERATE_USE_FSDP=true)",
       [](S& s, const std::string& flag, const std::string&) {
         s.distributed_type = "FSDP";
         s.origin["distributed_type"] = flag;
       }},
      {"--fsdp_version", "", "{1,2}", "FSDP", FlagScope::config_key,
       "1 (default): the strategy is named by --fsdp_sharding_strategy; 2 (FSDP2): by "
       "--fsdp_reshard_after_forward, and --fsdp_sharding_strategy is ignored, as Accelerate does",
       fsdp_setter("fsdp_version", {"1", "2"})},
      {"--fsdp_sharding_strategy", "", "NAME", "FSDP", FlagScope::config_key,
       "FSDP1: FULL_SHARD (ZeRO<3>), SHARD_GRAD_OP (ZeRO<2>), NO_SHARD (DDP) or HYBRID_SHARD; must match the "
       "program's Trainer",
       fsdp_setter("fsdp_sharding_strategy", accel::names_in(accel::sharding_strategy_names))},
      {"--fsdp_reshard_after_forward", "", "{true,false}", "FSDP", FlagScope::config_key,
       "FSDP2: free each unit's parameters after its forward (true, ZeRO<3>/HybridShard's default) or keep them "
       "until its backward (false; ZeRO<2> also accepts it)",
       fsdp_setter("fsdp_reshard_after_forward", {"true", "false"})},
      {"--fsdp_offload_params", "", "{true,false}", "FSDP", FlagScope::config_key,
       "the optimizer steps host-memory copies of the shards (cpu_offload)",
       fsdp_setter("fsdp_offload_params", {"true", "false"})},
      {"--fsdp_auto_wrap_policy", "", "NAME", "FSDP", FlagScope::config_key,
       "ZeRO-3 units: TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP",
       fsdp_setter("fsdp_auto_wrap_policy", accel::names_in(accel::auto_wrap_policy_names))},
      {"--fsdp_min_num_params", "", "N", "FSDP", FlagScope::config_key, "SIZE_BASED_WRAP's minimum unit size",
       fsdp_setter("fsdp_min_num_params", {})},
      {"--fsdp_transformer_layer_cls_to_wrap", "", "LIST", "FSDP", FlagScope::config_key,
       "TRANSFORMER_BASED_WRAP's module classes, comma-separated (e.g. BlockImpl)",
       fsdp_setter("fsdp_transformer_layer_cls_to_wrap", {})},
      {"--fsdp_state_dict_type", "", "NAME", "FSDP", FlagScope::config_key,
       "what save_state writes of a ZeRO<3>/HybridShard model: FULL_STATE_DICT (whole, one file) or "
       "SHARDED_STATE_DICT (each rank's shard; accel merge-weights joins them)",
       fsdp_setter("fsdp_state_dict_type", accel::names_in(accel::state_dict_type_names))},
      {"--fsdp_activation_checkpointing", "", "{true,false}", "FSDP", FlagScope::config_key,
       "every unit of the auto-wrap policy recomputes its activations in backward (ZeRO<N>'s "
       "activation_checkpointing)",
       fsdp_setter("fsdp_activation_checkpointing", {"true", "false"})},
      {"--config_file", "", "FILE", "General", FlagScope::general,
       "JSON config with Accelerate's keys (default $HF_HOME/accelerate/default_config.json, else "
       "~/.cache/huggingface/accelerate/default_config.json); flags override it",
       {}},
      {"--quiet", "-q", "", "General", FlagScope::general, "silence accel's own messages (rank output still passes)",
       [](S& s, const std::string&, const std::string&) { s.quiet = true; }},
      {"--debug", "", "", "General", FlagScope::config_key, "sets ACCELERATE_DEBUG_MODE=true",
       switch_setter(&S::debug, "debug")},
      {"--help", "-h", "", "General", FlagScope::general, "show this help and exit", {}},
  };
  return table;
}

/// What the command line of `accel launch` / `accel config` said.
struct ParsedCommand {
  LaunchSettings flags;
  std::optional<std::string> config_file;
  bool help = false;
  std::vector<std::string> positional;  ///< launch: program and its args; config: e.g. "default"
};

inline const FlagSpec* find_flag(std::string_view name) {
  for (const auto& spec : flag_table())
    if (spec.name == name || (!spec.short_name.empty() && spec.short_name == name)) return &spec;
  return nullptr;
}

/// Parses flags. With `program_follows`, the first argument that is not a
/// flag (or whatever follows "--") starts the program, and the rest is its
/// own; otherwise positional words are collected and launch-only flags are
/// refused (they have no config key).
inline ParsedCommand parse_command_line(const std::vector<std::string>& args, bool program_follows) {
  ParsedCommand parsed;
  auto looks_like_value = [](const std::string& token) {
    if (token.empty() || token[0] != '-') return true;
    return token.size() > 1 && (std::isdigit(static_cast<unsigned char>(token[1])) || token[1] == '.');  // -1
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& token = args[i];
    if (token == "--") {
      parsed.positional.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
      break;
    }
    if (token.size() < 2 || token[0] != '-') {
      if (program_follows) {
        parsed.positional.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
        break;
      }
      parsed.positional.push_back(token);
      continue;
    }
    std::string name = token;
    std::optional<std::string> inline_value;
    if (auto eq = token.find('='); eq != std::string::npos && token.starts_with("--")) {
      name = token.substr(0, eq);
      inline_value = token.substr(eq + 1);
    }
    // Accelerate also spells its flags with dashes (--num-processes).
    if (name.starts_with("--"))
      for (std::size_t c = 2; c < name.size(); ++c)
        if (name[c] == '-') name[c] = '_';
    const FlagSpec* spec = find_flag(name);
    if (!spec) throw UsageError("unknown flag " + name);
    if (spec->name == "--help") {
      parsed.help = true;
      continue;
    }
    if (!program_follows && spec->scope == FlagScope::launch_only)
      throw UsageError(std::string(spec->name) +
                       " is a launch-only flag, not an Accelerate config key; pass it to accel launch");
    const std::string flag(spec->name);
    std::string value;
    if (spec->is_switch()) {
      if (inline_value) throw UsageError(flag + " takes no value");
    } else if (inline_value) {
      if (inline_value->empty()) throw UsageError(flag + " needs a value (" + std::string(spec->metavar) + ")");
      value = *inline_value;
    } else {
      if (i + 1 >= args.size() || !looks_like_value(args[i + 1]))
        throw UsageError(flag + " needs a value (" + std::string(spec->metavar) + ")");
      value = args[++i];
    }
    if (spec->name == "--config_file") parsed.config_file = value;
    else spec->apply(parsed.flags, flag, value);
  }
  return parsed;
}

/// One --help entry: the flag in a left column, its help wrapped at 100 columns.
inline std::string wrap(std::string left, std::string_view help) {
  constexpr std::size_t column = 38, width = 100;
  if (left.size() < column) left.resize(column, ' ');
  else left += "\n" + std::string(column, ' ');
  std::string text = left;
  std::size_t line_length = column;
  while (!help.empty()) {
    auto space = help.find(' ');
    std::string_view word = help.substr(0, space);
    if (line_length > column && line_length + 1 + word.size() > width) {
      text += "\n" + std::string(column, ' ');
      line_length = column;
    } else if (line_length > column) {
      text += ' ';
      ++line_length;
    }
    text += word;
    line_length += word.size();
    help = space == std::string_view::npos ? std::string_view{} : help.substr(space + 1);
  }
  return text + "\n";
}

/// The flag section of --help, generated from the table.
inline std::string flags_help(bool include_launch_only) {
  std::string text;
  std::string_view group;
  for (const auto& spec : flag_table()) {
    if (!include_launch_only && spec.scope == FlagScope::launch_only) continue;
    if (spec.group != group) {
      group = spec.group;
      text += "\n";
      text += group;
      text += ":\n";
    }
    std::string left = "  ";
    if (!spec.short_name.empty()) {
      left += spec.short_name;
      left += ", ";
    }
    left += spec.name;
    if (!spec.is_switch()) {
      left += ' ';
      left += spec.metavar;
    }
    text += wrap(left, spec.help);
  }
  return text;
}

}  // namespace accel::cli
