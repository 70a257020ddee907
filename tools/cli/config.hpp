#pragma once
// Accelerate-style config files, read and written as JSON. Accelerate itself
// reads JSON config files with the same keys, so a file carries over both
// ways; YAML is refused with a conversion hint rather than half-parsed.
// Unknown keys and wrongly typed values are errors naming key and file (as
// Accelerate's ClusterConfig.from_json_file does), never silently dropped.

#include <pwd.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/settings.hpp"

namespace accel::cli {

using nlohmann::json;

/// `$HF_HOME/accelerate/default_config.json`, else (as Accelerate does)
/// `$XDG_CACHE_HOME/huggingface/...`, else `~/.cache/huggingface/...`.
inline std::filesystem::path default_config_path() {
  auto env = [](const char* name) -> std::string {
    const char* value = std::getenv(name);
    return value ? value : "";
  };
  std::filesystem::path hf_home = env("HF_HOME");
  if (hf_home.empty()) {
    std::filesystem::path cache = env("XDG_CACHE_HOME");
    if (cache.empty()) {
      std::string home = env("HOME");
      if (home.empty())
        if (const passwd* pw = ::getpwuid(::getuid()); pw && pw->pw_dir) home = pw->pw_dir;
      cache = std::filesystem::path(home) / ".cache";
    }
    hf_home = cache / "huggingface";
  }
  return hf_home / "accelerate" / "default_config.json";
}

inline bool is_yaml_path(const std::filesystem::path& path) {
  auto ext = path.extension().string();
  return ext == ".yaml" || ext == ".yml";
}

namespace detail {

inline std::string json_type_name(const json& value) {
  if (value.is_number_integer()) return "integer " + value.dump();
  if (value.is_number()) return "number " + value.dump();
  return std::string(value.type_name()) + " " + value.dump();
}

// Reads one file; every error names the key (with its section) and the file.
struct ConfigReader {
  std::string file;
  LaunchSettings& out;

  [[noreturn]] void wrong_type(const std::string& key, const char* expected, const json& value) const {
    throw UsageError("key '" + key + "' in config file " + file + " must be " + expected + ", got " +
                     json_type_name(value));
  }
  std::string as_string(const std::string& key, const json& v) const {
    if (!v.is_string()) wrong_type(key, "a string", v);
    return v.get<std::string>();
  }
  int as_int(const std::string& key, const json& v) const {
    if (!v.is_number_integer() || v.get<long long>() < INT32_MIN || v.get<long long>() > INT32_MAX)
      wrong_type(key, "an integer", v);
    return v.get<int>();
  }
  bool as_bool(const std::string& key, const json& v) const {
    if (!v.is_boolean()) wrong_type(key, "a boolean (true or false)", v);
    return v.get<bool>();
  }
  void mark(const std::string& key) const { out.origin[key] = "config file " + file; }

  // A nested section: an object of scalars whose keys start with `prefix`
  // (or are in `allowed`).
  void read_section(const std::string& section, const json& v, Section& into, const std::string& prefix,
                    const std::set<std::string>& allowed = {}) const {
    if (!v.is_object()) wrong_type(section, "an object", v);
    for (const auto& [key, value] : v.items()) {
      const std::string full = section + "." + key;
      bool known = allowed.empty() ? (key.starts_with(prefix) && key.size() > prefix.size()) : allowed.count(key) > 0;
      if (!known) throw UsageError("unknown key '" + full + "' in config file " + file);
      if (value.is_null()) continue;
      if (!value.is_string() && !value.is_number() && !value.is_boolean())
        wrong_type(full, "a string, number or boolean", value);
      into[key] = value;
    }
  }

