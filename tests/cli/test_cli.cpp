// Tests of the real `accel` binary (path in $ACCEL_EXE): it is run as a child
// process, with rank programs written as `sh -c` scripts, so what is checked
// is exactly what a user sees: variables, output prefixes, exit statuses,
// messages, and that no rank process outlives a failed job.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "../support/doctest.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string accel_exe() {
  const char* exe = std::getenv("ACCEL_EXE");
  REQUIRE_MESSAGE(exe != nullptr, "set ACCEL_EXE to the accel binary (meson test does)");
  return exe;
}

/// A fresh folder per test, removed afterwards; also the HF_HOME the child sees,
/// so a default config on this machine never leaks into a test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "accel-cli-test-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::string hf_home() const { return (path / "hf").string(); }
};

void write_file(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

struct Result {
  bool exited = false;
  int status = -1;  ///< exit status, or the signal number when !exited
  std::string out, err;
  double seconds = 0;
};

std::ostream& operator<<(std::ostream& os, const Result& r) {
  return os << (r.exited ? "exit " : "signal ") << r.status << " after " << r.seconds << " s\n--- stdout\n"
            << r.out << "--- stderr\n"
            << r.err;
}

/// A running `accel` child; `finish` collects its output and status.
struct Running {
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;
  Clock::time_point started;
};

// The command line and environment of an accel child: ours without launcher
// variables that would change what is tested, plus a private HF_HOME.
struct ChildCommand {
  std::vector<std::string> argv_strings, env;
  std::vector<char*> argv, envp;
  ChildCommand(const std::vector<std::string>& args, const std::string& hf_home,
               const std::map<std::string, std::string>& extra_env) {
    for (char** entry = environ; *entry; ++entry) {
      std::string text(*entry);
      std::string name = text.substr(0, text.find('='));
      static const char* dropped[] = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK",      "LOCAL_WORLD_SIZE",
                                      "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "HF_HOME",
                                      "XDG_CACHE_HOME", "GROUP_RANK"};
      bool drop = name.starts_with("ACCELERATE_") || name.starts_with("FSDP_") || extra_env.count(name);
      for (const char* d : dropped) drop = drop || name == d;
      if (!drop) env.push_back(text);
    }
    env.push_back("HF_HOME=" + hf_home);
    for (const auto& [name, value] : extra_env) env.push_back(name + "=" + value);
    argv_strings.push_back(accel_exe());
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    for (auto& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
  }
  ChildCommand(const ChildCommand&) = delete;
};

Running start_accel(const std::vector<std::string>& args, const std::string& hf_home,
                    const std::map<std::string, std::string>& extra_env = {}) {
  ChildCommand command(args, hf_home, extra_env);
  auto& argv = command.argv;
  auto& envp = command.envp;

  int out_pipe[2], err_pipe[2];
  REQUIRE(::pipe2(out_pipe, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(err_pipe, O_CLOEXEC) == 0);
  Running running;
  running.started = Clock::now();
  running.pid = ::fork();
  REQUIRE(running.pid >= 0);
  if (running.pid == 0) {
    const int nothing = ::open("/dev/null", O_RDONLY);  // never the terminal the tests run from
    ::dup2(nothing, 0);
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  running.out_fd = out_pipe[0];
  running.err_fd = err_pipe[0];
  return running;
}

/// Reads until both pipes close, then reaps; a child still running after
/// `limit` is killed and the test fails (nothing here may hang).
Result finish(Running running, std::chrono::seconds limit = std::chrono::seconds(40)) {
  Result result;
  const auto deadline = running.started + limit;
  std::string* sinks[] = {&result.out, &result.err};
  int fds[] = {running.out_fd, running.err_fd};
  bool killed = false;
  while (fds[0] >= 0 || fds[1] >= 0) {
    if (Clock::now() >= deadline && !killed) {
      ::kill(running.pid, SIGKILL);
      killed = true;
      break;
    }
    pollfd pfds[2];
    int n = 0;
    int which[2];
    for (int i = 0; i < 2; ++i)
      if (fds[i] >= 0) {
        pfds[n] = {fds[i], POLLIN, 0};
        which[n++] = i;
      }
    if (::poll(pfds, n, 100) <= 0) continue;
    for (int k = 0; k < n; ++k) {
      if (!(pfds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buffer[4096];
      ssize_t got = ::read(fds[which[k]], buffer, sizeof buffer);
      if (got > 0) {
        sinks[which[k]]->append(buffer, static_cast<std::size_t>(got));
      } else if (got == 0 || errno != EINTR) {
        ::close(fds[which[k]]);
        fds[which[k]] = -1;
      }
    }
  }
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
  int status = 0;
  ::waitpid(running.pid, &status, 0);
  result.seconds = std::chrono::duration<double>(Clock::now() - running.started).count();
  result.exited = WIFEXITED(status);
  result.status = result.exited ? WEXITSTATUS(status) : WTERMSIG(status);
  CHECK_MESSAGE(!killed, "accel did not finish within " << limit.count() << " s:\n" << result);
  return result;
}

Result run_accel(const std::vector<std::string>& args, const TempDir& dir,
                 const std::map<std::string, std::string>& extra_env = {}) {
  return finish(start_accel(args, dir.hf_home(), extra_env));
}

/// One prompt of an interactive command and the line typed in answer.
struct Exchange {
  std::string prompt, answer;
};

/// Runs accel on a pseudo-terminal (its stdin, stdout and stderr, as a user's
/// shell would give it), typing each answer once its prompt has appeared.
/// Everything the terminal showed, the typed answers echoed, ends up in `out`.
Result run_in_terminal(const std::vector<std::string>& args, const TempDir& dir, const std::vector<Exchange>& script,
                       std::chrono::seconds limit = std::chrono::seconds(20)) {
  ChildCommand command(args, dir.hf_home(), {});
  int terminal = -1;
  const auto started = Clock::now();
  const pid_t pid = ::forkpty(&terminal, nullptr, nullptr, nullptr);
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::execve(command.argv[0], command.argv.data(), command.envp.data());
    ::_exit(127);
  }
  Result result;
  std::size_t next = 0, searched_from = 0;
  bool killed = false;
  while (true) {
    if (Clock::now() >= started + limit) {
      ::kill(pid, SIGKILL);
      killed = true;
      break;
    }
    if (next < script.size()) {
      const auto at = result.out.find(script[next].prompt, searched_from);
      if (at != std::string::npos) {
        searched_from = at + script[next].prompt.size();
        const std::string line = script[next].answer + "\n";
        REQUIRE(::write(terminal, line.data(), line.size()) == static_cast<ssize_t>(line.size()));
        ++next;
        continue;
      }
    }
    pollfd pfd{terminal, POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    char buffer[4096];
    const ssize_t got = ::read(terminal, buffer, sizeof buffer);
    if (got > 0) result.out.append(buffer, static_cast<std::size_t>(got));
    else if (got < 0 && errno == EINTR) continue;
    else break;  // EIO: the child has closed the terminal
  }
  ::close(terminal);
  int status = 0;
  ::waitpid(pid, &status, 0);
  result.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  result.exited = WIFEXITED(status);
  result.status = result.exited ? WEXITSTATUS(status) : WTERMSIG(status);
  CHECK_MESSAGE(!killed, "accel did not finish within " << limit.count() << " s:\n" << result);
  CHECK_MESSAGE(next == script.size(), "never asked: '" << (next < script.size() ? script[next].prompt : "") << "'\n"
                                                           << result);
  return result;
}

/// `accel launch <flags> sh -c <script>`, always bounded by --timeout.
Result launch_sh(std::vector<std::string> flags, const std::string& script, const TempDir& dir,
                 const std::map<std::string, std::string>& extra_env = {}) {
  std::vector<std::string> args{"launch", "--timeout", "30"};
  args.insert(args.end(), flags.begin(), flags.end());
  args.insert(args.end(), {"sh", "-c", script});
  return run_accel(args, dir, extra_env);
}

/// Whether a process is gone: no such pid (ESRCH), or a zombie its new parent
/// has not reaped yet (already dead; the container's init may be slow to reap).
bool process_gone(pid_t pid) {
  for (int i = 0; i < 60; ++i) {
    if (::kill(pid, 0) == -1 && errno == ESRCH) return true;
    std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
    auto close_paren = stat.rfind(')');
    if (close_paren != std::string::npos && close_paren + 2 < stat.size() && stat[close_paren + 2] == 'Z') return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

pid_t read_pid(const std::string& path) {
  std::string text = read_file(path);
  return text.empty() ? -1 : static_cast<pid_t>(std::stol(text));
}

/// Every line of `text` starts with one of the rank prefixes (or, for
/// stderr, is one of accel's own "accel launch:" lines).
bool every_line_prefixed(const std::string& text, bool allow_launcher_lines) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.starts_with("[rank ")) continue;
    if (allow_launcher_lines && line.starts_with("accel launch: ")) continue;
    return false;
  }
  return true;
}

const char* const print_env =
    "echo \"R=$RANK W=$WORLD_SIZE LR=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE A=$MASTER_ADDR P=$MASTER_PORT "
    "T=$OMP_NUM_THREADS MP=$ACCELERATE_MIXED_PRECISION G=$GROUP_RANK GA=$ACCELERATE_GRADIENT_ACCUMULATION_STEPS\"";

}  // namespace

TEST_CASE("launch: two ranks get torchrun's and Accelerate's variables, output is prefixed") {
  TempDir dir;
  auto r = launch_sh({"--num_processes", "2", "--main_process_port=29517", "--mixed_precision", "bf16"},
                     std::string(print_env) + "; echo \"to stderr $RANK\" >&2", dir);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "[rank 0] R=0 W=2 LR=0 LW=2 A=127.0.0.1 P=29517 T=1 MP=bf16 G=0 GA=\n"));
  CHECK(contains(r.out, "[rank 1] R=1 W=2 LR=1 LW=2 A=127.0.0.1 P=29517 T=1 MP=bf16 G=0 GA=\n"));
  CHECK(contains(r.err, "[rank 0] to stderr 0\n"));
  CHECK(contains(r.err, "[rank 1] to stderr 1\n"));
  CHECK(every_line_prefixed(r.out, false));
  CHECK(every_line_prefixed(r.err, true));
  CHECK(contains(r.err, "accel launch: starting 2 processes"));
}

TEST_CASE("launch: defaults, thread count, accumulation steps, program arguments") {
  TempDir dir;
  SUBCASE("one process: no mixed precision is exported unless asked for, OMP_NUM_THREADS is inherited") {
    auto r = launch_sh({}, print_env, dir, {{"OMP_NUM_THREADS", "7"}});
    INFO(r);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "[rank 0] R=0 W=1 LR=0 LW=1 A=127.0.0.1 P="));
    CHECK(contains(r.out, " T=7 MP= G=0 GA=\n"));  // the program's compiled precision wins, as in Accelerate
  }
  SUBCASE("--num_cpu_threads_per_process and --gradient_accumulation_steps") {
    auto r = launch_sh({"--num_processes=2", "--num_cpu_threads_per_process", "3", "--gradient_accumulation_steps",
                        "4", "--mixed_precision=fp16"},
                       print_env, dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "[rank 1] R=1 W=2 LR=1 LW=2 A=127.0.0.1 P="));
    CHECK(contains(r.out, " T=3 MP=fp16 G=0 GA=4\n"));
  }
  SUBCASE("everything after the program is the program's, even flag-like words") {
    auto r = run_accel({"launch", "--timeout", "30", "-q", "sh", "-c", "echo \"args=$*\"", "sh", "--num_processes",
                        "7", "--bogus"},
                       dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(r.out == "[rank 0] args=--num_processes 7 --bogus\n");
    CHECK(r.err.empty());  // -q: no launcher messages on success
  }
  SUBCASE("a last line without a newline is still forwarded") {
    auto r = launch_sh({"-q"}, "printf 'no newline'", dir);
    CHECK(r.out == "[rank 0] no newline\n");
  }
}

