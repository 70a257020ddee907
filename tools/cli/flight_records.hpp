#pragma once
// accel launch's side of NOTE [Flight recorder] (include/accel/comm/flight_recorder.hpp):
// a directory for the ranks' records, a request for them (SIGUSR1) before
// the ranks are stopped, and the one-screen summary of what they say.

#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "accel/comm/flight_recorder.hpp"
#include "cli/plan.hpp"

namespace accel::cli {

class FlightRecords {
 public:
  /// The user's ACCEL_FLIGHT_RECORDER_DIR (kept), else a temporary directory
  /// (removed at the end); the ranks get it through the plan.
  explicit FlightRecords(JobPlan& plan) {
    if (auto mine = comm::FlightRecorder::directory()) {
      dir_ = *mine;
      keep_ = true;
    } else {
      std::string name = (std::filesystem::temp_directory_path() / "accel-flight-XXXXXX").string();
      if (::mkdtemp(name.data()) == nullptr) return;  // no records, nothing else lost
      dir_ = name;
    }
    plan.job_env.emplace_back(comm::flight_recorder_dir_variable, dir_.string());
  }
  ~FlightRecords() {
    std::error_code ignored;
    if (!keep_ && !dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }
  FlightRecords(const FlightRecords&) = delete;
  FlightRecords& operator=(const FlightRecords&) = delete;

  const std::filesystem::path& directory() const { return dir_; }
  bool kept() const { return keep_; }

  /// Before a start: the previous start's records are not this one's.
  void clear() const {
    std::error_code ignored;
    for (const auto& entry : std::filesystem::directory_iterator(dir_, ignored))
      if (entry.path().filename().string().rfind("rank_", 0) == 0) std::filesystem::remove(entry.path(), ignored);
  }

  /// The records of the ranks still running (`ranks`), just before they are
  /// stopped. After a rank died, the others' collectives with it fail within
  /// moments, and a rank whose collective failed writes its own record, with
  /// that failure, before it exits. Asked at once, a survivor could answer
  /// before its collective failed and be stopped before it wrote again: its
  /// record would show it computing or waiting (the CI saw this under load).
  /// So after a failure each rank that can answer first gets `patience` to
  /// write its own record or to end; those still silent are asked then. After
  /// a timeout nobody is going to fail first: every rank is asked at once.
  void collect(const std::vector<std::pair<int, pid_t>>& ranks, bool after_failure,
               const std::function<void(int)>& idle, std::chrono::milliseconds patience) const {
    if (dir_.empty()) return;
    std::vector<std::pair<int, pid_t>> silent = ranks;
    if (after_failure) {
      std::erase_if(silent, [](const auto& rank_pid) { return !catches_sigusr1(rank_pid.second); });
      const auto until = std::chrono::steady_clock::now() + patience;
      for (;;) {
        std::erase_if(silent, [&](const auto& rank_pid) { return has_record(rank_pid.first) || has_ended(rank_pid.second); });
        if (silent.empty() || std::chrono::steady_clock::now() >= until) break;
        idle(20);
      }
    }
    request(silent, idle);
  }

  /// Asks each running rank that catches SIGUSR1 (an accel program with
  /// the recorder on) for its record and waits, `idle` pumping output, until
  /// each has written it or `patience` passes (a stopped or stuck rank).
  void request(const std::vector<std::pair<int, pid_t>>& ranks, const std::function<void(int)>& idle,
               std::chrono::milliseconds patience = std::chrono::seconds(2)) const {
    if (dir_.empty()) return;
    const auto asked_at = std::filesystem::file_time_type::clock::now();
    std::vector<int> asked;
    for (const auto& [rank, pid] : ranks)
      if (catches_sigusr1(pid) && ::kill(pid, SIGUSR1) == 0) asked.push_back(rank);
    const auto until = std::chrono::steady_clock::now() + patience;
    while (!asked.empty() && std::chrono::steady_clock::now() < until) {
      std::erase_if(asked, [&](int rank) {
        std::error_code error;
        const auto written = std::filesystem::last_write_time(record_path(rank), error);
        return !error && written >= asked_at;
      });
      idle(20);
    }
  }

  /// Whether `rank`'s record holds a collective that failed: its failure
  /// was in communication (a peer gone, a timeout), which the screen
  /// explains, rather than an error of its own.
  bool failed_in_collective(int rank) const {
    std::ifstream in(record_path(rank));
    if (!in) return false;
    try {
      for (const auto& e : nlohmann::json::parse(in).at("entries"))
        if (e.at("state").get<std::string>() == "failed") return true;
    } catch (const std::exception&) {
      // a torn or foreign file: as if absent
    }
    return false;
  }

  /// The summary of the records this start's ranks wrote ("" when none did).
  std::string summary(const std::vector<int>& expected) const {
    std::vector<nlohmann::json> records;
    std::error_code ignored;
    for (int rank : expected) {
      std::ifstream in(record_path(rank));
      if (!in) continue;
      try {
        records.push_back(nlohmann::json::parse(in));
      } catch (const std::exception&) {
        // a torn or foreign file: as if absent
      }
    }
    if (records.empty()) return "";
    return comm::summarize_flight_records(records, expected);
  }

 private:
  // Whether `pid` has a handler for SIGUSR1 (the SigCgt mask of /proc/<pid>/status):
  // SIGUSR1's default action would end a program that has none.
  static bool catches_sigusr1(pid_t pid) {
    std::ifstream status("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(status, line))
      if (line.rfind("SigCgt:", 0) == 0) {
        const std::uint64_t mask = std::stoull(line.substr(7), nullptr, 16);
        return (mask >> (SIGUSR1 - 1)) & 1u;
      }
    return false;
  }

  std::filesystem::path record_path(int rank) const { return dir_ / ("rank_" + std::to_string(rank) + ".json"); }

  bool has_record(int rank) const {
    std::error_code error;
    return std::filesystem::exists(record_path(rank), error);
  }

  // Whether `pid` has ended: gone, or a zombie the supervisor has not reaped yet.
  static bool has_ended(pid_t pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close_paren = text.rfind(')');  // the name in parentheses may hold anything
    return close_paren == std::string::npos || close_paren + 2 >= text.size() || text[close_paren + 2] == 'Z';
  }

  std::filesystem::path dir_;
  bool keep_ = false;
};

}  // namespace accel::cli
