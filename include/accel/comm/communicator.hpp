#pragma once
// The process group a job communicates over: a c10d TCPStore for rendezvous
// and a real c10d backend (Gloo on CPU, NCCL on CUDA when LibTorch has it).
// Every blocking wait goes through `Pending::wait`, so a failed or timed-out
// collective becomes a CollectiveError naming the operation and the rank.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <csignal>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/address.hpp"
#include "accel/comm/environment.hpp"
#include "accel/comm/flight_recorder.hpp"
#include "accel/comm/liveness.hpp"
#include "accel/comm/traffic.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/profiling/range.hpp"

namespace gloo::transport {
class Device;
}

namespace accel::comm {

/// A collective failed: a peer died, timed out, or the backend refused it.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// In debug mode: the ranks of a group were about to call different
/// collectives, or the same one with different shapes (NOTE [Debug mode]).
class CollectiveMismatch : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

enum class BackendKind { gloo, nccl };

/// One in-flight collective; `wait()` turns a backend failure into a message
/// that says which rank waited for what (the group's n-th collective), and
/// which ranks are gone (NOTE [Naming the dead rank]).
class Pending {
 public:
  /// What a failure message says about the collective.
  struct Context {
    std::string what;
    int rank = 0;                 ///< in the world
    std::uint64_t sequence = 0;   ///< the how-manyth collective of its group
    bool point_to_point = false;  ///< a send or receive, issued after collective #sequence
    std::shared_ptr<Liveness> liveness{};
    std::uint64_t record = 0;  ///< its entry in the flight recorder (NOTE [Flight recorder])
    std::chrono::milliseconds timeout{0};  ///< the communicator's collective timeout
  };

  Pending() = default;
  /// `timeout` for work whose options carry none (send/recv): `wait` bounds
  /// itself by it instead of the backend's default (0: the backend's own bound).
  Pending(c10::intrusive_ptr<compat::Work> work, Context context,
          std::chrono::milliseconds timeout = std::chrono::milliseconds(0))
      : work_(std::move(work)), context_(std::move(context)), timeout_(timeout) {}

  bool valid() const { return static_cast<bool>(work_); }

  void wait();

 private:
  c10::intrusive_ptr<compat::Work> work_;
  Context context_;
  std::chrono::milliseconds timeout_{0};  // 0 is c10d's kNoTimeout
};

/// A process group with accel's error reporting. Default-constructed it is
/// the one-process "group", on which every collective is the identity.
/// Each collective, and each wait for one, is a named range in a profiler
/// trace (profiling/profiler.hpp).
///
/// The connection is made once per process and shared by every Communicator
/// (Accelerate's PartialState, torch.distributed's default group): a second
/// Trainer in the same program reuses it instead of racing a second
/// rendezvous on the same port. Each Communicator still has its own timeout,
/// passed to every collective it issues.
class Communicator {
 public:
  Communicator() = default;

  /// Rendezvous at `info.master_addr:master_port` (rank 0 hosts the store)
  /// and connect every rank. Fails with a message naming the rank and the
  /// address when a peer does not arrive within `timeout` (at least a
  /// minute: see rendezvous_timeout).
  static Communicator connect(const WorldInfo& info, BackendKind kind, std::chrono::milliseconds timeout) {
    Communicator comm;
    comm.rank_ = info.rank;
    comm.world_rank_ = info.rank;
    comm.size_ = info.world_size;
    comm.timeout_ = timeout;
    comm.kind_ = kind;
    if (info.world_size > 1) comm.group_ = shared_group(info, kind, timeout);
    return comm;
  }

  /// A process group of `ranks` (indices in this group, ascending; this rank
  /// among them), connected over the same store under `name`, which must be
  /// the same on every member and unique per group. Every member calls it;
  /// non-members do not. The sub-group inherits the timeout. Calling it
  /// again with the same name (a second trainer in the program) makes a new
  /// group: the n-th call on every member connects under the n-th prefix.
  Communicator subgroup(const std::string& name, const std::vector<int>& ranks) const;

  int rank() const { return rank_; }
  int size() const { return size_; }

