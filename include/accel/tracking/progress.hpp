#pragma once
// A progress bar for the training loop, as tqdm draws it:
//   train  42%|████████▍           | 42/100 [00:12<00:17, 3.41 it/s, loss=0.1234]
// Drawn on one line (carriage return) at most every `min_interval`, and on
// the last step. Quiet when its stream is not a terminal (a log file, a
// pipe, `accel launch`'s prefixed output), as tqdm's `disable=None` is;
// `Trainer::progress_bar` also keeps it quiet on every rank but the main
// process. Hand-written (about a hundred lines): Debian ships no C++
// progress-bar library (indicators, tqdm.cpp) and this project takes
// dependencies from Debian and PyPI only. Torch-free.

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>

namespace accel::tracking {

struct ProgressOptions {
  std::string description = "";
  /// Draw where the stream is not a terminal too (tests, or a user who wants it in a log).
  bool force = false;
  /// Never draw (every rank but the main process).
  bool disable = false;
  std::chrono::milliseconds min_interval{100};
  int width = 20;  ///< characters of the bar itself
};

/// "mm:ss", or "h:mm:ss" past an hour, as tqdm writes durations.
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<long long>(seconds + 0.5);
  char out[32];
  if (s >= 3600) std::snprintf(out, sizeof(out), "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  else std::snprintf(out, sizeof(out), "%02lld:%02lld", s / 60, s % 60);
  return out;
}

class ProgressBar {
 public:
  using Clock = std::chrono::steady_clock;

  /// `total` steps (0: unknown, no bar or ETA), drawn to `out` (std::cout by default).
  explicit ProgressBar(std::int64_t total, ProgressOptions options = {}, std::ostream* out = nullptr)
      : total_(total), options_(std::move(options)), out_(out ? out : &std::cout), start_(Clock::now()) {
    const bool terminal = out_ == &std::cout ? ::isatty(STDOUT_FILENO) == 1
                          : out_ == &std::cerr ? ::isatty(STDERR_FILENO) == 1
                                               : false;
    enabled_ = !options_.disable && (options_.force || terminal);
  }
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ProgressBar(ProgressBar&& other) noexcept
      : total_(other.total_), done_(other.done_), options_(std::move(other.options_)), out_(other.out_),
        start_(other.start_), last_draw_(other.last_draw_), loss_(other.loss_), enabled_(other.enabled_),
        closed_(other.closed_) {
    other.closed_ = true;
  }
  ~ProgressBar() { close(); }

  /// `steps` more done; `loss`, when given, is shown as the last loss.
  void update(std::int64_t steps = 1, std::optional<double> loss = std::nullopt) {
    done_ += steps;
    if (loss) loss_ = loss;
    if (!enabled_) return;
    const auto now = Clock::now();
    if (done_ < total_ && last_draw_ && now - *last_draw_ < options_.min_interval) return;
    last_draw_ = now;
    *out_ << '\r' << line(now) << std::flush;
  }
  /// Ends the line (once); the destructor calls it.
  void close() {
    if (closed_) return;
    closed_ = true;
    if (enabled_ && last_draw_) *out_ << '\r' << line(Clock::now()) << '\n' << std::flush;
  }

  std::int64_t count() const { return done_; }
  bool enabled() const { return enabled_; }

  /// The text drawn at time `now`.
  std::string line(Clock::time_point now) const {
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double rate = elapsed > 0 ? done_ / elapsed : 0.0;
    std::ostringstream text;
    if (!options_.description.empty()) text << options_.description << ' ';
    if (total_ > 0) {
      const double fraction = std::min(1.0, static_cast<double>(done_) / total_);
      text << std::setw(3) << static_cast<int>(fraction * 100) << "%|" << bar(fraction) << "| ";
      text << done_ << '/' << total_ << " [" << format_duration(elapsed) << '<'
           << format_duration(rate > 0 ? (total_ - done_) / rate : NAN);
    } else {
      text << done_ << " [" << format_duration(elapsed);
    }
    text << ", " << std::fixed << std::setprecision(2) << rate << " it/s";
    if (loss_) text << ", loss=" << std::setprecision(4) << *loss_;
    text << ']';
    return text.str();
  }

 private:
  std::string bar(double fraction) const {
    static const char* eighths[] = {"", "\u258F", "\u258E", "\u258D", "\u258C", "\u258B", "\u258A", "\u2589"};
    const int cells = options_.width * 8;
    const int filled = static_cast<int>(fraction * cells);
    std::string out;
    for (int i = 0; i < filled / 8; ++i) out += "\u2588";
    int used = filled / 8;
    if (filled % 8 != 0) out += eighths[filled % 8], ++used;
    out.append(static_cast<std::size_t>(options_.width - used), ' ');
    return out;
  }

  std::int64_t total_;
  std::int64_t done_ = 0;
  ProgressOptions options_;
  std::ostream* out_;
  Clock::time_point start_;
  std::optional<Clock::time_point> last_draw_;
  std::optional<double> loss_;
  bool enabled_ = false;
  bool closed_ = false;
};

}  // namespace accel::tracking
