#pragma once
// `accel launch`: starts this machine's ranks of the program with torchrun's
// variables (plus Accelerate's), forwards their output line by line, and
// supervises them: the first rank to fail takes the others down, a timeout
// or a SIGINT/SIGTERM to the launcher ends the job, and nothing is left
// running when `accel launch` returns.

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "accel/launch/supervisor.hpp"
#include "accel/launch/variables.hpp"
#include "cli/flight_records.hpp"
#include "cli/output_pump.hpp"
#include "cli/plan.hpp"
#include "cli/settings.hpp"

extern char** environ;

namespace accel::cli {

/// Exit statuses of `accel launch` besides the failing rank's own (see --help).
inline constexpr int exit_rank_killed = 1;
inline constexpr int exit_usage = 2;
inline constexpr int exit_timeout = 124;  // as coreutils' timeout(1)

namespace detail {

// Set by the launcher's SIGINT/SIGTERM/SIGHUP handler; polled by the supervisor.
inline volatile sig_atomic_t stop_signal = 0;

inline void on_stop_signal(int signal) { stop_signal = signal; }

inline void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;  // no SA_RESTART: poll() returns at once so the job stops promptly
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout must not kill the launcher while ranks run
}

// In the child before exec: ignored signals stay ignored across exec, so undo ours.
inline void restore_default_signals() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
}

/// The program as a path execv() can run: searched in PATH like a shell does.
inline std::string resolve_program(const std::string& program) {
  if (program.find('/') != std::string::npos) {
    if (::access(program.c_str(), X_OK) != 0)
      throw UsageError("cannot run program '" + program + "': " + std::strerror(errno));
    return program;
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path && *path ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  throw UsageError("program '" + program + "' was not found in PATH");
}

/// Whether a TCP port can be bound on every interface right now (rank 0's
/// store will bind it there).
inline bool port_is_free(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // cannot tell; let the job find out
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

/// The environment of one rank: the launcher's own, with `overrides` replacing
/// any variable of the same name.
inline std::vector<std::string> rank_environment(const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::map<std::string, std::string> replaced;
  for (const auto& [name, value] : overrides) replaced[name] = value;
  std::vector<std::string> env;
  for (char** entry = environ; entry && *entry; ++entry) {
    std::string_view text(*entry);
    auto eq = text.find('=');
    if (eq != std::string_view::npos && replaced.count(std::string(text.substr(0, eq)))) continue;
    env.emplace_back(text);
  }
  for (const auto& [name, value] : replaced) env.push_back(name + "=" + value);
  return env;
}

inline std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

inline std::string seconds_text(std::chrono::milliseconds ms) {
  std::ostringstream text;
  text << static_cast<double>(ms.count()) / 1000.0;
  return text.str();
}

}  // namespace detail

namespace detail {

/// How one start of this machine's ranks ended.
struct Attempt {
  launch::JobOutcome outcome;
  std::string start_error;  ///< a rank could not be started (the others were stopped)
  std::vector<std::string> failed_rank_lines;  ///< the failed rank's last lines on stderr
};

/// Starts this machine's ranks once (`restart` counts the starts before this
/// one) and supervises them until they all exit, one fails, `timeout`
/// passes or accel launch is asked to stop.
inline Attempt run_attempt(const JobPlan& plan, const std::string& executable, const std::vector<std::string>& program,
                           int restart, std::optional<std::chrono::milliseconds> timeout,
                           const FlightRecords& records) {
  records.clear();
  std::vector<std::string> args(program);
  std::vector<char*> argv = c_strings(args);
  OutputPump pump;
  launch::ProcessSupervisor supervisor;
  supervisor.set_poll_interval(plan.monitor_interval);
  std::fflush(nullptr);  // buffered output would otherwise be written again by each child

  Attempt attempt;
  std::string& start_error = attempt.start_error;
  for (int local = 0; local < plan.local_processes; ++local) {
    const int rank = plan.first_rank + local;
    auto overrides = plan.job_env;
    overrides.insert(overrides.end(), {
        {"RANK", std::to_string(rank)},
        {"LOCAL_RANK", std::to_string(local)},
        {"WORLD_SIZE", std::to_string(plan.num_processes)},
        {"LOCAL_WORLD_SIZE", std::to_string(plan.local_processes)},
        {"GROUP_RANK", std::to_string(plan.machine_rank)},
        {"GROUP_WORLD_SIZE", std::to_string(plan.num_machines)},
        {"MASTER_ADDR", plan.main_process_ip},
        {"MASTER_PORT", std::to_string(plan.main_process_port)},
        {launch::variables::restart_count, std::to_string(restart)},
        {launch::variables::max_restarts, std::to_string(plan.max_restarts)},
    });
    if (plan.omp_num_threads) overrides.emplace_back("OMP_NUM_THREADS", std::to_string(*plan.omp_num_threads));
    std::vector<std::string> env_strings = rank_environment(overrides);
    std::vector<char*> envp = c_strings(env_strings);

    int out_pipe[2], err_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
      start_error = std::string("pipe(): ") + std::strerror(errno);
      break;
    }
    if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
      start_error = std::string("pipe(): ") + std::strerror(errno);
      ::close(out_pipe[0]);
      ::close(out_pipe[1]);
      break;
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      start_error = std::string("fork(): ") + std::strerror(errno);
      for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
      break;
    }
    if (pid == 0) {
      launch::become_supervised_child();
      restore_default_signals();
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
      ::execve(executable.c_str(), argv.data(), envp.data());
      std::string message = "accel launch: cannot run " + executable + ": " + std::strerror(errno) + "\n";
      ssize_t ignored = ::write(STDERR_FILENO, message.data(), message.size());
      (void)ignored;
      ::_exit(127);
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    pump.add(rank, out_pipe[0], STDOUT_FILENO);
    pump.add(rank, err_pipe[0], STDERR_FILENO);
    supervisor.add(rank, pid);
  }

  const auto grace = std::chrono::seconds(3);
  auto idle = [&](int ms) { pump.pump(ms); };
  auto stop = [&] { return !start_error.empty() || stop_signal != 0; };
  // A rank failed or the job ran out of time: the others' records first (not when asked to stop).
  supervisor.set_before_terminate([&](const std::vector<std::pair<int, pid_t>>& running, const launch::JobOutcome& why) {
    if (stop_signal == 0 && start_error.empty()) records.collect(running, why.first_failure.has_value(), idle, grace);
  });
  attempt.outcome = supervisor.wait(timeout, grace, idle, stop);
  pump.drain(std::chrono::milliseconds(1000));
  if (attempt.outcome.first_failure) attempt.failed_rank_lines = pump.last_error_lines(attempt.outcome.first_failure->rank);
  return attempt;
}

}  // namespace detail

