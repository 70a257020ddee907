#pragma once
// NOTE [Naming the dead rank]
// When a collective fails, Gloo says which socket closed, not which rank
// is gone. So every rank of a job keeps a heartbeat in the rendezvous store
// (a counter under accel/heartbeat/<rank>, advanced every `period` by a
// thread with its own store connection), and a rank whose collective fails
// reads every counter twice, `window` apart: a counter that did not move
// belongs to a rank that died or froze; one that moved, to a rank that is
// alive (perhaps stuck in another collective). If the store itself is
// unreachable, rank 0, which hosts it, is gone. No clocks are compared, so
// it works across machines.
//
// A rank whose collective failed first marks itself failed
// (accel/failed/<rank>) and stops beating: the others then say it failed
// too instead of calling it gone, and its process group, whose destructor
// would wait out the timeout on the collectives still queued, is left to
// the operating system at exit (Communicator's group registry), so the
// rank exits with its error instead of hanging.
//
// NOTE [Leaving the job]
// Rank 0 hosts the store, and every other rank's c10d clients keep threads
// reading their sockets. If rank 0's process ended while another rank was
// still working, that rank lost the store under its heartbeat; closing the
// heartbeat's client then met the reset in LibTorch 1.13's client thread,
// which throws, and the rank ended in std::terminate (a core dump showed it:
// about once in 700 runs of a test whose rank 0 finishes first, more often
// under CI's load). So a rank leaves the job in order, as torchrun's agent
// keeps the store until every worker ends: it stops its heartbeat, says it
// left (accel/left/<rank>) and closes its own clients; rank 0 waits until
// every other rank has left, failed, or gone silent (no heartbeat for
// `silent_after`), then a moment more, before its store closes. It happens
// when the job's connection ends (the process's end, or accel::spawn's rank
// end through core/rank_end.hpp). The wait is bounded by
// `longest_leave_wait` (or the collective timeout if shorter): a rank 0 that
// ends on an error while the others wait in a collective for it must not
// hold them until their timeout, as a launcher stops them only once rank 0
// has exited. A rank that failed a collective, or that accel::spawn saw
// throw, does not wait.

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "accel/comm/flight_recorder.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "accel/core/compiled_once.hpp"

namespace accel::comm {

class Liveness {
 public:
  static constexpr std::chrono::milliseconds default_period{250};

  /// Starts this rank's heartbeat against the store at `host:port`.
  Liveness(std::string host, int port, int rank, int world_size, std::chrono::milliseconds timeout,
           std::chrono::milliseconds period = default_period)
      : host_(std::move(host)), port_(port), rank_(rank), world_size_(world_size), timeout_(timeout), period_(period) {
    beat_ = std::thread([beat = beat_state_, host = host_, port = port_, rank = rank_, timeout = timeout_, period] {
      run(*beat, host, port, rank, timeout, period);
    });
  }
  ~Liveness() { stop(); }
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  /// This rank's collective failed: say so in the store, stop beating.
  void mark_failed() noexcept;
  bool failed() const { return failed_; }

  /// This rank's program is done with the job (NOTE [Leaving the job]):
  /// stops the heartbeat, says so in `store`, and on rank 0 waits for the
  /// others to leave before returning. Once; never throws.
  void leave(c10d::Store& store, bool wait_for_peers = true) noexcept;
  static constexpr std::chrono::milliseconds longest_leave_wait{std::chrono::seconds(10)};

  /// What a failed collective can say about its peers, e.g. "rank 2 is gone
  /// (its heartbeat stopped: died or froze)", or that every rank is alive
  /// (so one skipped the collective). Takes about 3 periods, 5 when a rank
  /// seems silent (it is looked at twice); never throws.
  /// `failed_at_once`: the collective failed well before its timeout, so a
  /// rank that never came is not the likely cause when every rank is alive.
  std::string diagnose(bool failed_at_once = false) const noexcept;

 private:
  static std::string key(int rank) { return "accel/heartbeat/" + std::to_string(rank); }
  static std::string failed_key(int rank) { return "accel/failed/" + std::to_string(rank); }
  static std::string left_key(int rank) { return "accel/left/" + std::to_string(rank); }

  // A rank neither beating nor leaving for this long was killed or froze: rank 0 stops waiting for it.
  std::chrono::milliseconds silent_after() const { return 16 * period_; }
  void wait_for_peers_to_leave(c10d::Store& store) const;