  /// Debug mode: before each collective the ranks check that they agree on
  /// it, and raise CollectiveMismatch with every rank's view where they do
  /// not (NOTE [Debug mode]). Every rank must set the same; sub-groups made
  /// afterwards inherit it. The Trainer sets it from TrainerOptions::debug
  /// or ACCELERATE_DEBUG_MODE (`accel launch --debug`).
  void set_debug(bool on) { debug_ = on; }
  bool debug() const { return debug_; }
  bool distributed() const { return size_ > 1; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Which backend the collectives run on: comm/collectives.hpp picks NCCL's
  /// native flat collectives or Gloo's built ones by it.
  BackendKind backend_kind() const { return kind_; }
  compat::CollectiveBackend& backend() const { return *group_->backend; }
  /// Collectives this handle has issued (tests count them: gradient
  /// accumulation must issue none on its non-final micro-steps).
  std::uint64_t collectives_issued() const { return issued_; }
  /// Bytes of the tensors this handle has all-reduced (sum), for
  /// communication-volume benchmarks.
  std::uint64_t all_reduce_bytes() const { return all_reduce_bytes_; }

  /// Sum across ranks, in place, asynchronously.
  Pending all_reduce_async(at::Tensor& tensor, std::string what);

  void all_reduce(at::Tensor& tensor, const std::string& what);

  /// Element-wise maximum across ranks, in place.
  void all_reduce_max(at::Tensor& tensor, const std::string& what);

  void broadcast(at::Tensor& tensor, int root, const std::string& what);

  /// Every rank's tensor (all the same shape), in rank order.
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor, const std::string& what);

  /// Point-to-point send of a contiguous tensor to rank `dst`. c10d's send
  /// takes no options, so the timeout is applied when the result is waited on.
  Pending send_async(const at::Tensor& tensor, int dst, int tag, std::string what);

  /// Point-to-point receive into `tensor` (contiguous, of the sent size) from rank `src`.
  Pending recv_async(at::Tensor& tensor, int src, int tag, std::string what);

  /// All-to-all among the other ranks: `input` (1-D, contiguous) holds
  /// size() - 1 equal chunks, one for each other rank in rank order; `output`
  /// (the same) receives theirs, in rank order. Gloo's building block for
  /// reduce-scatter (comm/collectives.hpp), where this rank's own chunk needs
  /// neither the wire nor a receive slot; counted as `counted_as` of
  /// `counted` (the whole reduce-scatter's input, as NCCL's native one is
  /// counted), which debug mode also checks across ranks. Chunks travel as
  /// bytes, so any dtype does (1.13's Gloo refuses bf16, bool and int16).
  Pending all_to_all_others_async(at::Tensor& output, at::Tensor& input, std::string what, Collective counted_as,
                                  const at::Tensor& counted);

  /// All-gather in place, by one broadcast per rank: `chunks[j]` (the same
  /// shape on every rank, contiguous) receives rank j's, and this rank's own
  /// chunk already holds its data. Gloo's all-gather stages the whole output
  /// in a buffer of its own and wants an input apart from it; this needs
  /// neither, so a ZeRO parameter bucket or unit costs nothing beyond itself
  /// while it gathers. The chunks travel as bytes, so every dtype does (1.13's
  /// Gloo refuses bf16). Counted and numbered as one all-gather. Gloo's
  /// building block for comm::all_gather_rows_async; NCCL gathers natively.
  std::vector<Pending> all_gather_in_place_async(std::vector<at::Tensor>& chunks, const std::string& what);

  /// Native flat reduce-scatter (sum): `input` holds size() equal shards of
  /// `output`'s length, rank r receives the sum of shard r. NCCL has it; Gloo
  /// in LibTorch 1.13 does not (see comm/collectives.hpp). 1.13 and 2.x both
  /// call it _reduce_scatter_base (Python's reduce_scatter_tensor).
  Pending reduce_scatter_base_async(at::Tensor& output, at::Tensor& input, std::string what);

  /// Native flat all-gather: `output` is size() copies of `input`'s length,
  /// filled in rank order. NCCL has it; Gloo in LibTorch 1.13 does not. Named
  /// _allgather_base in 1.13 and 2.x (Python's all_gather_into_tensor).
  Pending all_gather_base_async(at::Tensor& output, at::Tensor& input, std::string what);

  void barrier(const std::string& what = "barrier (wait_for_everyone)");