TEST_CASE("launch: multi-machine arithmetic (num_processes is the total, as in Accelerate)") {
  TempDir dir;
  auto r = launch_sh({"--num_processes", "4", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip",
                      "10.1.2.3", "--main_process_port", "29600"},
                     print_env, dir);
  INFO(r);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "[rank 2] R=2 W=4 LR=0 LW=2 A=10.1.2.3 P=29600 T=1 MP= G=1 GA=\n"));
  CHECK(contains(r.out, "[rank 3] R=3 W=4 LR=1 LW=2 A=10.1.2.3 P=29600 T=1 MP= G=1 GA=\n"));
  CHECK_FALSE(contains(r.out, "[rank 0]"));
  CHECK_FALSE(contains(r.out, "[rank 1]"));
}

TEST_CASE("launch: a failing rank takes the job down and nothing is left running") {
  TempDir dir;
  const std::string pid_file = dir.file("sleeper.pid");
  const std::string child_file = dir.file("sleeper-child.pid");
  // Rank 0 records its pid and its child's, then sleeps; rank 1 waits for that and exits 3.
  const std::string script =
      "if [ \"$RANK\" = 0 ]; then sleep 60 & echo $! > " + child_file + "; echo $$ > " + pid_file +
      "; wait; else while [ ! -s " + pid_file + " ]; do sleep 0.05; done; echo failing; exit 3; fi";
  auto r = launch_sh({"--num_processes", "2"}, script, dir);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 3);  // the failing rank's own status
  CHECK(r.seconds < 10);
  CHECK(contains(r.out, "[rank 1] failing\n"));
  CHECK(contains(r.err, "accel launch: rank 1 (pid "));
  CHECK(contains(r.err, ") exited with status 3; terminated the other ranks\n"));
  const pid_t sleeper = read_pid(pid_file);
  const pid_t sleeper_child = read_pid(child_file);
  REQUIRE(sleeper > 0);
  REQUIRE(sleeper_child > 0);
  errno = 0;
  CHECK(::kill(sleeper, 0) == -1);
  CHECK(errno == ESRCH);  // reaped by the launcher, not even a zombie
  CHECK(process_gone(sleeper_child));
}

