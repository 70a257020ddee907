#pragma once
// Background loading for a prepared loader (LoaderOptions::num_workers,
// PyTorch's name): worker threads fetch the batches of one pass ahead of the
// training loop, at most `depth` beyond the one it is on, and the loop takes
// them in order, so the order is the loader's whatever the workers' timing.
// Worker w takes the next batch not yet fetched; an exception thrown by the
// dataset reaches the loop when it takes that batch. A pass left early stops
// the workers (they finish the batch in hand and exit).
//
// The dataset's get() runs on the worker threads, several at once: it must
// be safe to call concurrently (TensorDataset and torch::data's map chains
// over in-memory data are; a dataset reading one file handle is not).

#include <ATen/Parallel.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "accel/data/dataset.hpp"

namespace accel::data {

class Prefetcher {
 public:
  /// Fetches batches [first, end) with `fetch(batch)` on `workers` threads.
  Prefetcher(std::function<Batch(std::int64_t)> fetch, std::int64_t first, std::int64_t end, int workers, int depth)
      : fetch_(std::move(fetch)), next_to_fetch_(first), next_to_take_(first), end_(end), depth_(depth) {
    // In a forked rank LibTorch rebuilds its thread pool for the first
    // thread that sets up its intra-op threads; new threads doing so at
    // once race (LibTorch 1.13: "Invalid thread pool!"), so this thread
    // does it before the workers start.
    at::init_num_threads();
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  ~Prefetcher() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    for (auto& t : threads_) t.join();
  }

  /// Batch `batch`, waiting for its worker; rethrows what its fetch threw.
  Batch take(std::int64_t batch) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return ready_.count(batch) > 0; });
    auto node = ready_.extract(batch);
    next_to_take_ = batch + 1;
    lock.unlock();
    changed_.notify_all();  // room for one more ahead
    if (node.mapped().second) std::rethrow_exception(node.mapped().second);
    return std::move(node.mapped().first);
  }

 private:
  void work() {
    for (;;) {
      std::int64_t batch = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || next_to_fetch_ >= end_ || next_to_fetch_ < next_to_take_ + depth_; });
        if (stop_ || next_to_fetch_ >= end_) return;
        batch = next_to_fetch_++;
      }
      std::pair<Batch, std::exception_ptr> result;
      try {
        result.first = fetch_(batch);
      } catch (...) {
        result.second = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ready_.emplace(batch, std::move(result));
      }
      changed_.notify_all();
    }
  }

  std::function<Batch(std::int64_t)> fetch_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::int64_t, std::pair<Batch, std::exception_ptr>> ready_;
  std::int64_t next_to_fetch_, next_to_take_, end_;
  int depth_;
  bool stop_ = false;
  std::vector<std::thread> threads_;  // last: started once everything above exists
};

}  // namespace accel::data
