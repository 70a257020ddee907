#pragma once
// NOTE [Flight recorder]
// A hung job gives no error until its timeout, and then only the rank that
// timed out speaks. So every process keeps its last `capacity` collectives
// in a ring (as PyTorch's NCCL flight recorder does): the group, the
// collective's number in it, the operation, what it was for, the bytes, when
// it was issued and when it ended, and how (issued, completed, failed).
//
// The record goes to <dir>/rank_<r>.json, where dir is ACCEL_FLIGHT_RECORDER_DIR
// (`accel launch` sets it), when a collective of this process fails, and
// when the process receives SIGUSR1: the handler only raises a flag, which
// the heartbeat thread (comm/liveness.hpp) sees within a period and writes
// the file, so a rank blocked in a collective still answers. `accel launch`
// sends SIGUSR1 to every rank when the job runs past --timeout, and when one
// fails to every rank that has not written its own record of the failure
// within the stop grace (cli/flight_records.hpp), then reads the files and
// prints summarize(): per group, which ranks are in the newest collective,
// since when, and which never entered it.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "accel/core/compiled_once.hpp"
#include "accel/core/json.hpp"

namespace accel::comm {

inline constexpr const char* flight_recorder_dir_variable = "ACCEL_FLIGHT_RECORDER_DIR";

class FlightRecorder {
 public:
  static constexpr std::size_t capacity = 256;

  enum class State { issued, completed, failed };

  struct Entry {
    std::uint64_t id = 0;  ///< 0: an empty slot
    std::string group;     ///< "world", or a sub-group's name
    std::uint64_t sequence = 0;
    bool point_to_point = false;  ///< a send or receive, after collective #sequence
    std::string op;
    std::string what;
    std::uint64_t bytes = 0;
    double issued_s = 0;  ///< seconds since the epoch
    double ended_s = 0;
    State state = State::issued;
  };

  /// The process's recorder (each forked rank has its own copy).
  static FlightRecorder& instance() {
    static FlightRecorder recorder;
    return recorder;
  }

  /// Records a collective as issued; returns its id for finish().
  std::uint64_t issue(const std::string& group, std::uint64_t sequence, bool point_to_point, std::string_view op,
                      const std::string& what, std::uint64_t bytes);

  /// The collective `id` ended (a no-op once the ring has moved past it).
  void finish(std::uint64_t id, bool ok);

  /// The entries still in the ring, oldest first.
  std::vector<Entry> entries() const;

  nlohmann::json to_json(int rank) const;

  /// Writes the record to <ACCEL_FLIGHT_RECORDER_DIR>/rank_<rank>.json
  /// (through a temporary name, so a reader never sees half a file); returns
  /// the path, or nothing when the variable is unset or the write failed.
  std::optional<std::filesystem::path> dump(int rank) const noexcept;

  static std::optional<std::filesystem::path> directory() {
    const char* dir = std::getenv(flight_recorder_dir_variable);
    if (dir == nullptr || *dir == '\0') return std::nullopt;
    return std::filesystem::path(dir);
  }

  /// Where a record is wanted (ACCEL_FLIGHT_RECORDER_DIR set), SIGUSR1 asks
  /// for one, unless the program handles SIGUSR1 itself.
  static void install_signal_handler();

  /// Whether a record was asked for since the last call (the heartbeat
  /// thread polls it).
  static bool take_request() { return dump_requested().exchange(false); }

  static const char* state_name(State s) {
    return s == State::issued ? "issued" : s == State::completed ? "completed" : "failed";
  }

 private:
  FlightRecorder() : ring_(capacity) {}
  static double now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
  static std::atomic<bool>& dump_requested() {
    static std::atomic<bool> requested{false};
    return requested;
  }

  mutable std::mutex mutex_;
  std::vector<Entry> ring_;
  std::uint64_t next_id_ = 1;
};

/// One screen from every rank's record (`records`: the rank_<r>.json files
/// read back; `expected`: the ranks that should have written one, so that a
/// missing one is named).
/// Per group, the newest collective any rank issued: the ranks waiting in it
/// (and for how long, at the time of their record), those that failed in it,
/// and those that never entered it, with where they are instead.
std::string summarize_flight_records(const std::vector<nlohmann::json>& records, const std::vector<int>& expected);

// The members compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
}  // namespace accel::comm

#include <fstream>