TEST_CASE("launch: the failed rank's last lines on stderr close the report, after the other ranks' output") {
  TempDir dir;
  const std::string script =
      "if [ \"$RANK\" = 1 ]; then echo 'loading data' >&2; echo 'error: data.bin is missing' >&2; exit 1; "
      "else sleep 30; fi";
  auto r = launch_sh({"--num_processes", "2"}, script, dir);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 1);
  CHECK(contains(r.err, "exited with status 1; terminated the other ranks; its last lines on stderr:\n"
                        "  [rank 1] loading data\n  [rank 1] error: data.bin is missing\n"));
  CHECK(!contains(r.err, "flight recorder"));  // an error of its own, not a collective's
}

TEST_CASE("launch: --max_restarts starts the whole job again after a rank fails, then gives up naming it") {
  TempDir dir;
  // Rank 1 fails in the first two starts; each start sees its restart count (torchrun's variables).
  // It fails 0.3 s after its line, so that rank 0 has written its own before the launcher stops it
  // (failing at once, rank 0 was once stopped before its echo ran).
  const std::string script =
      "echo \"start $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS port $MASTER_PORT\"; "
      "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then sleep 0.3; exit 3; fi; sleep 0.6";
  auto r = launch_sh({"--num_processes", "2", "--max_restarts", "2"}, script, dir);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 0);
  for (int restart : {0, 1, 2})
    for (int rank : {0, 1})
      CHECK(contains(r.out, "[rank " + std::to_string(rank) + "] start " + std::to_string(restart) + " of 2 port "));
  CHECK(contains(r.err, "rank 1 (pid "));
  CHECK(contains(r.err, ") exited with status 3; stopped the other ranks; restarting the job (restart 1 of 2, "));
  CHECK(contains(r.err, "restarting the job (restart 2 of 2, "));

  auto out = launch_sh({"--num_processes", "2", "--max_restarts", "1"}, script, dir);
  INFO(out);
  REQUIRE(out.exited);
  CHECK(out.status == 3);
  CHECK(contains(out.err, "restarting the job (restart 1 of 1, "));
  CHECK(contains(out.err, ") exited with status 3; terminated the other ranks; no restarts left (--max_restarts 1)"));
  CHECK_FALSE(contains(out.out, "start 2 of 1"));
}

TEST_CASE("launch: a rank that ignores SIGTERM is killed after the grace period") {
  TempDir dir;
  const std::string pid_file = dir.file("stubborn.pid");
  const std::string script = "if [ \"$RANK\" = 0 ]; then trap '' TERM; echo $$ > " + pid_file +
                             "; while :; do sleep 0.1; done; else while [ ! -s " + pid_file +
                             " ]; do sleep 0.05; done; exit 5; fi";
  auto r = launch_sh({"--num_processes", "2"}, script, dir);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 5);
  CHECK(r.seconds < 10);
  CHECK(contains(r.err, "accel launch: rank 1 (pid "));
  const pid_t stubborn = read_pid(pid_file);
  REQUIRE(stubborn > 0);
  errno = 0;
  CHECK(::kill(stubborn, 0) == -1);
  CHECK(errno == ESRCH);
}

TEST_CASE("launch: a rank killed by a signal is named with the signal") {
  TempDir dir;
  auto r = launch_sh({"--num_processes", "2"}, "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; sleep 60", dir);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 1);
  CHECK(r.seconds < 10);
  CHECK(contains(r.err, "accel launch: rank 1 (pid "));
  CHECK(contains(r.err, "was killed by signal 9 (Killed); terminated the other ranks"));
}

// The flight_recorder job test once missed "rank 0: failed in" under load:
// the launcher asked rank 0 for its record the moment rank 1 died, rank 0
// answered before its own collective with rank 1 had failed, and was stopped
// before it wrote the record that names the failure. Here rank 0 is an
// accel-like rank: it answers SIGUSR1 with a record of a completed collective,
// and one second after its peer dies it writes its own record, naming the
// collective that failed, and exits 1, as a rank's failed all-reduce does.
TEST_CASE("launch: after a rank dies, the survivors' own records of the failure are awaited before they are asked") {
  TempDir dir;
  auto record = [](const char* state) {
    return nlohmann::json{{"rank", 0}, {"pid", 1}, {"written_s", 2.0},
                          {"entries", {{{"group", "world"}, {"sequence", 7}, {"point_to_point", false},
                                        {"op", "allreduce"}, {"what", "gradient bucket 0"}, {"bytes", 64},
                                        {"issued_s", 1.0}, {"ended_s", 1.5}, {"state", state}}}}}
        .dump();
  };
  write_file(dir.file("completed.json"), record("completed"));
  write_file(dir.file("failed.json"), record("failed"));
  // A record goes into place by rename, as FlightRecorder::dump writes it.
  const std::string put = "cp " + dir.file("%s.json") + " \"$ACCEL_FLIGHT_RECORDER_DIR/tmp\" && mv \"$ACCEL_FLIGHT_RECORDER_DIR/tmp\" \"$ACCEL_FLIGHT_RECORDER_DIR/rank_0.json\"";
  auto put_record = [&](const std::string& which) {
    std::string command = put;
    command.replace(command.find("%s"), 2, which);
    return command;
  };
  const std::string script =
      "if [ \"$RANK\" = 0 ]; then trap '" + put_record("completed") + "' USR1; touch " + dir.file("ready") +
      "; sleep 1 & while ! wait $!; do :; done; " + put_record("failed") + "; exit 1; fi; "
      "while [ ! -e " + dir.file("ready") + " ]; do sleep 0.05; done; kill -9 $$";
  auto r = launch_sh({"--num_processes", "2"}, script, dir);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 1);
  CHECK(contains(r.err, "was killed by signal 9 (Killed)"));
  CHECK(contains(r.err, "rank 0: failed in allreduce #7 (gradient bucket 0)"));
  CHECK(contains(r.err, "no record from rank 1"));
}

TEST_CASE("launch: --timeout kills a job that does not finish") {
  TempDir dir;
  auto r = run_accel({"launch", "--timeout", "0.5", "--num_processes", "2", "sh", "-c", "sleep 60"}, dir);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 124);
  CHECK(r.seconds < 10);
  CHECK(contains(r.err, "did not finish within --timeout 0.5 s"));
}

