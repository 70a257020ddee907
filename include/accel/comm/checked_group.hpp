#pragma once
// The layer every collective of a Communicator passes through on its way to
// the backend (c10d's ProcessGroupWrapper is the model): it counts the
// collective on its handle and in the process's traffic (comm/traffic.hpp),
// numbers it in its group, checks in debug mode that every rank is about to
// call the same one (NOTE [Debug mode]), enters it in the flight recorder
// (NOTE [Flight recorder]), and turns the backend's Work into a Pending whose
// failure names the collective and the rank. Nothing here knows which
// backend runs underneath, except through its adapter.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "accel/comm/pending.hpp"
#include "accel/comm/rendezvous.hpp"
#include "accel/comm/traffic.hpp"
#include "accel/core/compiled_once.hpp"

namespace accel::comm {

/// One member's view of a connected group, with the checks and accounting
/// of everything it issues. Default-constructed: the one-process group.
class CheckedGroup {
 public:
  /// Where this process is in the group.
  struct Member {
    int rank = 0;        ///< in this group
    int world_rank = 0;  ///< in error messages: the rank a user launched
    int size = 1;
    std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  };

  CheckedGroup() = default;
  CheckedGroup(Member member, std::shared_ptr<Connection> connection, bool debug)
      : member_(member), connection_(std::move(connection)), debug_(debug) {}

  const Member& member() const { return member_; }
  const std::shared_ptr<Connection>& connection() const { return connection_; }
  compat::CollectiveBackend& backend() const { return *connection_->backend; }

  void set_debug(bool on) { debug_ = on; }
  bool debug() const { return debug_; }
  std::uint64_t issued() const { return issued_; }
  std::uint64_t all_reduce_bytes() const { return all_reduce_bytes_; }

  /// Before issuing a collective of `kind` moving `bytes` (traffic.hpp's
  /// convention), shaped as `tensor`, for `what`: counts, numbers, checks
  /// (debug mode) and records it. Sends and receives pair two ranks, not
  /// the group: counted and recorded, neither numbered nor checked.
  void announce(Collective kind, std::uint64_t bytes, const at::Tensor& tensor, const std::string& what);

  /// The backend's `work` for the collective announced last, as a Pending
  /// named `what`. `timeout`: for work whose options carry none (send/recv).
  Pending pending(c10::intrusive_ptr<compat::Work> work, std::string what,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(0), bool point_to_point = false) const {
    return {std::move(work),
            {std::move(what), member_.world_rank, sequence_, point_to_point,
             connection_ ? connection_->liveness : nullptr, record_, member_.timeout},
            timeout};
  }

 private:
  // NOTE [Debug mode]
  // A collective that one rank skips, or calls with another shape, does not
  // fail: the ranks pair it with whatever the others call next, and the job
  // hangs or trains on the wrong data. In debug mode (Accelerate's
  // ACCELERATE_DEBUG_MODE / verify_operation, PyTorch's
  // TORCH_DISTRIBUTED_DEBUG=DETAIL) every rank first all-gathers a fixed-size
  // signature of what it is about to call (operation, number in its group,
  // dtype and shape, what it is for) and compares: on a mismatch every rank
  // raises with each rank's view. It costs one small all-gather per
  // collective (counted in the process's traffic, not in the group's
  // numbering); off, one branch. Point-to-point sends and receives pair two
  // ranks, not the group, and are neither numbered nor checked.
  static constexpr std::int64_t signature_bytes = 240;

  std::string signature(Collective kind, const at::Tensor& tensor, const std::string& what) const;
  void check_agreement(Collective kind, const at::Tensor& tensor, const std::string& what);

  Member member_{};
  std::shared_ptr<Connection> connection_;
  bool debug_ = false;
  std::uint64_t issued_ = 0;
  std::uint64_t sequence_ = 0;  // this handle's latest collective, numbered in its group
  std::uint64_t record_ = 0;    // its flight-recorder entry
  std::uint64_t all_reduce_bytes_ = 0;
};

}  // namespace accel::comm

#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <vector>

namespace accel::comm {
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE void CheckedGroup::announce(Collective kind, std::uint64_t bytes, const at::Tensor& tensor,
                                                const std::string& what) {
  ++issued_;
  if (kind == Collective::all_reduce) all_reduce_bytes_ += bytes;
  record_collective(kind, bytes);
  record_ = 0;  // the debug check below is no entry of its own
  const bool point_to_point = kind == Collective::send || kind == Collective::recv;
  if (!point_to_point) {
    sequence_ = ++connection_->sequence;
    if (debug_) check_agreement(kind, tensor, what);
  }
  record_ = FlightRecorder::instance().issue(connection_->name, sequence_, point_to_point, collective_name(kind),
                                             what, bytes);
}

ACCEL_COMPILED_ONCE auto CheckedGroup::signature(Collective kind, const at::Tensor& tensor,
                                                 const std::string& what) const -> std::string {
  std::string text = std::string(collective_name(kind)) + " #" + std::to_string(sequence_);
  if (tensor.defined()) {
    text += std::string(" ") + c10::toString(tensor.scalar_type()) + "[";
    for (std::int64_t d = 0; d < tensor.dim(); ++d) text += (d ? ", " : "") + std::to_string(tensor.size(d));
    text += "]";
  }
  text += " for " + what;
  if (text.size() > static_cast<std::size_t>(signature_bytes)) text.resize(signature_bytes);
  return text;
}

ACCEL_COMPILED_ONCE void CheckedGroup::check_agreement(Collective kind, const at::Tensor& tensor,
                                                       const std::string& what) {
  const std::string mine = signature(kind, tensor, what);
  at::Tensor host = at::zeros({signature_bytes}, at::TensorOptions().dtype(at::kByte));
  std::copy(mine.begin(), mine.end(), host.data_ptr<std::uint8_t>());
  at::Tensor wire = connection_->adapter->on_wire(host);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < member_.size; ++r) outputs[0].push_back(at::empty_like(wire));
  std::vector<at::Tensor> inputs{wire};
  record_collective(Collective::all_gather, static_cast<std::uint64_t>(signature_bytes * member_.size));
  c10d::AllgatherOptions options;
  options.timeout = member_.timeout;
  pending(backend().allgather(outputs, inputs, options), "debug-mode check before " + what).wait();
  std::vector<std::string> views;
  bool agree = true;
  for (auto& part : outputs[0]) {
    const at::Tensor bytes = part.to(at::kCPU);
    const auto* data = bytes.data_ptr<std::uint8_t>();
    views.emplace_back(reinterpret_cast<const char*>(data), std::find(data, data + signature_bytes, 0) - data);
    agree = agree && views.back() == mine;
  }
  if (agree) return;
  std::string message = "accel: rank " + std::to_string(member_.world_rank) + ": the ranks of a group of " +
                        std::to_string(member_.size) + " disagree on its collective #" +
                        std::to_string(sequence_) + " (debug mode):";
  for (int r = 0; r < member_.size; ++r)
    message += "\n  rank " + std::to_string(r) + (r == member_.rank ? " (this rank)" : "") + ": " + views[r];
  message +=
      "\nEvery rank of a group must call the same collectives in the same order with the same shapes "
      "(is one called under `if (is_main_process())`, or skipped on some ranks?)";
  FlightRecorder::instance().dump(member_.world_rank);
  throw CollectiveMismatch(message);
}

}  // namespace accel::comm
#endif
