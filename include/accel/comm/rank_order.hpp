#pragma once
// Accelerate's cross-rank helpers that order or agree, built on the world
// communicator: main_process_first (one rank runs a block before the others:
// download, tokenise, write a cache) and set_trigger / check_trigger (any
// rank raises a flag, all ranks see it at the same step, e.g. to stop on a NaN).

#include <ATen/ops/full.h>

#include <exception>

#include "accel/comm/communicator.hpp"

namespace accel::comm {

/// The block this object lives in runs on the `first` ranks before the
/// others: those wait at a barrier on entry, the first ranks join it on
/// exit. Each rank passes one barrier. If the first rank's block throws,
/// it leaves without the barrier, and the others fail within the timeout
/// instead of running on what it did not finish.
class GoesFirst {
 public:
  GoesFirst(Communicator& world, bool first) : world_(world), first_(first), exceptions_(std::uncaught_exceptions()) {
    if (!first_) world_.barrier("barrier of main_process_first (waiting for the main process's block)");
  }
  ~GoesFirst() noexcept(false) {
    if (first_ && std::uncaught_exceptions() == exceptions_)
      world_.barrier("barrier of main_process_first (the main process's block is done)");
  }
  GoesFirst(const GoesFirst&) = delete;
  GoesFirst& operator=(const GoesFirst&) = delete;

 private:
  Communicator& world_;
  bool first_;
  int exceptions_;
};

/// A flag any rank may raise and every rank reads together (one 4-byte
/// all-reduce per check): Accelerate's set_trigger / check_trigger.
class Trigger {
 public:
  void set() { raised_ = true; }
  /// Whether any rank raised the flag since the last check; every rank must
  /// call it at the same point. Resets the flag everywhere.
  bool check(Communicator& world) {
    at::Tensor flag = at::full({1}, raised_ ? 1 : 0, at::TensorOptions().dtype(at::kInt));
    world.all_reduce_max(flag, "all-reduce of check_trigger's flag");
    raised_ = false;
    return flag.item<int>() != 0;
  }

 private:
  bool raised_ = false;
};

}  // namespace accel::comm