namespace accel::comm {

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE std::string summarize_flight_records(const std::vector<nlohmann::json>& records,
                                            const std::vector<int>& expected) {
  std::ostringstream out;
  std::map<int, const nlohmann::json*> by_rank;
  for (const auto& r : records) by_rank[r.at("rank").get<int>()] = &r;
  std::vector<int> silent;
  for (int r : expected)
    if (!by_rank.count(r)) silent.push_back(r);

  // Each rank's latest collective per group (point-to-point entries say where it is, too).
  struct Last {
    const nlohmann::json* entry;
    double written_s;
  };
  std::map<std::string, std::map<int, Last>> latest;  // group -> rank -> its newest entry
  for (const auto& [rank, record] : by_rank)
    for (const auto& e : record->at("entries")) latest[e.at("group").get<std::string>()][rank] = {&e, record->at("written_s").get<double>()};

  auto describe = [](const nlohmann::json& e) {
    std::string text = e.at("op").get<std::string>() + " " + (e.at("point_to_point").get<bool>() ? "after #" : "#") +
                       std::to_string(e.at("sequence").get<std::uint64_t>()) + " (" + e.at("what").get<std::string>() + ")";
    return text;
  };
  for (const auto& [group, ranks] : latest) {
    std::uint64_t newest = 0;
    for (const auto& [rank, last] : ranks)
      if (!last.entry->at("point_to_point").get<bool>())
        newest = std::max(newest, last.entry->at("sequence").get<std::uint64_t>());
    out << "group " << group << ": newest collective #" << newest << "\n";
    for (const auto& [rank, last] : ranks) {
      const auto& e = *last.entry;
      const std::string state = e.at("state").get<std::string>();
      std::ostringstream line;
      line.setf(std::ios::fixed);
      line.precision(1);
      const bool in_newest = !e.at("point_to_point").get<bool>() && e.at("sequence").get<std::uint64_t>() == newest;
      if (state == "issued")
        line << "waiting in " << describe(e) << " for " << (last.written_s - e.at("issued_s").get<double>()) << " s";
      else if (state == "failed")
        line << "failed in " << describe(e);
      else
        line << (in_newest ? "completed " : "last completed ") << describe(e);
      if (!in_newest && state != "failed") line << ": never entered #" << newest;
      out << "  rank " << rank << ": " << line.str() << "\n";
    }
    if (group == "world")  // every rank is in it
      for (const auto& [rank, record] : by_rank)
        if (!ranks.count(rank)) out << "  rank " << rank << ": never entered any collective of this group\n";
  }
  if (!silent.empty()) {
    out << "no record from rank";
    for (std::size_t k = 0; k < silent.size(); ++k) out << (k ? ", " : " ") << silent[k];
    out << " (it died, is stopped, never issued a collective, or handles SIGUSR1 itself)\n";
  }
  return out.str();
}

ACCEL_COMPILED_ONCE auto FlightRecorder::issue(const std::string& group, std::uint64_t sequence, bool point_to_point, std::string_view op, const std::string& what, std::uint64_t bytes) -> std::uint64_t {
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = ring_[next_id_ % capacity];
  e = Entry{next_id_, group, sequence, point_to_point, std::string(op), what, bytes, now(), 0, State::issued};
  return next_id_++;
}

ACCEL_COMPILED_ONCE void FlightRecorder::finish(std::uint64_t id, bool ok) {
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = ring_[id % capacity];
  if (e.id != id) return;
  e.ended_s = now();
  e.state = ok ? State::completed : State::failed;
}

ACCEL_COMPILED_ONCE auto FlightRecorder::entries() const -> std::vector<Entry> {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Entry> out;
  for (std::uint64_t id = next_id_ > capacity ? next_id_ - capacity : 1; id < next_id_; ++id)
    out.push_back(ring_[id % capacity]);
  return out;
}

ACCEL_COMPILED_ONCE auto FlightRecorder::to_json(int rank) const -> nlohmann::json {
  nlohmann::json j{{"rank", rank}, {"pid", static_cast<long>(::getpid())}, {"written_s", now()}};
  j["entries"] = nlohmann::json::array();
  for (const auto& e : entries())
    j["entries"].push_back({{"group", e.group},
                            {"sequence", e.sequence},
                            {"point_to_point", e.point_to_point},
                            {"op", e.op},
                            {"what", e.what},
                            {"bytes", e.bytes},
                            {"issued_s", e.issued_s},
                            {"ended_s", e.ended_s},
                            {"state", state_name(e.state)}});
  return j;
}

ACCEL_COMPILED_ONCE auto FlightRecorder::dump(int rank) const noexcept -> std::optional<std::filesystem::path> {
  try {
    const auto dir = directory();
    if (!dir) return std::nullopt;
    std::filesystem::create_directories(*dir);
    const auto path = *dir / ("rank_" + std::to_string(rank) + ".json");
    const auto temporary = *dir / ("rank_" + std::to_string(rank) + ".json.tmp");
    {
      std::ofstream out(temporary);
      out << to_json(rank).dump(1) << "\n";
      if (!out) return std::nullopt;
    }
    std::filesystem::rename(temporary, path);
    return path;
  } catch (...) {
    return std::nullopt;
  }
}

ACCEL_COMPILED_ONCE void FlightRecorder::install_signal_handler() {
  if (!directory()) return;
  struct sigaction current {};
  if (::sigaction(SIGUSR1, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
  struct sigaction action {};
  action.sa_handler = [](int) { dump_requested().store(true); };
  ::sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &action, nullptr);
}

#endif

}  // namespace accel::comm