 private:
  Pending pending(c10::intrusive_ptr<compat::Work> work, std::string what,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(0), bool point_to_point = false) const {
    return {std::move(work),
            {std::move(what), world_rank_, sequence_, point_to_point, group_ ? group_->liveness : nullptr, record_,
             timeout_},
            timeout};
  }
  static std::uint64_t bytes_of(const at::Tensor& t) { return static_cast<std::uint64_t>(t.numel()) * t.element_size(); }
  // Every collective is counted on this handle and in the process's traffic
  // (comm/traffic.hpp), numbered in its group and, in debug mode, checked.
  void count(Collective kind, std::uint64_t bytes, const at::Tensor& tensor, const std::string& what);
  void number(Collective kind, const at::Tensor& tensor, const std::string& what) {
    sequence_ = ++group_->sequence;
    if (debug_) check_agreement(kind, tensor, what);
  }

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

  // NCCL moves device memory only. The blocking helpers above also take
  // host tensors (a gradient norm, an overflow flag, a checkpoint verdict):
  // under NCCL those travel through the current GPU and back.
  bool staged(const at::Tensor& tensor) const { return kind_ == BackendKind::nccl && tensor.is_cpu(); }
  // Gloo reduces bf16 in fp32, rounding once instead of at every hop of its
  // ring (as comm/collectives.hpp's reduce-scatter sums it); 1.13's Gloo also
  // refuses bf16 outright ("Invalid scalar type"). Tensor-parallel layers
  // under BF16 all-reduce bf16 activations.
  bool widened(const at::Tensor& tensor) const {
    return kind_ == BackendKind::gloo && tensor.scalar_type() == at::kBFloat16;
  }
  // Runs `collective` on a copy of `tensor` converted to `to` (a device or a
  // dtype), then copies the result back.
  template <class To, class Collective>
  static void through(at::Tensor& tensor, To to, Collective&& collective) {
    at::Tensor converted = tensor.to(to);
    collective(converted);
    tensor.copy_(converted);
  }

  // How many sub-groups of this name this process has made in this job: the
  // store keys of an earlier group must not be read by a later one.
  static int next_generation(const std::string& name, const WorldInfo& world);

  struct Group {
    WorldInfo world;
    BackendKind kind;
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<compat::CollectiveBackend> backend;
    std::uint64_t sequence = 0;  // collectives issued on this group by this process (NOTE [Debug mode])
    std::string name = "world";  // in the flight recorder
    WorldInfo job;               // the whole job's (`world` is this group's)
    std::shared_ptr<Liveness> liveness;  // last: its heartbeat stops before the store goes

    Group() = default;
    Group(const Group&) = default;
    // Once a collective of the job failed, the backend is left to the
    // operating system: ProcessGroupGloo's destructor would wait for the
    // collectives still queued, each until the timeout (NOTE [Naming the dead rank]).
    ~Group() {
      if (liveness && liveness->failed()) (void)backend.release();
    }
  };

  // Writing to a dead peer's socket raises SIGPIPE, whose default action
  // ends the process with no message at all. Ignored (as Python does), the
  // write fails instead and the collective reports it. A handler the program
  // installed itself is left alone.
  static void ignore_sigpipe();

  // Ranks of one job start seconds apart on a loaded machine: the timeout a
  // user chose to catch a hung collective is too short to wait for a late
  // starter at the store. Every collective still passes the user's timeout
  // in its options.
  static constexpr std::chrono::milliseconds minimum_rendezvous_timeout{std::chrono::seconds(60)};
  static std::chrono::milliseconds rendezvous_timeout(std::chrono::milliseconds timeout) {
    return std::max(timeout, minimum_rendezvous_timeout);
  }

  static std::shared_ptr<Group> shared_group(const WorldInfo& info, BackendKind kind,
                                             std::chrono::milliseconds timeout);

  static c10::intrusive_ptr<compat::CollectiveBackend> make_backend(BackendKind kind,
                                                                    c10::intrusive_ptr<c10d::Store> store, int rank,
                                                                    int size, const WorldInfo& job,
                                                                    std::chrono::milliseconds timeout);

  // The address this rank's Gloo binds to and advertises (NOTE [Which
  // address a rank advertises] in comm/address.hpp): GLOO_SOCKET_IFNAME's,
  // else the one on the route to MASTER_ADDR. A loopback one while ranks run
  // on other machines would only end in "Connection refused" there.
  static std::shared_ptr<::gloo::transport::Device> gloo_device(const WorldInfo& job);