/// Runs this machine's share of the job; returns accel launch's exit status.
///
/// With --max_restarts N, a rank that fails stops every rank of this machine
/// and the job starts again, up to N times (torchrun's meaning): on several
/// machines each launcher restarts its own ranks, which meet again at the
/// same address. The ranks see TORCHELASTIC_RESTART_COUNT; the program
/// resumes from its newest checkpoint (Trainer::load_latest_state).
inline int run_launch(JobPlan plan, const std::vector<std::string>& program) {
  auto say = [&](const std::string& line) {
    if (!plan.quiet) std::fprintf(stderr, "accel launch: %s\n", line.c_str());
  };
  const std::string executable = detail::resolve_program(program.at(0));

  // On one machine nobody else needs to know the port, so a taken default is
  // replaced (torchrun --standalone does the same); a port that was asked for is kept.
  if (!plan.port_given && plan.num_machines == 1 && !detail::port_is_free(plan.main_process_port)) {
    int port = launch::free_loopback_port();
    say("port " + std::to_string(plan.main_process_port) + " is in use; using free port " + std::to_string(port));
    plan.main_process_port = port;
  }
  const int last_rank = plan.first_rank + plan.local_processes - 1;
  say("starting " + std::to_string(plan.local_processes) + " process" + (plan.local_processes == 1 ? "" : "es") +
      " (rank" + (plan.local_processes == 1 ? " " + std::to_string(plan.first_rank)
                                             : "s " + std::to_string(plan.first_rank) + "-" + std::to_string(last_rank)) +
      " of " + std::to_string(plan.num_processes) + ") on machine " + std::to_string(plan.machine_rank) + " of " +
      std::to_string(plan.num_machines) + ", MASTER_ADDR=" + plan.main_process_ip +
      " MASTER_PORT=" + std::to_string(plan.main_process_port));

  detail::install_stop_handlers();
  const FlightRecords records(plan);
  std::vector<int> local_ranks;
  for (int rank = plan.first_rank; rank <= last_rank; ++rank) local_ranks.push_back(rank);
  auto print_records = [&] {
    const std::string summary = records.summary(local_ranks);
    if (summary.empty()) return;
    std::fprintf(stderr, "accel launch: the ranks' last collectives (flight recorder%s):\n%s",
                 records.kept() ? (", records in " + records.directory().string()).c_str() : "", summary.c_str());
  };
  const auto started = std::chrono::steady_clock::now();
  detail::Attempt attempt;
  for (int restart = 0;; ++restart) {
    // --timeout bounds the whole job, restarts included.
    std::optional<std::chrono::milliseconds> left = plan.timeout;
    if (left) {
      left = *left - std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started);
      if (*left <= std::chrono::milliseconds(0)) left = std::chrono::milliseconds(1);
    }
    attempt = detail::run_attempt(plan, executable, program, restart, left, records);
    const auto& outcome = attempt.outcome;
    // The screen explains a hang or a failure in communication: a timeout, a rank killed, or a rank whose
    // collective failed. A rank that exited on an error of its own (a bad flag, a missing file) has its
    // message above; the others' records would only show them waiting for it.
    const auto& failed = outcome.first_failure;
    if (!outcome.interrupted &&
        (outcome.timed_out || (failed && (failed->signaled || records.failed_in_collective(failed->rank)))))
      print_records();
    if (!outcome.first_failure || !attempt.start_error.empty() || outcome.timed_out || outcome.interrupted ||
        restart == plan.max_restarts)
      break;
    // The dead rank 0's store port may linger: on one machine, with no port
    // asked for, the next start takes a fresh one.
    if (!plan.port_given && plan.num_machines == 1) plan.main_process_port = launch::free_loopback_port();
    say(outcome.describe() + "; stopped the other ranks; restarting the job (restart " + std::to_string(restart + 1) +
        " of " + std::to_string(plan.max_restarts) + ", MASTER_PORT=" + std::to_string(plan.main_process_port) + ")");
  }
  const auto& outcome = attempt.outcome;

  if (!attempt.start_error.empty()) {
    std::fprintf(stderr, "accel launch: could not start every rank (%s); terminated the others\n",
                 attempt.start_error.c_str());
    return 1;
  }
  if (outcome.first_failure) {
    const auto& failed = *outcome.first_failure;
    const bool others_were_running = static_cast<int>(outcome.exits.size()) < plan.local_processes;
    std::string last_lines;  // the failed rank's own words, after everyone else's output
    for (const auto& line : attempt.failed_rank_lines) last_lines += "\n  [rank " + std::to_string(failed.rank) + "] " + line;
    std::fprintf(stderr, "accel launch: %s%s%s%s%s\n", outcome.describe().c_str(),
                 others_were_running ? "; terminated the other ranks" : "",
                 plan.max_restarts > 0 ? ("; no restarts left (--max_restarts " + std::to_string(plan.max_restarts) +
                                          ")").c_str()
                                       : "",
                 last_lines.empty() ? "" : "; its last lines on stderr:", last_lines.c_str());
    return failed.signaled ? exit_rank_killed : failed.status;
  }
  if (outcome.timed_out) {
    std::fprintf(stderr, "accel launch: the job did not finish within --timeout %s s; killed all ranks\n",
                 detail::seconds_text(*plan.timeout).c_str());
    return exit_timeout;
  }
  if (outcome.interrupted) {
    const int sig = detail::stop_signal;
    const char* name = ::sigabbrev_np(sig);
    std::fprintf(stderr, "accel launch: interrupted by SIG%s; terminated all ranks\n", name ? name : "?");
    return 128 + sig;
  }
  return 0;
}

}  // namespace accel::cli