  // Rank 0 hosts the store: when a peer died, it waits (5 s at most) for
  // every rank still alive to fail too before it exits with its error, so
  // that their roll calls find the store.
  void hold_store_for_peers(c10d::TCPStore& store, const std::vector<int>& gone) const;

  std::unique_ptr<c10d::TCPStore> connect(std::chrono::milliseconds timeout) const {
    return connect_to(host_, port_, timeout);
  }
  static std::unique_ptr<c10d::TCPStore> connect_to(const std::string& host, int port,
                                                    std::chrono::milliseconds timeout);

  // A beat to a store across a link that went down can block for minutes
  // (TCP retransmits): the thread is waited for a few periods, then left to
  // the operating system. It shares only BeatState, so it may outlive this.
  void stop() noexcept;

  // -1 for a rank that never beat.
  std::vector<std::int64_t> read_all(c10d::Store& store) const;

  // Beats, and writes the flight record when SIGUSR1 asked for it (NOTE
  // [Flight recorder]): this thread runs while the main one is blocked.
  struct BeatState {
    std::mutex mutex;
    std::condition_variable wake;
    bool stopping = false;
    bool finished = false;
  };

  static void run(BeatState& beat, const std::string& host, int port, int rank, std::chrono::milliseconds timeout,
                  std::chrono::milliseconds period);

  std::string host_;
  int port_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds period_;
  std::shared_ptr<BeatState> beat_state_ = std::make_shared<BeatState>();
  std::atomic<bool> failed_{false};
  std::atomic<bool> left_{false};
  std::thread beat_;
};

// The members compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE void Liveness::mark_failed() noexcept {
  if (failed_.exchange(true)) return;
  stop();
  try {
    connect(std::chrono::milliseconds(2000))->set(failed_key(rank_), std::vector<std::uint8_t>{'1'});
  } catch (const std::exception&) {
    // The store is gone: diagnose() will say so.
  }
}

ACCEL_COMPILED_ONCE void Liveness::leave(c10d::Store& store, bool wait_for_peers) noexcept {
  if (failed_ || left_.exchange(true)) return;
  stop();  // no beat after the word that it left
  try {
    store.set(left_key(rank_), std::vector<std::uint8_t>{'1'});
    if (rank_ == 0 && wait_for_peers) wait_for_peers_to_leave(store);
  } catch (const std::exception&) {
    // The store is gone: rank 0 died, so there is no one to tell.
  }
}