TEST_CASE("launch: SIGTERM to the launcher terminates every rank") {
  TempDir dir;
  const std::string pids = dir.file("pids");
  auto running = start_accel({"launch", "--timeout", "30", "--num_processes", "2", "sh", "-c",
                              "echo $$ >> " + pids + "; sleep 60"},
                             dir.hf_home());
  // Both ranks have written their pid once the file has two lines.
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  auto lines = [&] {
    std::string text = read_file(pids);
    return std::count(text.begin(), text.end(), '\n');
  };
  while (lines() < 2 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(lines() == 2);
  ::kill(running.pid, SIGTERM);
  auto r = finish(running);
  INFO(r);
  REQUIRE(r.exited);
  CHECK(r.status == 128 + SIGTERM);
  CHECK(r.seconds < 15);
  CHECK(contains(r.err, "interrupted by SIGTERM; terminated all ranks"));
  std::istringstream in(read_file(pids));
  for (std::string line; std::getline(in, line);) CHECK(process_gone(static_cast<pid_t>(std::stol(line))));
}

TEST_CASE("launch: config file values, flag overrides, nested sections") {
  TempDir dir;
  const std::string config = dir.file("cfg.json");
  write_file(config, R"({
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "mixed_precision": "fp16",
    "use_cpu": true, "debug": false, "num_processes": 2, "num_machines": 1, "machine_rank": 0,
    "main_process_ip": null, "main_process_port": 29611, "rdzv_backend": "static", "same_network": true,
    "gpu_ids": "all", "enable_cpu_affinity": false, "downcast_bf16": "no",
    "deepspeed_config": {"gradient_accumulation_steps": 8}, "fsdp_config": {}, "megatron_lm_config": {}
  })");
  SUBCASE("values come through") {
    auto r = launch_sh({"--config_file", config},
                       std::string(print_env) + "; echo \"CPU=$ACCELERATE_USE_CPU FROM=$ACCEL_MIXED_PRECISION_FROM\"", dir);
    INFO(r);
    CHECK(r.status == 0);
    // Where mixed_precision came from travels with it, so a rank compiled otherwise can say what to change.
    CHECK(contains(r.out, "[rank 1] CPU=true FROM=config file " + config + "\n"));
    CHECK(contains(r.out, "[rank 0] R=0 W=2 LR=0 LW=2 A=127.0.0.1 P=29611 T=1 MP=fp16 G=0 GA=8\n"));
    CHECK(contains(r.out, "[rank 1] R=1 W=2 LR=1 LW=2 A=127.0.0.1 P=29611 T=1 MP=fp16 G=0 GA=8\n"));
  }
  SUBCASE("flags override the file") {
    auto r = launch_sh({"--config_file=" + config, "--mixed_precision", "no", "--num_processes", "1",
                        "--main_process_port", "29612"},
                       std::string(print_env) + "; echo \"FROM=$ACCEL_MIXED_PRECISION_FROM\"", dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "[rank 0] R=0 W=1 LR=0 LW=1 A=127.0.0.1 P=29612 T= MP=no G=0 GA=8\n"));
    CHECK(contains(r.out, "[rank 0] FROM=--mixed_precision\n"));
    CHECK_FALSE(contains(r.out, "[rank 1]"));
  }
  SUBCASE("the default config under $HF_HOME is used when no --config_file is given") {
    write_file(dir.hf_home() + "/accelerate/default_config.json", read_file(config));
    auto r = launch_sh({}, print_env, dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "[rank 1] R=1 W=2 LR=1 LW=2 A=127.0.0.1 P=29611 T=1 MP=fp16 G=0 GA=8\n"));
  }
  SUBCASE("fsdp_config is forwarded as Accelerate's variables") {
    const std::string fsdp = dir.file("fsdp.json");
    write_file(fsdp, R"({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD",
                        "fsdp_offload_params": false, "fsdp_min_num_params": 100000}})");
    auto r = launch_sh({"--config_file", fsdp, "-q"},
                       "echo \"$ACCELERATE_USE_FSDP $FSDP_SHARDING_STRATEGY $FSDP_OFFLOAD_PARAMS $FSDP_MIN_NUM_PARAMS\"",
                       dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(r.out == "[rank 0] true FULL_SHARD false 100000\n");
  }
  SUBCASE("--fsdp_* flags set the same variables and override the config file") {
    const std::string fsdp = dir.file("fsdp.json");
    write_file(fsdp, R"({"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": false}})");
    auto r = launch_sh({"--config_file", fsdp, "--use_fsdp", "--fsdp_offload_params", "true", "--fsdp_auto_wrap_policy",
                        "SIZE_BASED_WRAP", "--fsdp_min_num_params", "1000", "--fsdp_state_dict_type",
                        "SHARDED_STATE_DICT", "--fsdp_activation_checkpointing", "true", "-q"},
                       "echo \"$ACCELERATE_USE_FSDP $FSDP_OFFLOAD_PARAMS $FSDP_AUTO_WRAP_POLICY $FSDP_MIN_NUM_PARAMS "
                       "$FSDP_STATE_DICT_TYPE $FSDP_ACTIVATION_CHECKPOINTING\"",
                       dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(r.out == "[rank 0] true true SIZE_BASED_WRAP 1000 SHARDED_STATE_DICT true\n");
    auto local = launch_sh({"--fsdp_state_dict_type", "LOCAL_STATE_DICT"}, "echo SHOULD-NOT-RUN", dir);
    INFO(local);
    CHECK(local.status == 2);
    CHECK(contains(local.err, "--fsdp_state_dict_type must be one of FULL_STATE_DICT, SHARDED_STATE_DICT"));
    auto bad = launch_sh({"--fsdp_auto_wrap_policy", "BY_SIZE"}, "echo SHOULD-NOT-RUN", dir);
    INFO(bad);
    CHECK(bad.status == 2);
    CHECK(contains(bad.err, "--fsdp_auto_wrap_policy must be one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP"));
  }
  SUBCASE("FSDP2: --fsdp_version 2 and --fsdp_reshard_after_forward, as flags and as config keys") {
    auto r = launch_sh({"--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "false", "-q"},
                       "echo \"$FSDP_VERSION $FSDP_RESHARD_AFTER_FORWARD\"", dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(r.out == "[rank 0] 2 false\n");
    const std::string fsdp2 = dir.file("fsdp2.json");
    write_file(fsdp2, R"({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2,
                         "fsdp_reshard_after_forward": true}})");
    auto from_file = launch_sh({"--config_file", fsdp2, "-q"}, "echo \"$FSDP_VERSION $FSDP_RESHARD_AFTER_FORWARD\"", dir);
    INFO(from_file);
    CHECK(from_file.status == 0);
    CHECK(from_file.out == "[rank 0] 2 true\n");
    auto bad = launch_sh({"--fsdp_version", "3"}, "echo SHOULD-NOT-RUN", dir);
    INFO(bad);
    CHECK(bad.status == 2);
    CHECK(contains(bad.err, "--fsdp_version must be one of 1, 2"));
  }
}