  int rank_ = 0;
  int world_rank_ = 0;  // in error messages: the rank a user launched
  int size_ = 1;
  std::chrono::milliseconds timeout_{std::chrono::minutes(5)};
  BackendKind kind_ = BackendKind::gloo;
  std::shared_ptr<Group> group_;
  std::uint64_t issued_ = 0;
  std::uint64_t sequence_ = 0;  // this handle's latest collective, numbered in its group
  std::uint64_t record_ = 0;    // its flight-recorder entry
  bool debug_ = false;
  std::uint64_t all_reduce_bytes_ = 0;
};

}  // namespace accel::comm

// The members compiled once (NOTE [Compiled once]), with the backends they make.
#if ACCEL_DEFINE_COMPILED_ONCE
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#if defined(USE_C10D_NCCL) && __has_include(<torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define ACCEL_HAS_NCCL 1
#endif

namespace accel::comm {
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE auto Communicator::subgroup(const std::string& name, const std::vector<int>& ranks) const -> Communicator {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end())
    throw std::logic_error("accel: rank " + std::to_string(rank_) + " is not a member of group '" + name + "'");
  Communicator sub;
  sub.rank_ = static_cast<int>(it - ranks.begin());
  sub.world_rank_ = world_rank_;
  sub.size_ = static_cast<int>(ranks.size());
  sub.timeout_ = timeout_;
  sub.kind_ = kind_;
  sub.debug_ = debug_;
  if (sub.size_ > 1) {
    auto group = std::make_shared<Group>(*group_);
    group->sequence = 0;
    group->world.rank = sub.rank_;
    group->world.world_size = sub.size_;
    const int generation = next_generation(name, group_->world);
    const std::string prefix = "accel/group/" + name + "/" + std::to_string(generation);
    group->name = name + (generation ? "#" + std::to_string(generation) : "");
    group->backend = make_backend(kind_, c10::make_intrusive<c10d::PrefixStore>(prefix, group_->store),
                                  sub.rank_, sub.size_, group_->job, timeout_);
    sub.group_ = std::move(group);
  }
  return sub;
}

ACCEL_COMPILED_ONCE auto Communicator::all_reduce_async(at::Tensor& tensor, std::string what) -> Pending {
  const profiling::Range range("accel::all_reduce", what);
  if (!distributed()) return {};
  count(Collective::all_reduce, bytes_of(tensor), tensor, what);
  all_reduce_bytes_ += bytes_of(tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.timeout = timeout_;
  return pending(backend().allreduce(tensors, options), std::move(what));
}

ACCEL_COMPILED_ONCE void Communicator::all_reduce(at::Tensor& tensor, const std::string& what) {
  if (!distributed()) return;
  if (staged(tensor)) return through(tensor, at::Device(at::kCUDA), [&](at::Tensor& t) { all_reduce(t, what); });
  if (widened(tensor)) return through(tensor, at::kFloat, [&](at::Tensor& t) { all_reduce(t, what); });
  all_reduce_async(tensor, what).wait();
}

ACCEL_COMPILED_ONCE void Communicator::all_reduce_max(at::Tensor& tensor, const std::string& what) {
  const profiling::Range range("accel::all_reduce_max", what);
  if (!distributed()) return;
  if (staged(tensor)) return through(tensor, at::Device(at::kCUDA), [&](at::Tensor& t) { all_reduce_max(t, what); });
  if (widened(tensor)) return through(tensor, at::kFloat, [&](at::Tensor& t) { all_reduce_max(t, what); });
  count(Collective::all_reduce, bytes_of(tensor), tensor, what + " (maximum)");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  options.timeout = timeout_;
  pending(backend().allreduce(tensors, options), what).wait();
}

ACCEL_COMPILED_ONCE void Communicator::broadcast(at::Tensor& tensor, int root, const std::string& what) {
  const profiling::Range range("accel::broadcast", what);
  if (!distributed()) return;
  if (staged(tensor)) return through(tensor, at::Device(at::kCUDA), [&](at::Tensor& t) { broadcast(t, root, what); });
  count(Collective::broadcast, bytes_of(tensor), tensor, what + " (from rank " + std::to_string(root) + ")");
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = timeout_;
  pending(backend().broadcast(tensors, options), what).wait();
}

ACCEL_COMPILED_ONCE auto Communicator::all_gather(const at::Tensor& tensor, const std::string& what) -> std::vector<at::Tensor> {
  const profiling::Range range("accel::all_gather", what);
  if (!distributed()) return {tensor};
  if (staged(tensor)) {
    auto parts = all_gather(tensor.to(at::Device(at::kCUDA)), what);
    for (auto& part : parts) part = part.to(at::kCPU);
    return parts;
  }
  if (backend_kind() == BackendKind::gloo)
    if (const auto carrier = compat::gloo_all_gather_carrier(tensor.scalar_type())) {
      auto parts = all_gather(tensor.to(*carrier), what);
      for (auto& part : parts) part = part.to(tensor.scalar_type());
      return parts;
    }
  count(Collective::all_gather, bytes_of(tensor) * static_cast<std::uint64_t>(size_), tensor, what);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size_; ++r) outputs[0].push_back(at::empty_like(tensor));
  std::vector<at::Tensor> inputs{tensor.contiguous()};
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  pending(backend().allgather(outputs, inputs, options), what).wait();
  return outputs[0];
}

