#pragma once
// Who am I in the job? Read from the environment a launcher left behind:
// torchrun / `accel launch` (RANK, WORLD_SIZE, ...), Open MPI's mpirun
// (OMPI_COMM_WORLD_*) or SLURM's srun (SLURM_*). No variables at all means one
// process. Torch-free, so it is unit-tested in the fast core test binary.

#include <charconv>
#include <cstdlib>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "accel/core/compiled_once.hpp"

namespace accel::comm {

/// Where this process sits in the job.
struct WorldInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "none";  ///< "none", "torchrun", "openmpi" or "slurm"
};

/// Incomplete, malformed or contradictory launcher variables.
class EnvironmentError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Reads a variable; tests pass their own lookup instead of the real environment.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

inline std::optional<std::string> process_environment(const std::string& name) {
  if (const char* value = std::getenv(name.c_str()); value != nullptr && *value != '\0') return std::string(value);
  return std::nullopt;
}

namespace detail {

inline int parse_int_variable(const std::string& name, const std::string& text, int min_value) {
  int value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc{} || ptr != end)
    throw EnvironmentError("accel: environment variable " + name + "='" + text + "' is not an integer");
  if (value < min_value)
    throw EnvironmentError("accel: environment variable " + name + "=" + text + " must be at least " +
                           std::to_string(min_value));
  return value;
}

struct VariableReader {
  const EnvLookup& lookup;

  std::optional<int> optional_int(const std::string& name, int min_value = 0) const {
    auto text = lookup(name);
    if (!text) return std::nullopt;
    return parse_int_variable(name, *text, min_value);
  }
  int required_int(const std::string& name, const std::string& because, int min_value = 0) const {
    auto value = optional_int(name, min_value);
    if (!value) throw EnvironmentError("accel: environment variable " + name + " is not set, but " + because);
    return *value;
  }
};

// One launcher's variable names; every launcher is read the same way.
struct LauncherNames {
  const char* launcher;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
};

inline constexpr LauncherNames torchrun_names{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
inline constexpr LauncherNames openmpi_names{"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
inline constexpr LauncherNames slurm_names{"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                           "SLURM_NTASKS_PER_NODE"};

std::optional<WorldInfo> read_launcher(const VariableReader& env, const LauncherNames& names);

void check_agrees(const WorldInfo& chosen, const WorldInfo& other, const LauncherNames& chosen_names,
                         const LauncherNames& other_names);

}  // namespace detail

/// The job layout from the environment. torchrun's variables win when present
/// (torchrun inside an salloc shell is common); a second launcher's variables
/// that disagree with them are an error rather than a silent choice.
WorldInfo world_from_environment(const EnvLookup& lookup = process_environment);

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE WorldInfo world_from_environment(const EnvLookup& lookup) {
  const detail::VariableReader env{lookup};
  const detail::LauncherNames* order[] = {&detail::torchrun_names, &detail::openmpi_names, &detail::slurm_names};
  std::optional<WorldInfo> chosen;
  const detail::LauncherNames* chosen_names = nullptr;
  for (const auto* names : order) {
    auto info = detail::read_launcher(env, *names);
    if (!info) continue;
    if (!chosen) {
      chosen = std::move(info);
      chosen_names = names;
    } else if (info->world_size > 1 || chosen->world_size > 1) {
      // A one-task SLURM allocation around a multi-process torchrun is normal; anything else must agree.
      if (!(names == &detail::slurm_names && info->world_size == 1)) detail::check_agrees(*chosen, *info, *chosen_names, *names);
    }
  }
  if (!chosen) return WorldInfo{};
  if (auto addr = lookup("MASTER_ADDR")) chosen->master_addr = *addr;
  else if (chosen->world_size > 1)
    throw EnvironmentError("accel: MASTER_ADDR is not set, but WORLD_SIZE=" + std::to_string(chosen->world_size) +
                           " needs the address of rank 0 (" + chosen->launcher +
                           " job: export MASTER_ADDR=<host of rank 0>)");
  if (auto port = env.optional_int("MASTER_PORT", 1)) {
    if (*port > 65535) throw EnvironmentError("accel: MASTER_PORT=" + std::to_string(*port) + " is not a TCP port");
    chosen->master_port = *port;
  } else if (chosen->world_size > 1 && chosen->launcher == "torchrun") {
    throw EnvironmentError("accel: MASTER_PORT is not set, but WORLD_SIZE=" + std::to_string(chosen->world_size) +
                           " needs the port of rank 0's store");
  }
  return *chosen;
}

ACCEL_COMPILED_ONCE std::optional<WorldInfo> detail::read_launcher(const VariableReader& env, const LauncherNames& names) {
  auto rank = env.optional_int(names.rank);
  auto world = env.optional_int(names.world_size, 1);
  if (!rank && !world) return std::nullopt;
  const std::string launcher = names.launcher;
  if (!rank) throw EnvironmentError(std::string("accel: ") + names.world_size + " is set but " + names.rank + " is not (" + launcher + " sets both)");
  if (!world) throw EnvironmentError(std::string("accel: ") + names.rank + " is set but " + names.world_size + " is not (" + launcher + " sets both)");
  if (*rank >= *world)
    throw EnvironmentError(std::string("accel: ") + names.rank + "=" + std::to_string(*rank) + " is not below " +
                           names.world_size + "=" + std::to_string(*world));
  WorldInfo info;
  info.launcher = launcher;
  info.rank = *rank;
  info.world_size = *world;
  info.local_rank = env.optional_int(names.local_rank).value_or(*rank);
  // SLURM_NTASKS_PER_NODE may read "2(x3)": 2 tasks on each of 3 nodes. A list of unequal
  // counts ("2(x2),1") names no single local size, and the world size stands in for it.
  std::optional<int> local_world;
  if (auto text = env.lookup(names.local_world_size)) {
    std::string count = *text;
    if (const auto paren = count.find("(x"); paren != std::string::npos && count.back() == ')' &&
                                              count.find(',') == std::string::npos)
      count.resize(paren);
    if (count.find_first_of("(,") == std::string::npos)
      local_world = parse_int_variable(names.local_world_size, count, 1);
  }
  info.local_world_size = local_world.value_or(*world);
  if (info.local_rank >= info.local_world_size)
    throw EnvironmentError(std::string("accel: ") + names.local_rank + "=" + std::to_string(info.local_rank) +
                           " is not below " + names.local_world_size + "=" + std::to_string(info.local_world_size));
  return info;
}

ACCEL_COMPILED_ONCE void detail::check_agrees(const WorldInfo& chosen, const WorldInfo& other, const LauncherNames& chosen_names, const LauncherNames& other_names) {
  auto mismatch = [&](const char* a, int va, const char* b, int vb) {
    throw EnvironmentError(std::string("accel: contradictory launcher variables: ") + a + "=" + std::to_string(va) +
                           " but " + b + "=" + std::to_string(vb) + "; unset the stale ones");
  };
  if (chosen.rank != other.rank) mismatch(chosen_names.rank, chosen.rank, other_names.rank, other.rank);
  if (chosen.world_size != other.world_size)
    mismatch(chosen_names.world_size, chosen.world_size, other_names.world_size, other.world_size);
}

#endif

}  // namespace accel::comm