ACCEL_COMPILED_ONCE void Liveness::wait_for_peers_to_leave(c10d::Store& store) const {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto bound = std::min(timeout_, longest_leave_wait);
  std::vector<int> waiting;
  for (int r = 1; r < world_size_; ++r) waiting.push_back(r);
  auto beats = read_all(store);
  auto read_at = start;
  std::vector<clock::time_point> moved_at(static_cast<std::size_t>(world_size_), start);
  while (true) {
    std::erase_if(waiting, [&](int r) { return store.check({left_key(r)}) || store.check({failed_key(r)}); });
    const auto now = clock::now();
    if (now - start >= bound) return;
    if (waiting.empty()) {
      // Each rank said it left just before closing its own store clients: a
      // moment more, so that the store closes after them.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return;
    }
    if (now - read_at >= period_) {
      const auto latest = read_all(store);
      for (int r : waiting)
        if (latest[r] != beats[r]) moved_at[r] = now;
      beats = latest;
      read_at = now;
      std::erase_if(waiting, [&](int r) { return now - moved_at[r] >= silent_after(); });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

ACCEL_COMPILED_ONCE auto Liveness::diagnose(bool failed_at_once) const noexcept -> std::string {
  try {
    auto store = connect(std::chrono::milliseconds(2000));
    const auto first = read_all(*store);
    std::this_thread::sleep_for(3 * period_);
    const auto second = read_all(*store);
    std::vector<int> silent;  // neither beating nor failed in a collective of their own
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_ && second[r] == first[r] && !store->check({failed_key(r)})) silent.push_back(r);
    if (!silent.empty()) {
      // A beat can come late on a loaded machine (seen once in CI: a rank
      // asleep, alive, was called gone): look again before saying so.
      std::this_thread::sleep_for(2 * period_);
      const auto third = read_all(*store);
      std::erase_if(silent, [&](int r) { return third[r] != second[r] || store->check({failed_key(r)}); });
    }
    // Only after a death do the survivors fail together and need the store for their roll calls.
    if (rank_ == 0 && !silent.empty()) hold_store_for_peers(*store, silent);
    if (silent.empty() && failed_at_once)
      return "every other rank is alive and the collective failed at once, not at its timeout: the backend refused "
             "it (a dtype or shape it does not take? the reason follows)";
    if (silent.empty())
      return "every other rank is alive (their heartbeats go on), so one of them did not reach this collective: "
             "it is stuck elsewhere or skipped it (a collective under if (is_main_process()), a different number "
             "of steps or batches)";
    auto listed = [](const std::vector<int>& ranks) {
      std::string text = ranks.size() == 1 ? "rank " : "ranks ";
      for (std::size_t k = 0; k < ranks.size(); ++k)
        text += (k == 0 ? "" : k + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[k]);
      return text;
    };
    std::vector<int> left, gone;  // left: ended their program in order (NOTE [Leaving the job])
    for (int r : silent) (store->check({left_key(r)}) ? left : gone).push_back(r);
    std::string text;
    if (!left.empty())
      text = listed(left) +
             (left.size() == 1 ? " has already ended its program (left the job), so it"
                               : " have already ended their programs (left the job), so they") +
             " will not reach this collective: the ranks ran a different number of steps or batches, or one "
             "returned early";
    if (!gone.empty())
      text += (text.empty() ? "" : "; ") + listed(gone) +
              (gone.size() == 1 ? " is gone (its heartbeat stopped" : " are gone (their heartbeats stopped") +
              ": died, froze, or the network to it is down)";
    return text;
  } catch (const std::exception&) {
    return "rank 0 is gone (the rendezvous store it hosts at " + host_ + ":" + std::to_string(port_) +
           " does not answer: it died, froze or exited)";
  }
}

ACCEL_COMPILED_ONCE void Liveness::hold_store_for_peers(c10d::TCPStore& store, const std::vector<int>& gone) const {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bool others = false;
  for (int r = 1; r < world_size_; ++r) {
    if (std::find(gone.begin(), gone.end(), r) != gone.end()) continue;
    others = true;
    while (!store.check({failed_key(r)}) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (others) std::this_thread::sleep_for(6 * period_);  // the last one's roll call reads the store for up to 5 periods
}

ACCEL_COMPILED_ONCE auto Liveness::connect_to(const std::string& host, int port, std::chrono::milliseconds timeout) -> std::unique_ptr<c10d::TCPStore> {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = false;
  options.timeout = timeout;
  return std::make_unique<c10d::TCPStore>(host, options);
}

ACCEL_COMPILED_ONCE void Liveness::stop() noexcept {
  if (!beat_.joinable() || beat_.get_id() == std::this_thread::get_id()) return;
  std::unique_lock<std::mutex> lock(beat_state_->mutex);
  beat_state_->stopping = true;
  beat_state_->wake.notify_all();
  const bool finished =
      beat_state_->wake.wait_for(lock, 4 * period_ + std::chrono::seconds(1), [&] { return beat_state_->finished; });
  lock.unlock();
  if (finished) beat_.join();
  else beat_.detach();
}

ACCEL_COMPILED_ONCE auto Liveness::read_all(c10d::Store& store) const -> std::vector<std::int64_t> {
  std::vector<std::int64_t> beats(world_size_, -1);
  for (int r = 0; r < world_size_; ++r)
    if (store.check({key(r)})) beats[r] = store.add(key(r), 0);
  return beats;
}

ACCEL_COMPILED_ONCE void Liveness::run(BeatState& beat, const std::string& host, int port, int rank, std::chrono::milliseconds timeout, std::chrono::milliseconds period) {
  std::unique_ptr<c10d::TCPStore> store;
  try {
    // Short: a beat blocked on a dead store must not hold up stop() for the collective timeout.
    store = connect_to(host, port, std::min(timeout, std::chrono::milliseconds(2000)));
  } catch (const std::exception&) {
    // No store: no beats, but records can still be asked for.
  }
  std::unique_lock<std::mutex> lock(beat.mutex);
  while (!beat.stopping) {
    lock.unlock();
    if (FlightRecorder::take_request()) FlightRecorder::instance().dump(rank);
    try {
      if (store) store->add(key(rank), 1);
    } catch (const std::exception&) {
      store.reset();  // the store is gone (rank 0 ended or died): nothing left to tell
    }
    lock.lock();
    beat.wake.wait_for(lock, period, [&] { return beat.stopping; });
  }
  beat.finished = true;
  beat.wake.notify_all();
}

#endif

}  // namespace accel::comm