  void read(const json& root) {
    using Handler = std::function<void(const std::string&, const json&)>;
    auto str = [this](std::optional<std::string> LaunchSettings::*field) -> Handler {
      return [this, field](const std::string& k, const json& v) { out.*field = as_string(k, v), mark(k); };
    };
    auto integer = [this](std::optional<int> LaunchSettings::*field) -> Handler {
      return [this, field](const std::string& k, const json& v) { out.*field = as_int(k, v), mark(k); };
    };
    auto boolean = [this](std::optional<bool> LaunchSettings::*field) -> Handler {
      return [this, field](const std::string& k, const json& v) { out.*field = as_bool(k, v), mark(k); };
    };
    auto ignored = [](const std::string&, const json&) {};
    using S = LaunchSettings;
    const std::map<std::string, Handler> keys = {
        {"compute_environment", str(&S::compute_environment)},
        {"distributed_type", str(&S::distributed_type)},
        {"mixed_precision", str(&S::mixed_precision)},
        {"use_cpu", boolean(&S::use_cpu)},
        {"debug", boolean(&S::debug)},
        {"num_processes", integer(&S::num_processes)},
        {"num_machines", integer(&S::num_machines)},
        {"machine_rank", integer(&S::machine_rank)},
        {"main_process_ip", str(&S::main_process_ip)},
        {"main_process_port", integer(&S::main_process_port)},
        {"rdzv_backend", str(&S::rdzv_backend)},
        {"same_network", boolean(&S::same_network)},
        {"enable_cpu_affinity", boolean(&S::enable_cpu_affinity)},
        {"gradient_accumulation_steps", integer(&S::gradient_accumulation_steps)},
        // Accelerate writes "all" or "0,1"; YAML may have turned a single id into a number.
        {"gpu_ids",
         [this](const std::string& k, const json& v) {
           if (v.is_number_integer()) out.gpu_ids = std::to_string(v.get<long long>());
           else out.gpu_ids = as_string(k, v);
           mark(k);
         }},
        {"deepspeed_config",
         [this](const std::string& k, const json& v) {
           read_section(k, v, out.deepspeed_config, "",
                        {"zero_stage", "offload_optimizer_device", "offload_param_device",
                         "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
                         "zero3_save_16bit_model", "deepspeed_config_file", "deepspeed_multinode_launcher"});
         }},
        {"fsdp_config", [this](const std::string& k, const json& v) { read_section(k, v, out.fsdp_config, "fsdp_"); }},
        {"megatron_lm_config",
         [this](const std::string& k, const json& v) { read_section(k, v, out.megatron_lm_config, "megatron_lm_"); }},
        {"parallelism_config",
         [this](const std::string& k, const json& v) {
           read_section(k, v, out.parallelism_config, "parallelism_config_");
         }},
        // Written by `accelerate config` but meaningless for accel: accepted so
        // that Accelerate's own files load, and ignored.
        {"downcast_bf16", ignored},
        {"main_training_function", ignored},
        {"tpu_env", ignored},
        {"tpu_use_cluster", ignored},
        {"tpu_use_sudo", ignored},
        {"dynamo_config", ignored},
    };
    if (!root.is_object())
      throw UsageError("config file " + file + " must hold a JSON object of Accelerate's keys, got " +
                       std::string(root.type_name()));
    for (const auto& [key, value] : root.items()) {
      auto handler = keys.find(key);
      if (handler == keys.end()) throw UsageError("unknown key '" + key + "' in config file " + file);
      if (value.is_null()) continue;  // Accelerate writes null for unset values
      handler->second(key, value);
    }
    // Accelerate keeps gradient_accumulation_steps under deepspeed_config.
    if (auto it = out.deepspeed_config.find("gradient_accumulation_steps"); it != out.deepspeed_config.end()) {
      int nested = as_int("deepspeed_config.gradient_accumulation_steps", it->second);
      if (out.gradient_accumulation_steps && *out.gradient_accumulation_steps != nested)
        throw UsageError("config file " + file + " sets gradient_accumulation_steps " +
                         std::to_string(*out.gradient_accumulation_steps) +
                         " but deepspeed_config.gradient_accumulation_steps " + std::to_string(nested) +
                         "; keep one");
      out.gradient_accumulation_steps = nested;
      mark("gradient_accumulation_steps");
    }
  }
};

}  // namespace detail

/// Loads a config file; throws UsageError for a missing, YAML, malformed or
/// unknown-keyed file.
inline LaunchSettings load_config_file(const std::filesystem::path& path) {
  const std::string file = path.string();
  if (is_yaml_path(path))
    throw UsageError("config file " + file +
                     " is YAML; accel reads JSON config files (Accelerate reads JSON too, with the same keys). "
                     "Convert it once: python3 -c 'import sys,yaml,json; json.dump(yaml.safe_load(open(sys.argv[1])), "
                     "open(sys.argv[2],\"w\"), indent=2)' " +
                     file + " " + (path.parent_path() / (path.stem().string() + ".json")).string());
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw UsageError("config file " + file + " does not exist");
  std::ifstream in(path);
  if (!in) throw UsageError("cannot read config file " + file);
  json root;
  try {
    root = json::parse(in);
  } catch (const json::parse_error& e) {
    throw UsageError("config file " + file + " is not valid JSON: " + e.what());
  }
  LaunchSettings settings;
  detail::ConfigReader{file, settings}.read(root);
  return settings;
}

/// The JSON `accel config` writes: every top-level key Accelerate writes for
/// a local machine, with the given values and defaults for the rest
/// (mixed_precision only when given: see below). The
/// address and port are written only when they matter (several machines, or
/// given), as Accelerate does, so a single-machine job keeps its free-port
/// fallback.
inline json config_to_json(const LaunchSettings& s, const std::string& distributed_type) {
  json out = json::object();
  out["compute_environment"] = s.compute_environment.value_or("LOCAL_MACHINE");
  out["debug"] = s.debug.value_or(false);
  out["distributed_type"] = distributed_type;
  out["enable_cpu_affinity"] = s.enable_cpu_affinity.value_or(false);
  out["gpu_ids"] = s.gpu_ids.value_or("all");
  out["machine_rank"] = s.machine_rank.value_or(0);
  if (s.num_machines.value_or(1) > 1 || s.main_process_ip) out["main_process_ip"] = s.main_process_ip.value_or("127.0.0.1");
  if (s.num_machines.value_or(1) > 1 || s.main_process_port) out["main_process_port"] = s.main_process_port.value_or(29500);
  // Only when given: a config's mixed_precision is a request every rank's
  // compiled Precision must match, and a default would refuse a BF16 program
  // for nothing (Accelerate reads a file without the key as "no").
  if (s.mixed_precision) out["mixed_precision"] = *s.mixed_precision;
  out["num_machines"] = s.num_machines.value_or(1);
  out["num_processes"] = s.num_processes.value_or(1);
  out["rdzv_backend"] = s.rdzv_backend.value_or("static");
  out["same_network"] = s.same_network.value_or(true);
  out["use_cpu"] = s.use_cpu.value_or(false);
  if (s.gradient_accumulation_steps) out["gradient_accumulation_steps"] = *s.gradient_accumulation_steps;
  auto section = [&](const char* name, const Section& values) {
    if (values.empty()) return;
    json obj = json::object();
    for (const auto& [key, value] : values) obj[key] = value;
    out[name] = obj;
  };
  section("deepspeed_config", s.deepspeed_config);
  section("fsdp_config", s.fsdp_config);
  section("megatron_lm_config", s.megatron_lm_config);
  section("parallelism_config", s.parallelism_config);
  return out;
}

/// Writes `config` to `path` (creating its folder), atomically via a
/// temporary file so a reader never sees half a config.
inline void write_config_file(const std::filesystem::path& path, const json& config) {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) throw std::runtime_error("cannot create " + path.parent_path().string() + ": " + ec.message());
  const auto tmp = std::filesystem::path(path.string() + ".tmp" + std::to_string(::getpid()));
  {
    std::ofstream out(tmp);
    out << config.dump(2) << '\n';
    if (!out) throw std::runtime_error("cannot write " + tmp.string());
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    throw std::runtime_error("cannot write " + path.string() + ": " + ec.message());
  }
}

}  // namespace accel::cli
