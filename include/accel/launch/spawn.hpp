#pragma once
// accel::spawn: fork n ranks of a function on loopback, like Accelerate's
// notebook_launcher. Each rank sees torchrun's variables, so code inside it
// builds its Trainer exactly as under `accel launch`. Torch-free.

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <vector>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>

#include "accel/core/rank_end.hpp"
#include "accel/launch/supervisor.hpp"

namespace accel {

struct SpawnOptions {
  /// A rank still running after this is killed and the spawn fails: a hang is a failure.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  /// Between SIGTERM and SIGKILL for the surviving ranks when one fails.
  std::chrono::milliseconds grace{std::chrono::seconds(2)};
  /// Forwarded as OMP_NUM_THREADS to each rank (torchrun's default for >1 rank).
  int threads_per_process = 1;
  /// Terminate the other ranks as soon as one fails (the default). Tests of
  /// failure handling turn it off to watch how the survivors react.
  bool stop_on_failure = true;
};

/// One rank failed, died or timed out.
class SpawnError : public std::runtime_error {
 public:
  SpawnError(const std::string& what, launch::JobOutcome outcome)
      : std::runtime_error(what), outcome_(std::move(outcome)) {}
  const launch::JobOutcome& outcome() const { return outcome_; }

 private:
  launch::JobOutcome outcome_;
};

/// Runs `fn(rank)` in `world_size` forked processes and waits for all of
/// them. A rank that throws prints the message and exits 1; the first rank to
/// fail takes the others down and `spawn` throws SpawnError naming it and
/// carrying its error message.
///   accel::spawn(2, [](int rank) { accel::Trainer<accel::DDP> t; ... });
template <class Fn>
void spawn(int world_size, Fn&& fn, const SpawnOptions& options = {}) {
  if (world_size < 1) throw std::invalid_argument("accel::spawn: world_size must be at least 1");
  const int port = launch::free_loopback_port();
  std::fflush(nullptr);  // buffered output would otherwise be written once per child
  launch::ProcessSupervisor supervisor;
  // One pipe per rank for its error message (at most PIPE_BUF bytes, written
  // at once: a write that small never blocks on an empty pipe).
  std::vector<int> message_pipes;
  struct ClosePipes {
    std::vector<int>& fds;
    ~ClosePipes() {
      for (int fd : fds) ::close(fd);
    }
  } close_pipes{message_pipes};
  for (int rank = 0; rank < world_size; ++rank) {
    int message[2];
    if (::pipe2(message, O_CLOEXEC) != 0)
      throw std::runtime_error(std::string("accel::spawn: pipe failed: ") + std::strerror(errno));
    message_pipes.push_back(message[0]);
    pid_t pid = ::fork();
    if (pid < 0) ::close(message[1]);
    if (pid < 0) throw std::runtime_error(std::string("accel::spawn: fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      auto tell_parent = [&](const std::string& text) {
        const std::string clipped = text.substr(0, 4000);
        [[maybe_unused]] const auto written = ::write(message[1], clipped.data(), clipped.size());
      };
      launch::become_supervised_child();
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("OMP_NUM_THREADS", std::to_string(options.threads_per_process).c_str(), 1);
      int code = 0;
      try {
        fn(rank);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] error: %s\n", rank, e.what());
        tell_parent(e.what());
        code = 1;
      } catch (...) {
        std::fprintf(stderr, "[rank %d] error: unknown exception\n", rank);
        tell_parent("unknown exception");
        code = 1;
      }
      detail::run_rank_end_hook(code == 0);  // leave the job in order: rank 0 keeps the store until every rank is done
      std::fflush(nullptr);
      ::_exit(code);  // not exit(): the parent's atexit handlers (test runners) must not run here
    }
    ::close(message[1]);
    supervisor.add(rank, pid);
  }
  auto outcome = supervisor.wait(options.timeout, options.grace, {}, {}, options.stop_on_failure);
  if (!outcome.ok()) {
    std::string what = "accel::spawn: " + outcome.describe_first();
    if (outcome.timed_out)
      what += " (" + std::to_string(options.timeout.count()) + " ms); all ranks were killed";
    if (outcome.first_failure) {  // the failed rank's message, when it threw one (every rank has exited by now)
      const int fd = message_pipes[static_cast<std::size_t>(outcome.first_failure->rank)];
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
      char text[4096];
      const ssize_t n = ::read(fd, text, sizeof text);
      if (n > 0) what += ": " + std::string(text, static_cast<std::size_t>(n));
    }
    what += outcome.describe_others();
    throw SpawnError(what, std::move(outcome));
  }
}

}  // namespace accel