TEST_CASE("launch: bad config files are rejected, naming the key and the file") {
  TempDir dir;
  auto rejected = [&](const std::string& name, const std::string& text, std::vector<std::string> must_mention) {
    const std::string path = dir.file(name);
    write_file(path, text);
    auto r = launch_sh({"--config_file", path}, "echo SHOULD-NOT-RUN", dir);
    INFO(r);
    CHECK(r.exited);
    CHECK(r.status == 2);
    CHECK(r.out.empty());
    CHECK(r.err.starts_with("accel launch: "));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);  // one line
    must_mention.push_back(path);
    for (const auto& word : must_mention) CHECK_MESSAGE(contains(r.err, word), "missing '" << word << "'");
  };
  SUBCASE("unknown key") { rejected("unknown.json", R"({"num_processes": 2, "num_procs": 2})", {"'num_procs'"}); }
  SUBCASE("unknown nested key") {
    rejected("nested.json", R"({"fsdp_config": {"sharding": "FULL_SHARD"}})", {"'fsdp_config.sharding'"});
  }
  SUBCASE("wrong type") {
    rejected("type.json", R"({"num_processes": "two"})", {"'num_processes'", "an integer", "\"two\""});
  }
  SUBCASE("wrong type of a boolean") { rejected("bool.json", R"({"use_cpu": "yes"})", {"'use_cpu'", "boolean"}); }
  SUBCASE("not JSON") { rejected("broken.json", "{\"num_processes\": ", {"not valid JSON"}); }
  SUBCASE("YAML, with a conversion hint") {
    rejected("default_config.yaml", "num_processes: 2\n", {"YAML", "JSON config files", "json.dump", "default_config.json"});
  }
  SUBCASE("values the file gives are checked like flags") {
    rejected("div.json", R"({"num_processes": 3, "num_machines": 2})", {"num_processes 3", "num_machines 2"});
  }
  SUBCASE("a missing file") {
    auto r = launch_sh({"--config_file", dir.file("absent.json")}, "true", dir);
    CHECK(r.status == 2);
    CHECK(contains(r.err, "absent.json does not exist"));
  }
}

TEST_CASE("launch: bad flags exit 2 with one line naming the flag") {
  TempDir dir;
  auto bad = [&](std::vector<std::string> args, std::vector<std::string> must_mention) {
    args.insert(args.begin(), "launch");
    auto r = run_accel(args, dir);
    INFO(r);
    CHECK(r.exited);
    CHECK(r.status == 2);
    CHECK(r.out.empty());
    CHECK(r.err.starts_with("accel launch: "));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    for (const auto& word : must_mention) CHECK_MESSAGE(contains(r.err, word), "missing '" << word << "'");
  };
  bad({"--bogus", "sh", "-c", "true"}, {"unknown flag --bogus"});
  bad({"--num_processes"}, {"--num_processes needs a value"});
  bad({"--num_processes", "--cpu", "sh"}, {"--num_processes needs a value"});
  bad({"--num_processes=", "sh"}, {"--num_processes needs a value"});
  bad({"--num_processes", "x", "sh"}, {"--num_processes expects an integer", "'x'"});
  bad({"--num_processes", "2.5", "sh"}, {"--num_processes expects an integer", "'2.5'"});
  bad({"--timeout", "soon", "sh"}, {"--timeout expects a number of seconds"});
  bad({"--max_restarts", "-1", "sh"}, {"--max_restarts -1 must be 0 or more"});
  bad({"--num_processes", "3", "--num_machines", "2", "sh"}, {"--num_processes 3", "not divisible", "--num_machines 2"});
  bad({"--num_processes", "0", "sh"}, {"--num_processes 0 must be at least 1"});
  bad({"--num_processes", "4", "--num_machines", "2", "--machine_rank", "2", "sh"},
      {"--machine_rank 2 must be below --num_machines 2"});
  bad({"--main_process_port", "70000", "sh"}, {"--main_process_port 70000"});
  bad({"--mixed_precision", "fp8", "sh"}, {"--mixed_precision fp8", "no, fp16, bf16"});
  bad({"--cpu=yes", "sh"}, {"--cpu takes no value"});
  bad({"--timeout", "0", "sh"}, {"--timeout 0"});
  bad({"--num_processes", "2"}, {"no program given"});
  bad({"no-such-program-accel-test"}, {"'no-such-program-accel-test' was not found in PATH"});
}

TEST_CASE("config: writes a file that launch reads back") {
  TempDir dir;
  SUBCASE("--config_file") {
    const std::string path = dir.file("sub/written.json");
    auto w = run_accel({"config", "--config_file", path, "--num_processes", "2", "--mixed_precision", "bf16",
                        "--main_process_port", "29620", "--gradient_accumulation_steps", "2"},
                       dir);
    INFO(w);
    CHECK(w.status == 0);
    CHECK(contains(w.out, "wrote " + path));
    auto json = nlohmann::json::parse(read_file(path));
    CHECK(json["num_processes"] == 2);
    CHECK(json["mixed_precision"] == "bf16");
    CHECK(json["compute_environment"] == "LOCAL_MACHINE");
    CHECK(json["num_machines"] == 1);
    auto r = launch_sh({"--config_file", path}, print_env, dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "[rank 1] R=1 W=2 LR=1 LW=2 A=127.0.0.1 P=29620 T=1 MP=bf16 G=0 GA=2\n"));
  }
  SUBCASE("accel config default writes the default path once and launch uses it") {
    auto w = run_accel({"config", "default", "--mixed_precision", "fp16"}, dir);
    INFO(w);
    CHECK(w.status == 0);
    const std::string path = dir.hf_home() + "/accelerate/default_config.json";
    CHECK(contains(w.out, path));
    auto again = run_accel({"config", "default"}, dir);
    CHECK(again.status == 1);
    CHECK(contains(again.err, "already exists"));
    auto r = launch_sh({"-q"}, print_env, dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "[rank 0] R=0 W=1 LR=0 LW=1 A=127.0.0.1 P="));
    CHECK(contains(r.out, " MP=fp16 "));
  }
  SUBCASE("config refuses what launch would refuse") {
    auto r = run_accel({"config", "--config_file", dir.file("x.json"), "--num_processes", "3", "--num_machines", "2"},
                       dir);
    CHECK(r.status == 2);
    CHECK(contains(r.err, "accel config: --num_processes 3 is not divisible by --num_machines 2"));
    CHECK_FALSE(fs::exists(dir.file("x.json")));
    auto t = run_accel({"config", "--config_file", dir.file("x.json"), "--timeout", "3"}, dir);
    CHECK(t.status == 2);
    CHECK(contains(t.err, "--timeout is a launch-only flag"));
  }
}

