#pragma once
// Watches a job's rank processes: when one exits non-zero or dies, the others
// are terminated (SIGTERM, then SIGKILL after a grace period) so that nothing
// hangs and nothing is left behind. Shared by `accel::spawn` (in-process
// launcher) and `accel launch` (the command line). POSIX only, torch-free.

#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace accel::launch {

/// How one rank's process ended.
struct RankExit {
  int rank = -1;
  pid_t pid = -1;
  bool signaled = false;
  int status = 0;  ///< exit status, or the signal number when `signaled`

  bool ok() const { return !signaled && status == 0; }
  std::string describe() const {
    if (signaled) {
      const char* name = ::strsignal(status);
      return "was killed by signal " + std::to_string(status) + " (" + (name ? name : "unknown") + ")";
    }
    return "exited with status " + std::to_string(status);
  }
};

/// What happened to the job as a whole.
struct JobOutcome {
  std::vector<RankExit> exits;         ///< one per rank that ended by itself, in the order they ended
  std::optional<RankExit> first_failure;
  /// Ranks that crashed (a signal other than the supervisor's SIGTERM/SIGKILL)
  /// while they were being stopped: a crash whose core dump outlasted a
  /// peer's reaction to it is reported here rather than lost.
  std::vector<RankExit> crashed_while_stopped;
  bool timed_out = false;
  bool interrupted = false;            ///< the launcher itself got SIGINT/SIGTERM

  bool ok() const { return !first_failure && !timed_out && !interrupted; }
  std::string describe() const { return describe_first() + describe_others(); }

  /// The first failure, the timeout or the interruption.
  std::string describe_first() const {
    if (first_failure) return describe_rank(*first_failure);
    if (timed_out) return "the job did not finish within its timeout";
    if (interrupted) return "the launcher was interrupted";
    return "all ranks exited with status 0";
  }

  /// "; also rank 1 (pid ...) was killed by signal 11 ..." for every other
  /// rank that failed on its own: the first one seen is not always the cause
  /// (both ends of a broken connection exit).
  std::string describe_others() const {
    std::string text;
    for (const auto& e : exits)
      if (!e.ok() && !(first_failure && e.pid == first_failure->pid)) text += "; also " + describe_rank(e);
    for (const auto& e : crashed_while_stopped) text += "; also " + describe_rank(e) + " as it was being stopped";
    return text;
  }

  static std::string describe_rank(const RankExit& e) {
    return "rank " + std::to_string(e.rank) + " (pid " + std::to_string(e.pid) + ") " + e.describe();
  }
};

/// Called in a freshly forked rank process before it runs anything: its own
/// process group (so the supervisor can signal everything it started) and
/// death with its parent (so a killed launcher leaves no orphans).
inline void become_supervised_child() {
  // A forked child inherits the parent's handlers (a test runner's crash
  // reporter, say); the supervisor's SIGTERM must simply end it.
  for (int sig : {SIGTERM, SIGINT, SIGSEGV, SIGABRT, SIGFPE, SIGILL, SIGBUS, SIGPIPE}) ::signal(sig, SIG_DFL);
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) ::_exit(125);  // the parent died before prctl took effect
}

class ProcessSupervisor {
 public:
  using Clock = std::chrono::steady_clock;

  void add(int rank, pid_t pid) {
    ::setpgid(pid, pid);  // also done in the child; whichever runs first wins the race
    running_.push_back({rank, pid});
  }

  /// How long `wait` lets `idle` block between liveness checks (default 50 ms;
  /// `accel launch --monitor_interval` sets it).
  void set_poll_interval(std::chrono::milliseconds interval) {
    poll_interval_ = interval < std::chrono::milliseconds(1) ? std::chrono::milliseconds(1) : interval;
  }

  /// Called with the ranks still running (rank, pid) and why they are being
  /// stopped (a failure, the timeout, a stop request) just before they are
  /// terminated: `accel launch` collects their flight records there.
  using BeforeTerminate = std::function<void(const std::vector<std::pair<int, pid_t>>&, const JobOutcome&)>;
  void set_before_terminate(BeforeTerminate hook) {
    before_terminate_ = std::move(hook);
  }

