#pragma once
// `accel env`: what to paste into a bug report (like `accelerate env`):
// accel's version, the machine, the default config and the launcher
// variables already set in this shell, which are the usual cause of a job
// that sees the wrong rank or world size.

#include <sched.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cli/config.hpp"

extern char** environ;

#ifndef ACCEL_VERSION
#define ACCEL_VERSION "unknown"
#endif

namespace accel::cli {

inline std::string environment_report() {
  std::ostringstream out;
  out << "accel version: " << ACCEL_VERSION << '\n';
  utsname uts{};
  if (::uname(&uts) == 0)
    out << "Platform: " << uts.sysname << ' ' << uts.release << ' ' << uts.machine << '\n';
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int usable = ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : -1;
  out << "CPUs: " << std::thread::hardware_concurrency() << " online";
  if (usable > 0) out << ", " << usable << " usable by this process";
  out << '\n';

  const auto config = default_config_path();
  out << "Default config: " << config.string();
  std::error_code ec;
  if (std::filesystem::is_regular_file(config, ec)) {
    out << '\n';
    std::ifstream in(config);
    for (std::string line; std::getline(in, line);) out << "  " << line << '\n';
  } else {
    out << " (not present)\n";
  }

  // Launcher and library variables: torchrun's, Accelerate's, SLURM's, Open MPI's, ...
  static constexpr std::string_view exact[] = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                               "GROUP_RANK",  "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                                               "CUDA_VISIBLE_DEVICES", "HF_HOME", "GLOO_SOCKET_IFNAME"};
  static constexpr std::string_view prefixes[] = {"ACCELERATE_", "FSDP_", "SLURM_", "OMPI_COMM_WORLD_",
                                                  "PMI_", "TORCHELASTIC_", "NCCL_"};
  std::vector<std::string> found;
  for (char** entry = environ; entry && *entry; ++entry) {
    std::string_view text(*entry);
    std::string_view name = text.substr(0, text.find('='));
    bool wanted = std::find(std::begin(exact), std::end(exact), name) != std::end(exact);
    for (auto prefix : prefixes) wanted = wanted || name.starts_with(prefix);
    if (wanted) found.emplace_back(text);
  }
  std::sort(found.begin(), found.end());
  out << "Launcher environment variables:";
  if (found.empty()) out << " none set";
  out << '\n';
  for (const auto& line : found) out << "  " << line << '\n';
  return out.str();
}

}  // namespace accel::cli