ACCEL_COMPILED_ONCE auto Communicator::send_async(const at::Tensor& tensor, int dst, int tag, std::string what) -> Pending {
  const profiling::Range range("accel::send", what);
  count(Collective::send, bytes_of(tensor), tensor, what);
  std::vector<at::Tensor> tensors{tensor};
  auto work = backend().send(tensors, dst, tag);
  return pending(std::move(work), std::move(what), timeout_, true);
}

ACCEL_COMPILED_ONCE auto Communicator::recv_async(at::Tensor& tensor, int src, int tag, std::string what) -> Pending {
  const profiling::Range range("accel::recv", what);
  count(Collective::recv, bytes_of(tensor), tensor, what);
  std::vector<at::Tensor> tensors{tensor};
  return pending(backend().recv(tensors, src, tag), std::move(what), timeout_, true);
}

ACCEL_COMPILED_ONCE auto Communicator::all_to_all_others_async(at::Tensor& output, at::Tensor& input, std::string what, Collective counted_as, const at::Tensor& counted) -> Pending {
  const profiling::Range range("accel::all_to_all", what);
  count(counted_as, bytes_of(counted), counted, what);
  const std::int64_t chunk = input.numel() / std::max(1, size_ - 1) * input.element_size();  // bytes
  // Two vectors: LibTorch 1.13's Gloo work moves from each argument.
  std::vector<std::int64_t> output_splits(size_, chunk), input_splits(size_, chunk);
  output_splits[rank_] = input_splits[rank_] = 0;
  at::Tensor output_bytes = output.view(at::kByte), input_bytes = input.view(at::kByte);
  c10d::AllToAllOptions options;
  options.timeout = timeout_;
  return pending(backend().alltoall_base(output_bytes, input_bytes, output_splits, input_splits, options),
                 std::move(what), timeout_);
}

ACCEL_COMPILED_ONCE auto Communicator::all_gather_in_place_async(std::vector<at::Tensor>& chunks, const std::string& what) -> std::vector<Pending> {
  const profiling::Range range("accel::all_gather", what);
  if (static_cast<int>(chunks.size()) != size_)
    throw std::invalid_argument("accel: all_gather_in_place_async (" + what + "): " + std::to_string(chunks.size()) +
                                " chunks for a group of " + std::to_string(size_));
  count(Collective::all_gather, bytes_of(chunks[rank_]) * chunks.size(), chunks[rank_], what);
  std::vector<Pending> out;
  for (int j = 0; j < size_; ++j) {
    std::vector<at::Tensor> bytes{chunks[j].view({-1}).view(at::kByte)};
    c10d::BroadcastOptions options;
    options.rootRank = j;
    options.timeout = timeout_;
    out.push_back(
        pending(backend().broadcast(bytes, options), what + " (rank " + std::to_string(j) + "'s chunk)", timeout_));
  }
  return out;
}

ACCEL_COMPILED_ONCE auto Communicator::reduce_scatter_base_async(at::Tensor& output, at::Tensor& input, std::string what) -> Pending {
  const profiling::Range range("accel::reduce_scatter", what);
  count(Collective::reduce_scatter, bytes_of(input), input, what);
  c10d::ReduceScatterOptions options;  // reduceOp defaults to SUM (a struct in 2.x, an enum in 1.13)
  options.timeout = timeout_;
  return pending(backend()._reduce_scatter_base(output, input, options), std::move(what));
}