TEST_CASE("config on a terminal: Accelerate's questions, answers checked, the same JSON as the flags") {
  TempDir dir;
  SUBCASE("multi-CPU with FSDP: every answer lands in the file, and equals what the flags write") {
    const std::string asked = dir.file("asked.json"), flagged = dir.file("flagged.json");
    auto r = run_in_terminal({"config", "--config_file", asked}, dir,
                             {{"Which type of machine are you using?", "multi-CPU"},
                              {"How many different machines", ""},
                              {"Should distributed operations be checked", "yes"},
                              {"Do you want to use FullyShardedDataParallel", "y"},
                              {"What should be your FSDP version?", "1"},
                              {"What should be your sharding strategy?", "1"},
                              {"offload parameters and gradients to CPU?", "maybe"},
                              {"Please enter yes or no.", "no"},
                              {"How many CPU processes in total", "seven"},
                              {"Please enter a whole number from 1 up.", "3"},
                              {"Do you wish to use mixed precision?", "bf16"},
                              {"How many gradient accumulation steps?", "2"}});
    INFO(r);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "[0] No distributed training"));  // the options are listed with their numbers
    CHECK(contains(r.out, "accel config: wrote " + asked));
    const auto json = nlohmann::json::parse(read_file(asked));
    CHECK(json["distributed_type"] == "FSDP");
    CHECK(json["fsdp_config"]["fsdp_sharding_strategy"] == "SHARD_GRAD_OP");
    CHECK(json["fsdp_config"]["fsdp_offload_params"] == false);
    CHECK(json["num_processes"] == 3);
    CHECK(json["use_cpu"] == true);
    CHECK(json["debug"] == true);
    CHECK(json["mixed_precision"] == "bf16");
    CHECK(json["gradient_accumulation_steps"] == 2);
    auto w = run_accel({"config", "--config_file", flagged, "--use_fsdp", "--fsdp_version", "1", "--fsdp_sharding_strategy", "SHARD_GRAD_OP",
                        "--fsdp_offload_params", "false", "--cpu", "--num_processes", "3", "--debug",
                        "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2", "--num_machines", "1"},
                       dir);
    CHECK(w.status == 0);
    CHECK(json == nlohmann::json::parse(read_file(flagged)));
  }
  SUBCASE("FULL_SHARD: the wrap policy and the state dict type asked, the same file as the flags write") {
    const std::string asked = dir.file("full.json"), flagged = dir.file("full_flags.json");
    auto r = run_in_terminal({"config", "--config_file", asked}, dir,
                             {{"Which type of machine are you using?", "multi-CPU"},
                              {"How many different machines", ""},
                              {"Should distributed operations be checked", "no"},
                              {"Do you want to use FullyShardedDataParallel", "y"},
                              {"What should be your FSDP version?", "1"},
                              {"What should be your sharding strategy?", "FULL_SHARD"},
                              {"offload parameters and gradients to CPU?", "no"},
                              {"What should be your auto wrap policy?", "NO_WRAP"},
                              {"What should be your FSDP's state dict type?", "SHARDED_STATE_DICT"},
                              {"How many CPU processes in total", "2"},
                              {"Do you wish to use mixed precision?", "no"},
                              {"How many gradient accumulation steps?", "1"}});
    INFO(r);
    CHECK(r.status == 0);
    const auto json = nlohmann::json::parse(read_file(asked));
    CHECK(json["fsdp_config"]["fsdp_state_dict_type"] == "SHARDED_STATE_DICT");
    auto w = run_accel({"config", "--config_file", flagged, "--use_fsdp", "--fsdp_version", "1", "--fsdp_sharding_strategy", "FULL_SHARD",
                        "--fsdp_offload_params", "false", "--fsdp_auto_wrap_policy", "NO_WRAP",
                        "--fsdp_state_dict_type", "SHARDED_STATE_DICT", "--cpu", "--num_processes", "2",
                        "--mixed_precision", "no", "--gradient_accumulation_steps", "1", "--num_machines", "1"},
                       dir);
    CHECK(w.status == 0);
    CHECK(json == nlohmann::json::parse(read_file(flagged)));
  }
  SUBCASE("TRANSFORMER_BASED_WRAP: the classes and activation checkpointing asked, the same file as the flags write") {
    const std::string asked = dir.file("blocks.json"), flagged = dir.file("blocks_flags.json");
    auto r = run_in_terminal({"config", "--config_file", asked}, dir,
                             {{"Which type of machine are you using?", "multi-CPU"},
                              {"How many different machines", ""},
                              {"Should distributed operations be checked", "no"},
                              {"Do you want to use FullyShardedDataParallel", "y"},
                              {"What should be your FSDP version?", "1"},
                              {"What should be your sharding strategy?", "HYBRID_SHARD"},
                              {"offload parameters and gradients to CPU?", "no"},
                              {"What should be your auto wrap policy?", "TRANSFORMER_BASED_WRAP"},
                              {"comma-separated list of module class names", "BlockImpl"},
                              {"What should be your FSDP's state dict type?", "FULL_STATE_DICT"},
                              {"Do you want to enable FSDP activation checkpointing?", "yes"},
                              {"How many CPU processes in total", "4"},
                              {"Do you wish to use mixed precision?", "no"},
                              {"How many gradient accumulation steps?", "1"}});
    INFO(r);
    CHECK(r.status == 0);
    const auto json = nlohmann::json::parse(read_file(asked));
    CHECK(json["fsdp_config"]["fsdp_activation_checkpointing"] == true);
    CHECK(json["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "BlockImpl");
    auto w = run_accel({"config", "--config_file", flagged, "--use_fsdp", "--fsdp_version", "1", "--fsdp_sharding_strategy", "HYBRID_SHARD",
                        "--fsdp_offload_params", "false", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                        "--fsdp_transformer_layer_cls_to_wrap", "BlockImpl", "--fsdp_state_dict_type",
                        "FULL_STATE_DICT", "--fsdp_activation_checkpointing", "true", "--cpu", "--num_processes", "4",
                        "--mixed_precision", "no", "--gradient_accumulation_steps", "1", "--num_machines", "1"},
                       dir);
    CHECK(w.status == 0);
    CHECK(json == nlohmann::json::parse(read_file(flagged)));
  }
  SUBCASE("FSDP2 (Accelerate's default version): resharding after forward asked instead of a strategy") {
    const std::string asked = dir.file("v2.json"), flagged = dir.file("v2_flags.json");
    auto r = run_in_terminal({"config", "--config_file", asked}, dir,
                             {{"Which type of machine are you using?", "multi-CPU"},
                              {"How many different machines", ""},
                              {"Should distributed operations be checked", "no"},
                              {"Do you want to use FullyShardedDataParallel", "y"},
                              {"What should be your FSDP version?", ""},
                              {"Do you want to enable resharding after forward?", "no"},
                              {"offload parameters and gradients to CPU?", "no"},
                              {"How many CPU processes in total", "2"},
                              {"Do you wish to use mixed precision?", "no"},
                              {"How many gradient accumulation steps?", "1"}});
    INFO(r);
    CHECK(r.status == 0);
    const auto json = nlohmann::json::parse(read_file(asked));
    CHECK(json["fsdp_config"]["fsdp_version"] == 2);
    CHECK(json["fsdp_config"]["fsdp_reshard_after_forward"] == false);
    CHECK_FALSE(json["fsdp_config"].contains("fsdp_sharding_strategy"));
    CHECK_FALSE(json["fsdp_config"].contains("fsdp_auto_wrap_policy"));  // no units to wrap without resharding
    auto w = run_accel({"config", "--config_file", flagged, "--use_fsdp", "--fsdp_version", "2",
                        "--fsdp_reshard_after_forward", "false", "--fsdp_offload_params", "false", "--cpu",
                        "--num_processes", "2", "--mixed_precision", "no", "--gradient_accumulation_steps", "1",
                        "--num_machines", "1"},
                       dir);
    CHECK(w.status == 0);
    CHECK(json == nlohmann::json::parse(read_file(flagged)));
  }
  SUBCASE("several machines: rank, address and port asked, out-of-range answers asked again") {
    const std::string path = dir.file("two.json");
    auto r = run_in_terminal({"config", "--config_file", path}, dir,
                             {{"Which type of machine are you using?", "1"},
                              {"How many different machines", "2"},
                              {"What is the rank of this machine?", "2"},
                              {"Please enter a whole number from 0 to 1.", "1"},
                              {"IP address of the machine that will host the main process?", ""},
                              {"Please enter a value.", "10.0.0.2"},
                              {"What is the port", ""},
                              {"same local network?", ""},
                              {"Should distributed operations be checked", ""},
                              {"FullyShardedDataParallel", ""},
                              {"How many CPU processes in total", "3"},
                              {"does not divide by the 2 machines", ""},
                              {"How many CPU processes in total", "4"},
                              {"mixed precision?", ""},
                              {"gradient accumulation steps?", ""}});
    INFO(r);
    CHECK(r.status == 0);
    const auto json = nlohmann::json::parse(read_file(path));
    CHECK(json["distributed_type"] == "MULTI_CPU");
    CHECK(json["num_machines"] == 2);
    CHECK(json["machine_rank"] == 1);
    CHECK(json["main_process_ip"] == "10.0.0.2");
    CHECK(json["main_process_port"] == 29500);
    CHECK(json["num_processes"] == 4);
    CHECK(json["mixed_precision"] == "no");  // answered (with the default), so written
    CHECK(json["debug"] == false);
  }
  SUBCASE("the input ending midway writes nothing") {
    const std::string path = dir.file("never.json");
    auto r = run_in_terminal({"config", "--config_file", path}, dir,
                             {{"Which type of machine are you using?", "\x04"}});  // Ctrl-D: end of input
    CHECK(r.status == 2);
    CHECK(contains(r.out, "the input ended before the questions did; nothing was written"));
    CHECK_FALSE(fs::exists(path));
  }
  SUBCASE("no flags and no terminal: refused, pointing at the flags and at accel config default") {
    auto r = run_accel({"config", "--config_file", dir.file("x.json")}, dir);
    CHECK(r.status == 2);
    CHECK(contains(r.err, "no flags given and no terminal to ask on"));
    CHECK(contains(r.err, "accel config default"));
  }
  SUBCASE("accel config update: an older file gets every key this version writes, its values kept") {
    const std::string path = dir.file("old.json");
    write_file(path, R"({"num_processes": 2, "mixed_precision": "bf16", "distributed_type": "MULTI_CPU"})");
    auto r = run_accel({"config", "update", "--config_file", path}, dir);
    INFO(r);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "accel config: updated " + path));
    const auto json = nlohmann::json::parse(read_file(path));
    CHECK(json["num_processes"] == 2);
    CHECK(json["mixed_precision"] == "bf16");
    CHECK(json["compute_environment"] == "LOCAL_MACHINE");
    CHECK(json["rdzv_backend"] == "static");
    auto missing = run_accel({"config", "update", "--config_file", dir.file("none.json")}, dir);
    CHECK(missing.status == 2);
    CHECK(contains(missing.err, "there is no config to update"));
  }
  SUBCASE("accel config with flags but no mixed_precision leaves the key out: the program's precision decides") {
    const std::string path = dir.file("plain.json");
    CHECK(run_accel({"config", "--config_file", path, "--num_processes", "2"}, dir).status == 0);
    CHECK_FALSE(nlohmann::json::parse(read_file(path)).contains("mixed_precision"));
  }
}

