#pragma once
// Forwards every rank's stdout and stderr to the launcher's own, one whole
// line at a time with a "[rank N] " prefix, so that lines from different
// ranks never interleave mid-line. Runs on the launcher's single thread: the
// supervisor calls `pump` while it waits, and `drain` collects what is left.

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

namespace accel::cli {

class OutputPump {
 public:
  OutputPump() = default;
  OutputPump(const OutputPump&) = delete;
  OutputPump& operator=(const OutputPump&) = delete;
  ~OutputPump() {
    for (auto& stream : streams_)
      if (stream.fd >= 0) ::close(stream.fd);
  }

  /// Takes ownership of `fd` (the read end of a rank's pipe); its lines go to
  /// `target_fd` (1 or 2).
  void add(int rank, int fd, int target_fd) {
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    streams_.push_back({"[rank " + std::to_string(rank) + "] ", fd, target_fd, {}, rank, {}});
  }

  /// The last lines `rank` wrote to standard error (at most kept_lines), for
  /// the launcher's closing report of a failed rank.
  std::vector<std::string> last_error_lines(int rank) const {
    for (const auto& stream : streams_)
      if (stream.rank == rank && stream.target == STDERR_FILENO) return {stream.last.begin(), stream.last.end()};
    return {};
  }
  static constexpr std::size_t kept_lines = 5;

  /// Waits up to `timeout_ms` for output and forwards whatever arrived.
  void pump(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<Stream*> owners;
    for (auto& stream : streams_) {
      if (stream.fd < 0) continue;
      fds.push_back({stream.fd, POLLIN, 0});
      owners.push_back(&stream);
    }
    if (fds.empty()) {
      ::poll(nullptr, 0, timeout_ms);  // nothing to read: just wait (a signal ends it early)
      return;
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;  // timeout or EINTR
    for (std::size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_available(*owners[i]);
  }

  /// After the ranks are gone: forwards what is still buffered in the pipes,
  /// waiting at most `limit` for writers that outlived their rank, then
  /// flushes unterminated last lines.
  void drain(std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (any_open() && std::chrono::steady_clock::now() < deadline) pump(20);
    for (auto& stream : streams_) {
      if (stream.fd >= 0) {
        ::close(stream.fd);
        stream.fd = -1;
      }
      flush_partial(stream);
    }
  }

 private:
  struct Stream {
    std::string prefix;
    int fd;
    int target;
    std::string partial;  ///< a line still waiting for its newline
    int rank;
    std::deque<std::string> last;  ///< the last complete lines (stderr only)
  };

  // A rank that never writes a newline must not grow the buffer forever.
  static constexpr std::size_t max_line = 64 * 1024;

  bool any_open() const {
    for (const auto& stream : streams_)
      if (stream.fd >= 0) return true;
    return false;
  }

  void read_available(Stream& stream) {
    char buffer[65536];
    for (int round = 0; round < 16; ++round) {  // bounded, so one chatty rank cannot starve the rest
      ssize_t n = ::read(stream.fd, buffer, sizeof buffer);
      if (n > 0) {
        forward(stream, std::string_view(buffer, static_cast<std::size_t>(n)));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      ::close(stream.fd);  // EOF (or a read error): this rank's stream is done
      stream.fd = -1;
      flush_partial(stream);
      return;
    }
  }

  void forward(Stream& stream, std::string_view data) {
    std::string out;
    std::size_t start = 0;
    for (std::size_t nl = data.find('\n'); nl != std::string_view::npos; nl = data.find('\n', start)) {
      out += stream.prefix;
      out += stream.partial;
      out.append(data.substr(start, nl + 1 - start));
      remember(stream, stream.partial + std::string(data.substr(start, nl - start)));
      stream.partial.clear();
      start = nl + 1;
    }
    stream.partial.append(data.substr(start));
    if (stream.partial.size() >= max_line) {
      out += stream.prefix + stream.partial + "\n";
      stream.partial.clear();
    }
    write_all(stream.target, out);
  }

  // A LibTorch error's backtrace ("Exception raised from ...", then "frame #N: ..." lines) would push the
  // message out of the kept lines: the report keeps the lines that say what went wrong.
  static bool backtrace_line(const std::string& line) {
    return line.rfind("frame #", 0) == 0 || line.rfind("Exception raised from ", 0) == 0;
  }

  static void remember(Stream& stream, std::string line) {
    if (stream.target != STDERR_FILENO || line.empty() || backtrace_line(line)) return;
    stream.last.push_back(std::move(line));
    if (stream.last.size() > kept_lines) stream.last.pop_front();
  }

  static void flush_partial(Stream& stream) {
    if (stream.partial.empty()) return;
    remember(stream, stream.partial);
    write_all(stream.target, stream.prefix + stream.partial + "\n");
    stream.partial.clear();
  }

  // A closed terminal or pipe (EPIPE) drops the output; the job keeps running.
  static void write_all(int fd, const std::string& text) {
    std::size_t done = 0;
    while (done < text.size()) {
      ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) {
        pollfd wait_fd{fd, POLLOUT, 0};
        ::poll(&wait_fd, 1, 100);
        continue;
      }
      if (n <= 0) return;
      done += static_cast<std::size_t>(n);
    }
  }

  std::vector<Stream> streams_;
};

}  // namespace accel::cli