ACCEL_COMPILED_ONCE auto Communicator::all_gather_base_async(at::Tensor& output, at::Tensor& input, std::string what) -> Pending {
  const profiling::Range range("accel::all_gather", what);
  count(Collective::all_gather, bytes_of(output), input, what);
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  return pending(backend()._allgather_base(output, input, options), std::move(what));
}

ACCEL_COMPILED_ONCE void Communicator::barrier(const std::string& what) {
  const profiling::Range range("accel::barrier", what);
  if (!distributed()) return;
  count(Collective::barrier, 0, at::Tensor(), what);
  c10d::BarrierOptions options;
  options.timeout = timeout_;
  pending(backend().barrier(options), what).wait();
}

ACCEL_COMPILED_ONCE void Communicator::count(Collective kind, std::uint64_t bytes, const at::Tensor& tensor, const std::string& what) {
  ++issued_;
  record_collective(kind, bytes);
  record_ = 0;  // the debug check below is no entry of its own
  const bool point_to_point = kind == Collective::send || kind == Collective::recv;
  if (!point_to_point) number(kind, tensor, what);  // sends and receives pair two ranks, not the group
  record_ = FlightRecorder::instance().issue(group_->name, sequence_, point_to_point, collective_name(kind), what,
                                             bytes);
}

ACCEL_COMPILED_ONCE auto Communicator::signature(Collective kind, const at::Tensor& tensor, const std::string& what) const -> std::string {
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

ACCEL_COMPILED_ONCE void Communicator::check_agreement(Collective kind, const at::Tensor& tensor, const std::string& what) {
  const std::string mine = signature(kind, tensor, what);
  at::Tensor wire = at::zeros({signature_bytes}, at::TensorOptions().dtype(at::kByte));
  std::copy(mine.begin(), mine.end(), wire.data_ptr<std::uint8_t>());
  if (kind_ == BackendKind::nccl) wire = wire.to(at::Device(at::kCUDA));
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size_; ++r) outputs[0].push_back(at::empty_like(wire));
  std::vector<at::Tensor> inputs{wire};
  record_collective(Collective::all_gather, static_cast<std::uint64_t>(signature_bytes * size_));
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
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
  std::string message = "accel: rank " + std::to_string(world_rank_) + ": the ranks of a group of " +
                        std::to_string(size_) + " disagree on its collective #" + std::to_string(sequence_) +
                        " (debug mode):";
  for (int r = 0; r < size_; ++r)
    message += "\n  rank " + std::to_string(r) + (r == rank_ ? " (this rank)" : "") + ": " + views[r];
  message +=
      "\nEvery rank of a group must call the same collectives in the same order with the same shapes "
      "(is one called under `if (is_main_process())`, or skipped on some ranks?)";
  FlightRecorder::instance().dump(world_rank_);
  throw CollectiveMismatch(message);
}

ACCEL_COMPILED_ONCE auto Communicator::next_generation(const std::string& name, const WorldInfo& world) -> int {
  static std::mutex mutex;
  static std::map<std::string, int> made;
  std::lock_guard<std::mutex> lock(mutex);
  return made[world.master_addr + ":" + std::to_string(world.master_port) + "/" + name]++;
}

ACCEL_COMPILED_ONCE void Communicator::ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

ACCEL_COMPILED_ONCE auto Communicator::shared_group(const WorldInfo& info, BackendKind kind, std::chrono::milliseconds timeout) -> std::shared_ptr<Group> {
  static std::mutex mutex;
  static std::vector<std::shared_ptr<Group>> groups;
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& g : groups)
    if (g->kind == kind && g->world.rank == info.rank && g->world.world_size == info.world_size &&
        g->world.master_addr == info.master_addr && g->world.master_port == info.master_port)
      return g;
  ignore_sigpipe();
  FlightRecorder::install_signal_handler();
  auto group = std::make_shared<Group>();
  group->world = info;
  group->kind = kind;
  const std::string where = info.master_addr + ":" + std::to_string(info.master_port);
  try {
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(info.master_port);
    options.isServer = info.rank == 0;
    options.numWorkers = static_cast<std::size_t>(info.world_size);
    options.waitWorkers = true;
    options.timeout = rendezvous_timeout(timeout);
    group->store = c10::make_intrusive<c10d::TCPStore>(info.master_addr, options);
  } catch (const std::exception& e) {
    throw CollectiveError("accel: rank " + std::to_string(info.rank) + ": rendezvous at " + where +
                          " failed (is MASTER_ADDR/MASTER_PORT right, the port free, every rank started?): " +
                          e.what());
  }
  group->job = info;
  group->backend = make_backend(kind, c10::make_intrusive<c10d::PrefixStore>("accel/world", group->store),
                                info.rank, info.world_size, info, timeout);
  group->liveness = std::make_shared<Liveness>(info.master_addr, info.master_port, info.rank, info.world_size, timeout);
  groups.push_back(group);
  return group;
}