TEST_CASE("help, env and unknown commands") {
  TempDir dir;
  auto help = run_accel({"launch", "--help"}, dir);
  CHECK(help.status == 0);
  for (const char* flag : {"--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                           "--main_process_port", "--config_file", "--mixed_precision",
                           "--num_cpu_threads_per_process", "--gradient_accumulation_steps", "--cpu", "--quiet", "-q",
                           "--monitor_interval", "--max_restarts", "--timeout", "Exit status"})
    CHECK_MESSAGE(contains(help.out, flag), "launch --help lacks " << flag);
  auto top = run_accel({"--help"}, dir);
  CHECK(top.status == 0);
  for (const char* command : {"launch", "config", "env"}) CHECK(contains(top.out, command));

  write_file(dir.hf_home() + "/accelerate/default_config.json", "{\"num_processes\": 2}\n");
  auto env = run_accel({"env"}, dir, {{"SLURM_PROCID", "5"}});
  INFO(env);
  CHECK(env.status == 0);
  CHECK(contains(env.out, "accel version: "));
  CHECK(contains(env.out, "CPUs: "));
  CHECK(contains(env.out, dir.hf_home() + "/accelerate/default_config.json"));
  CHECK(contains(env.out, "\"num_processes\": 2"));
  CHECK(contains(env.out, "SLURM_PROCID=5"));

  auto unknown = run_accel({"lanch"}, dir);
  CHECK(unknown.status == 2);
  CHECK(contains(unknown.err, "unknown command 'lanch'"));

  // accel test (the self-test itself runs as the accel_test_* tests, it links LibTorch)
  CHECK(contains(top.out, "test "));
  auto missing = run_accel({"test", "--num_processes", "2"}, dir, {{"ACCEL_SELFTEST", dir.file("nowhere")}});
  CHECK(missing.status == 2);
  CHECK(contains(missing.err, "the self-test program " + dir.file("nowhere") + " is missing: build it"));
  auto stray = run_accel({"test", "./train"}, dir);
  CHECK(stray.status == 2);
  CHECK(contains(stray.err, "unexpected argument './train'"));
}