  /// Waits for every rank. `idle(ms)` is called between polls and may block
  /// for up to `ms` (the command line pumps rank output there); `stop` is
  /// polled to learn that the launcher was asked to stop. With
  /// `stop_on_failure` false, the surviving ranks are left to finish (or to
  /// fail on their own) after one fails; the timeout still applies.
  JobOutcome wait(std::optional<std::chrono::milliseconds> timeout, std::chrono::milliseconds grace,
                  const std::function<void(int ms)>& idle = {}, const std::function<bool()>& stop = {},
                  bool stop_on_failure = true) {
    JobOutcome outcome;
    const auto deadline = timeout ? std::optional(Clock::now() + *timeout) : std::nullopt;
    while (!running_.empty()) {
      reap(outcome);
      if (outcome.first_failure && stop_on_failure) break;
      if (running_.empty()) break;
      if (deadline && Clock::now() >= *deadline) {
        outcome.timed_out = true;
        break;
      }
      if (stop && stop()) {
        outcome.interrupted = true;
        break;
      }
      if (idle) idle(static_cast<int>(poll_interval_.count()));
      else std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    terminate_all(grace, outcome, idle);
    return outcome;
  }

 private:
  struct Child {
    int rank;
    pid_t pid;
  };

  static RankExit decode(const Child& child, int status) {
    RankExit exit{child.rank, child.pid, false, 0};
    if (WIFSIGNALED(status)) {
      exit.signaled = true;
      exit.status = WTERMSIG(status);
    } else {
      exit.status = WEXITSTATUS(status);
    }
    return exit;
  }

  // Of the failures one pass finds, a rank killed by a signal is named first:
  // a crash is more likely the cause than a peer's error exit in reply to it.
  void reap(JobOutcome& outcome) {
    const bool had_failure = outcome.first_failure.has_value();
    for (auto it = running_.begin(); it != running_.end();) {
      int status = 0;
      pid_t done = ::waitpid(it->pid, &status, WNOHANG);
      if (done == it->pid) {
        RankExit exit = decode(*it, status);
        outcome.exits.push_back(exit);
        if (!exit.ok() && !had_failure &&
            (!outcome.first_failure || (exit.signaled && !outcome.first_failure->signaled)))
          outcome.first_failure = exit;
        it = running_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // SIGTERM every process group still running, then SIGKILL whatever is left
  // after `grace`; reaps them all so no zombie or orphan remains.
  void terminate_all(std::chrono::milliseconds grace, JobOutcome& outcome, const std::function<void(int)>& idle) {
    if (running_.empty()) return;
    if (before_terminate_) {
      std::vector<std::pair<int, pid_t>> ranks;
      for (const auto& child : running_) ranks.emplace_back(child.rank, child.pid);
      before_terminate_(ranks, outcome);
    }
    for (const auto& child : running_) ::kill(-child.pid, SIGTERM);
    const auto kill_at = Clock::now() + grace;
    while (!running_.empty() && Clock::now() < kill_at) {
      reap_quietly(outcome);
      if (idle) idle(20);
      else std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (const auto& child : running_) ::kill(-child.pid, SIGKILL);
    for (const auto& child : running_) {
      int status = 0;
      ::waitpid(child.pid, &status, 0);
    }
    running_.clear();
  }

  void reap_quietly(JobOutcome& outcome) {
    for (auto it = running_.begin(); it != running_.end();) {
      int status = 0;
      if (::waitpid(it->pid, &status, WNOHANG) == it->pid) {
        if (WIFSIGNALED(status) && WTERMSIG(status) != SIGTERM && WTERMSIG(status) != SIGKILL)
          outcome.crashed_while_stopped.push_back(decode(*it, status));
        ::kill(-it->pid, SIGKILL);  // the leader is gone; anything it left in its group goes too
        it = running_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::vector<Child> running_;
  std::chrono::milliseconds poll_interval_{50};
  BeforeTerminate before_terminate_;
};

/// A TCP port on the loopback interface that was free a moment ago (the
/// kernel picks it); used for a local job's MASTER_PORT.
inline int free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("accel: socket(): ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw std::runtime_error(std::string("accel: could not find a free port: ") + std::strerror(errno));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace accel::launch