ACCEL_COMPILED_ONCE auto Communicator::make_backend(BackendKind kind, c10::intrusive_ptr<c10d::Store> store, int rank, int size, const WorldInfo& job, std::chrono::milliseconds timeout) -> c10::intrusive_ptr<compat::CollectiveBackend> {
  try {
    if (kind == BackendKind::nccl) {
#ifdef ACCEL_HAS_NCCL
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = timeout;
      return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
      throw CollectiveError("accel: this LibTorch was built without NCCL; use accel::CPU (Gloo) or a CUDA LibTorch");
#endif
    }
    // Connecting waits for every rank: where each operation carries its own
    // timeout, the group's is the rendezvous's.
    auto options = c10d::ProcessGroupGloo::Options::create(
        compat::gloo_has_per_operation_timeout ? rendezvous_timeout(timeout) : timeout);
    options->devices.push_back(gloo_device(job));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError("accel: rank " + std::to_string(rank) + ": connecting the " +
                          (kind == BackendKind::nccl ? "NCCL" : "Gloo") + " process group of " +
                          std::to_string(size) + " ranks failed: " + e.what());
  }
}

ACCEL_COMPILED_ONCE auto Communicator::gloo_device(const WorldInfo& job) -> std::shared_ptr<::gloo::transport::Device> {
  std::shared_ptr<::gloo::transport::Device> device;
  std::optional<std::string> address;
  std::string source;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    device = c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    address = interface_address(ifname);
    source = std::string("GLOO_SOCKET_IFNAME=") + ifname;
  } else if ((address = local_address_towards(job.master_addr, job.master_port))) {
    device = c10d::ProcessGroupGloo::createDeviceForHostname(*address);
    source = "the route to MASTER_ADDR=" + job.master_addr;
  } else {
    device = c10d::ProcessGroupGloo::createDefaultDevice();
  }
  // A loopback MASTER_ADDR says every "machine" is this one (launchers side by side).
  const bool one_host = is_loopback_address(job.master_addr) || job.master_addr == "localhost";
  if (address && is_loopback_address(*address) && job.local_world_size < job.world_size && !one_host)
    throw CollectiveError("accel: rank " + std::to_string(job.rank) + " would advertise the loopback address " +
                          *address + " (from " + source + ") to the ranks on other machines (" +
                          std::to_string(job.local_world_size) + " of the " + std::to_string(job.world_size) +
                          " ranks run on this one): set MASTER_ADDR (--main_process_ip) to an address the other "
                          "machines reach, or GLOO_SOCKET_IFNAME to the interface that faces them");
  return device;
}

ACCEL_COMPILED_ONCE void Pending::wait() {
  if (!work_) return;
  const profiling::Range range("accel::wait", context_.what);  // time blocked, named, in a profiler trace
  auto work = std::move(work_);
  const auto start = std::chrono::steady_clock::now();
  try {
    work->wait(timeout_);
    record_blocked(std::chrono::steady_clock::now() - start);
    FlightRecorder::instance().finish(context_.record, true);
  } catch (const std::exception& e) {
    record_blocked(std::chrono::steady_clock::now() - start);
    FlightRecorder::instance().finish(context_.record, false);
    FlightRecorder::instance().dump(context_.rank);
    if (context_.liveness) context_.liveness->mark_failed();
    const bool at_once = context_.timeout.count() > 0 && std::chrono::steady_clock::now() - start < context_.timeout / 2;
    const std::string gone = context_.liveness ? context_.liveness->diagnose(at_once) : "";
    throw CollectiveError("accel: rank " + std::to_string(context_.rank) + ": " + context_.what + " (" +
                          (context_.point_to_point ? "after " : "") + "collective #" +
                          std::to_string(context_.sequence) + " of its group) failed: " +
                          (gone.empty() ? "a peer died, or it ran past the collective timeout" : gone) + ": " +
                          e.what());
  }
}

}  // namespace accel::comm
#endif