TEST_CASE("estimate-memory: per-rank bytes of a shape under each strategy, hand-computed; bad shapes refused") {
  TempDir dir;
  // GPT-2 small with an untied LM head: GPT-2's 124,439,808 parameters plus 50257 x 768.
  auto gpt = run_accel({"estimate-memory", "gpt"}, dir);
  INFO(gpt);
  REQUIRE(gpt.status == 0);
  CHECK(contains(gpt.out, "163037184 parameters"));
  for (const char* row : {"single process", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 + cpu_offload"}) CHECK(contains(gpt.out, row));

  // An MLP of 7-13-9-5 (280 parameters, 1120 bytes) with Adam (two states per parameter).
  auto rows = [&](const std::vector<std::string>& flags) {
    std::vector<std::string> args = {"estimate-memory", "mlp", "--widths", "7,13,9,5", "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    auto result = run_accel(args, dir);
    INFO(result);
    REQUIRE(result.status == 0);
    std::map<std::string, nlohmann::json> by_strategy;
    std::istringstream lines(result.out);
    for (std::string line; std::getline(lines, line);) {
      auto row = nlohmann::json::parse(line);
      by_strategy[row["strategy"].get<std::string>() + "/" + std::to_string(row["num_processes"].get<int>())] = row;
    }
    return by_strategy;
  };
  auto three = rows({"--num_processes", "3", "--batch_size", "4"});
  auto state = [](const nlohmann::json& row) {
    return std::vector<std::int64_t>{row["parameters"], row["gradients"], row["optimizer_state"], row["offloaded_parameters"],
                                     row["offloaded_gradients"], row["offloaded_optimizer_state"]};
  };
  using V = std::vector<std::int64_t>;
  CHECK(state(three["DDP/3"]) == V{1120, 1120, 2240, 0, 0, 0});
  // One bucket (1120 bytes is under the 1 MB first cap), padded to 282 elements: shards of 94.
  CHECK(state(three["ZeRO-1/3"]) == V{1128, 1128, 752, 0, 0, 0});
  CHECK(state(three["ZeRO-2/3"]) == V{1128, 376, 752, 0, 0, 0});
  CHECK(state(three["ZeRO-3/3"]) == V{376, 376, 752, 0, 0, 0});
  CHECK(state(three["ZeRO-3 + cpu_offload/3"]) == V{376, 376, 0, 376, 376, 752});
  CHECK(three["DDP/3"]["activations"].get<std::int64_t>() > 0);
  CHECK(three["DDP/3"]["per_rank"].get<std::int64_t>() == 1120 + 1120 + 2240 + three["DDP/3"]["activations"].get<std::int64_t>());
  // ZeRO-3 keeps its step's buffers: one unit (the whole model, 1128 bytes) gathered and one as a gradient bucket.
  CHECK(three["DDP/3"]["step_buffers"].get<std::int64_t>() == 0);
  CHECK(three["ZeRO-3/3"]["step_buffers"].get<std::int64_t>() == 2 * 1128);
  CHECK(three["ZeRO-3/3"]["per_rank"].get<std::int64_t>() ==
        376 + 376 + 752 + 2 * 1128 + three["ZeRO-3/3"]["activations"].get<std::int64_t>());
  // ZeRO-3 units of at least 60 elements on 4 ranks: Linear 104 | Linear 126 -> 128 | the root's 50 -> 52.
  auto units = rows({"--num_processes", "4", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "--fsdp_min_num_params", "60",
                     "--optimizer", "sgd_momentum", "--mixed_precision", "bf16"});
  CHECK(state(units["ZeRO-3/4"]) == V{284, 284, 284, 0, 0, 0});
  // Kept step buffers: gathered, the root and the two other units; as gradients, the largest two adjacent buckets.
  CHECK(units["ZeRO-3/4"]["step_buffers"].get<std::int64_t>() == 4 * ((52 + 104 + 128) + (104 + 128)));
  CHECK(state(units["DDP/4"]) == V{1120, 1120, 1120, 0, 0, 0});
  CHECK(units["DDP/4"]["activations"].is_null());  // no formula under autocast

  for (const auto& [args, message] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"estimate-memory"}, "which model?"},
           {{"estimate-memory", "bert"}, "unknown model 'bert'"},
           {{"estimate-memory", "mlp"}, "mlp needs --widths"},
           {{"estimate-memory", "gpt", "--heads", "5"}, "the width (768) must divide by the heads (5)"},
           {{"estimate-memory", "gpt", "--layers", "zero"}, "--layers expects an integer"},
           {{"estimate-memory", "gpt", "--optimizer", "lion"}, "--optimizer expects adam"},
           {{"estimate-memory", "gpt", "--num_processes", "4", "--shard_group_size", "3"}, ""},
       }) {
    auto refused = run_accel(args, dir);
    INFO(refused);
    if (message.empty()) {
      CHECK(refused.status == 0);  // a HybridShard that does not divide is left out, not an error
      CHECK_FALSE(contains(refused.out, "HybridShard ("));
      continue;
    }
    CHECK(refused.status == 2);
    CHECK(contains(refused.err, message));
  }
}

TEST_CASE("export: copies a checkpoint's model file where it is in the format asked for (out/model.safetensors, or "
          "with --unsafe_serialization one LibTorch file); refuses an incomplete one and a model cut into parts; a "
          "sharded one, or a conversion, needs accel-merge-weights") {
  TempDir dir;
  const std::string model_bytes = "not really a model file, but 40 bytes..";
  auto make_checkpoint = [&](const std::string& name, const nlohmann::json& extra,
                             const std::string& file = "model_0.safetensors") {
    fs::create_directories(dir.path / name);
    write_file(dir.file(name + "/" + file), model_bytes);
    nlohmann::json manifest = {{"format_version", 1},
                               {"models", nlohmann::json::array({nlohmann::json::object()})},
                               {"files", {{file, model_bytes.size()}}}};
    manifest.update(extra);
    write_file(dir.file(name + "/manifest.json"), manifest.dump());
  };
  make_checkpoint("whole", nlohmann::json::object());
  auto ok = run_accel({"export", dir.file("whole"), dir.file("out")}, dir);
  CHECK_MESSAGE((ok.exited && ok.status == 0), ok);
  CHECK(read_file(dir.file("out/model.safetensors")) == model_bytes);
  make_checkpoint("archived", nlohmann::json::object(), "model_0.pt");  // an older accel's
  auto unsafe = run_accel({"export", dir.file("archived"), dir.file("out.pt"), "--unsafe_serialization"}, dir);
  CHECK_MESSAGE((unsafe.exited && unsafe.status == 0), unsafe);
  CHECK(read_file(dir.file("out.pt")) == model_bytes);

  make_checkpoint("cut", {{"model_parts", 2}, {"model_layout", "tensor 2 x pipeline 1"}});
  auto cut = run_accel({"export", dir.file("cut"), dir.file("cut.pt")}, dir);
  CHECK_MESSAGE((cut.exited && cut.status == 1), cut);
  CHECK(cut.err.find("holds the model cut into 2 parts (tensor 2 x pipeline 1)") != std::string::npos);
  CHECK_FALSE(fs::exists(dir.file("cut.pt")));

  fs::remove(dir.file("whole/manifest.json"));  // an interrupted save
  auto incomplete = run_accel({"export", dir.file("whole"), dir.file("again.pt")}, dir);
  CHECK_MESSAGE((incomplete.exited && incomplete.status == 1), incomplete);
  CHECK(incomplete.err.find("is incomplete") != std::string::npos);

  auto usage = run_accel({"export", dir.file("whole")}, dir);
  CHECK_MESSAGE((usage.exited && usage.status == 2), usage);

  // A sharded model is joined by accel-merge-weights (it links LibTorch;
  // the checkpoint suite runs it for real): without it, both commands say so.
  make_checkpoint("sharded", {{"model_state_dict", "SHARDED_STATE_DICT"}});
  const std::map<std::string, std::string> no_merger{{"ACCEL_MERGE_WEIGHTS", dir.file("no-such-program")}};
  for (const std::string command : {"merge-weights", "export"}) {
    auto missing = run_accel({command, dir.file("sharded"), dir.file("merged")}, dir, no_merger);
    CHECK_MESSAGE((missing.exited && missing.status == 2), missing);
    CHECK(missing.err.find("the merge program " + dir.file("no-such-program") + " is missing") != std::string::npos);
    CHECK_FALSE(fs::exists(dir.file("merged")));
  }
  // An older accel's model_0.pt as safetensors is a conversion: the merge program's too.
  auto convert = run_accel({"export", dir.file("archived"), dir.file("converted")}, dir, no_merger);
  CHECK_MESSAGE((convert.exited && convert.status == 2), convert);
  CHECK(convert.err.find("is missing") != std::string::npos);
}
