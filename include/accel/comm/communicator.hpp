#pragma once
// The handle a job communicates through: the collectives accel issues, on a
// c10d process group (Gloo on CPU, NCCL on CUDA when LibTorch has it). It
// is cut along c10d's own seams:
//   comm/rendezvous.hpp     the ranks meet at a TCPStore and connect (once per process)
//   comm/gloo_adapter.hpp,  one adapter per backend: how a tensor travels on it
//   comm/nccl_adapter.hpp   and the sharded collectives built from its primitives
//   comm/checked_group.hpp  what every collective passes through: counting,
//                           numbering, debug-mode agreement, the flight recorder
//   comm/pending.hpp        a collective in flight; failures name the rank
// This file is the handle that joins them; no code here branches on the backend.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/comm/backend_adapter.hpp"
#include "accel/comm/checked_group.hpp"
#include "accel/comm/environment.hpp"
#include "accel/comm/pending.hpp"
#include "accel/comm/rendezvous.hpp"
#include "accel/comm/traffic.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/profiling/range.hpp"

namespace accel::comm {

/// A handle on a process group: the collectives accel issues, each through
/// the checked layer (comm/checked_group.hpp) to the backend, with the
/// backend's rules for how a tensor travels taken from its adapter.
/// Default-constructed it is the one-process "group", on which every
/// collective is the identity. Each collective, and each wait for one, is a
/// named range in a profiler trace (profiling/profiler.hpp).
///
/// The connection is made once per process and shared by every Communicator
/// (comm/rendezvous.hpp). Each Communicator still has its own timeout,
/// passed to every collective it issues.
class Communicator {
 public:
  Communicator() = default;

  /// Rendezvous at `info.master_addr:master_port` (rank 0 hosts the store)
  /// and connect every rank. Fails with a message naming the rank and the
  /// address when a peer does not arrive within `timeout` (at least a
  /// minute: see rendezvous_timeout).
  static Communicator connect(const WorldInfo& info, BackendKind kind, std::chrono::milliseconds timeout);

  /// A process group of `ranks` (indices in this group, ascending; this rank
  /// among them), connected over the same store under `name`, which must be
  /// the same on every member and unique per group. Every member calls it;
  /// non-members do not. The sub-group inherits the timeout. Calling it
  /// again with the same name (a second trainer in the program) makes a new
  /// group: the n-th call on every member connects under the n-th prefix.
  Communicator subgroup(const std::string& name, const std::vector<int>& ranks) const;

  int rank() const { return group_.member().rank; }
  int size() const { return group_.member().size; }

  /// Debug mode: before each collective the ranks check that they agree on
  /// it, and raise CollectiveMismatch with every rank's view where they do
  /// not (NOTE [Debug mode]). Every rank must set the same; sub-groups made
  /// afterwards inherit it. The Trainer sets it from TrainerOptions::debug
  /// or ACCELERATE_DEBUG_MODE (`accel launch --debug`).
  void set_debug(bool on) { group_.set_debug(on); }
  bool debug() const { return group_.debug(); }
  bool distributed() const { return size() > 1; }
  std::chrono::milliseconds timeout() const { return group_.member().timeout; }
  /// The backend's rules and sharded collectives (comm/gloo_adapter.hpp,
  /// comm/nccl_adapter.hpp): comm/collectives.hpp asks it which to use.
  const BackendAdapter& adapter() const { return adapter_ ? *adapter_ : adapter_for(BackendKind::gloo); }
  compat::CollectiveBackend& backend() const { return group_.backend(); }
  /// Collectives this handle has issued (tests count them: gradient
  /// accumulation must issue none on its non-final micro-steps).
  std::uint64_t collectives_issued() const { return group_.issued(); }
  /// Bytes of the tensors this handle has all-reduced (sum or maximum), for
  /// communication-volume benchmarks.
  std::uint64_t all_reduce_bytes() const { return group_.all_reduce_bytes(); }

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
  static std::uint64_t bytes_of(const at::Tensor& t) { return static_cast<std::uint64_t>(t.numel()) * t.element_size(); }
  // Runs `collective` on a copy of `tensor` as `route` says it travels, then
  // copies the result back.
  template <class Collective>
  static void through(at::Tensor& tensor, const Route& route, Collective&& collective) {
    at::Tensor converted = route.applied_to(tensor);
    collective(converted);
    tensor.copy_(converted);
  }

  CheckedGroup group_;
  const BackendAdapter* adapter_ = nullptr;
};

}  // namespace accel::comm

// The adapters, declared after the handle their collectives take.
#include "accel/comm/gloo_adapter.hpp"
#include "accel/comm/nccl_adapter.hpp"

#if ACCEL_DEFINE_COMPILED_ONCE
namespace accel::comm {
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE const BackendAdapter& adapter_for(BackendKind kind) {
  static const GlooAdapter gloo;
  static const NcclAdapter nccl;
  if (kind == BackendKind::nccl) return nccl;
  return gloo;
}

ACCEL_COMPILED_ONCE auto Communicator::connect(const WorldInfo& info, BackendKind kind,
                                               std::chrono::milliseconds timeout) -> Communicator {
  Communicator comm;
  comm.adapter_ = &adapter_for(kind);
  const CheckedGroup::Member member{info.rank, info.rank, info.world_size, timeout};
  comm.group_ = CheckedGroup(member, info.world_size > 1 ? connect_job(info, *comm.adapter_, timeout) : nullptr, false);
  return comm;
}

ACCEL_COMPILED_ONCE auto Communicator::subgroup(const std::string& name, const std::vector<int>& ranks) const -> Communicator {
  const auto& me = group_.member();
  auto it = std::find(ranks.begin(), ranks.end(), me.rank);
  if (it == ranks.end())
    throw std::logic_error("accel: rank " + std::to_string(me.rank) + " is not a member of group '" + name + "'");
  Communicator sub;
  sub.adapter_ = adapter_;
  const CheckedGroup::Member member{static_cast<int>(it - ranks.begin()), me.world_rank, static_cast<int>(ranks.size()),
                                    me.timeout};
  std::shared_ptr<Connection> connection;
  if (member.size > 1) connection = connect_subgroup(*group_.connection(), name, member.rank, member.size, me.timeout);
  sub.group_ = CheckedGroup(member, std::move(connection), group_.debug());
  return sub;
}

ACCEL_COMPILED_ONCE auto Communicator::all_reduce_async(at::Tensor& tensor, std::string what) -> Pending {
  const profiling::Range range("accel::all_reduce", what);
  if (!distributed()) return {};
  group_.announce(Collective::all_reduce, bytes_of(tensor), tensor, what);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.timeout = timeout();
  return group_.pending(backend().allreduce(tensors, options), std::move(what));
}

ACCEL_COMPILED_ONCE void Communicator::all_reduce(at::Tensor& tensor, const std::string& what) {
  if (!distributed()) return;
  if (const auto route = adapter().route(Carried::reduced, tensor); !route.as_is())
    return through(tensor, route, [&](at::Tensor& t) { all_reduce(t, what); });
  all_reduce_async(tensor, what).wait();
}

ACCEL_COMPILED_ONCE void Communicator::all_reduce_max(at::Tensor& tensor, const std::string& what) {
  const profiling::Range range("accel::all_reduce_max", what);
  if (!distributed()) return;
  if (const auto route = adapter().route(Carried::reduced, tensor); !route.as_is())
    return through(tensor, route, [&](at::Tensor& t) { all_reduce_max(t, what); });
  group_.announce(Collective::all_reduce, bytes_of(tensor), tensor, what + " (maximum)");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  options.timeout = timeout();
  group_.pending(backend().allreduce(tensors, options), what).wait();
}

ACCEL_COMPILED_ONCE void Communicator::broadcast(at::Tensor& tensor, int root, const std::string& what) {
  const profiling::Range range("accel::broadcast", what);
  if (!distributed()) return;
  if (const auto route = adapter().route(Carried::broadcast, tensor); !route.as_is())
    return through(tensor, route, [&](at::Tensor& t) { broadcast(t, root, what); });
  group_.announce(Collective::broadcast, bytes_of(tensor), tensor, what + " (from rank " + std::to_string(root) + ")");
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = timeout();
  group_.pending(backend().broadcast(tensors, options), what).wait();
}

ACCEL_COMPILED_ONCE auto Communicator::all_gather(const at::Tensor& tensor, const std::string& what) -> std::vector<at::Tensor> {
  const profiling::Range range("accel::all_gather", what);
  if (!distributed()) return {tensor};
  if (const auto route = adapter().route(Carried::gathered, tensor); !route.as_is()) {
    auto parts = all_gather(route.applied_to(tensor), what);
    for (auto& part : parts) part = part.to(tensor.device(), tensor.scalar_type());
    return parts;
  }
  group_.announce(Collective::all_gather, bytes_of(tensor) * static_cast<std::uint64_t>(size()), tensor, what);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(tensor));
  std::vector<at::Tensor> inputs{tensor.contiguous()};
  c10d::AllgatherOptions options;
  options.timeout = timeout();
  group_.pending(backend().allgather(outputs, inputs, options), what).wait();
  return outputs[0];
}

ACCEL_COMPILED_ONCE auto Communicator::send_async(const at::Tensor& tensor, int dst, int tag, std::string what) -> Pending {
  const profiling::Range range("accel::send", what);
  group_.announce(Collective::send, bytes_of(tensor), tensor, what);
  std::vector<at::Tensor> tensors{tensor};
  auto work = backend().send(tensors, dst, tag);
  return group_.pending(std::move(work), std::move(what), timeout(), true);
}

ACCEL_COMPILED_ONCE auto Communicator::recv_async(at::Tensor& tensor, int src, int tag, std::string what) -> Pending {
  const profiling::Range range("accel::recv", what);
  group_.announce(Collective::recv, bytes_of(tensor), tensor, what);
  std::vector<at::Tensor> tensors{tensor};
  return group_.pending(backend().recv(tensors, src, tag), std::move(what), timeout(), true);
}

ACCEL_COMPILED_ONCE auto Communicator::all_to_all_others_async(at::Tensor& output, at::Tensor& input, std::string what, Collective counted_as, const at::Tensor& counted) -> Pending {
  const profiling::Range range("accel::all_to_all", what);
  group_.announce(counted_as, bytes_of(counted), counted, what);
  const std::int64_t chunk = input.numel() / std::max(1, size() - 1) * input.element_size();  // bytes
  // Two vectors: LibTorch 1.13's Gloo work moves from each argument.
  std::vector<std::int64_t> output_splits(size(), chunk), input_splits(size(), chunk);
  output_splits[rank()] = input_splits[rank()] = 0;
  at::Tensor output_bytes = output.view(at::kByte), input_bytes = input.view(at::kByte);
  c10d::AllToAllOptions options;
  options.timeout = timeout();
  return group_.pending(backend().alltoall_base(output_bytes, input_bytes, output_splits, input_splits, options),
                 std::move(what), timeout());
}

ACCEL_COMPILED_ONCE auto Communicator::all_gather_in_place_async(std::vector<at::Tensor>& chunks, const std::string& what) -> std::vector<Pending> {
  const profiling::Range range("accel::all_gather", what);
  if (static_cast<int>(chunks.size()) != size())
    throw std::invalid_argument("accel: all_gather_in_place_async (" + what + "): " + std::to_string(chunks.size()) +
                                " chunks for a group of " + std::to_string(size()));
  group_.announce(Collective::all_gather, bytes_of(chunks[rank()]) * chunks.size(), chunks[rank()], what);
  std::vector<Pending> out;
  for (int j = 0; j < size(); ++j) {
    std::vector<at::Tensor> bytes{chunks[j].view({-1}).view(at::kByte)};
    c10d::BroadcastOptions options;
    options.rootRank = j;
    options.timeout = timeout();
    out.push_back(
        group_.pending(backend().broadcast(bytes, options), what + " (rank " + std::to_string(j) + "'s chunk)", timeout()));
  }
  return out;
}

ACCEL_COMPILED_ONCE auto Communicator::reduce_scatter_base_async(at::Tensor& output, at::Tensor& input, std::string what) -> Pending {
  const profiling::Range range("accel::reduce_scatter", what);
  group_.announce(Collective::reduce_scatter, bytes_of(input), input, what);
  c10d::ReduceScatterOptions options;  // reduceOp defaults to SUM (a struct in 2.x, an enum in 1.13)
  options.timeout = timeout();
  return group_.pending(backend()._reduce_scatter_base(output, input, options), std::move(what));
}

ACCEL_COMPILED_ONCE auto Communicator::all_gather_base_async(at::Tensor& output, at::Tensor& input, std::string what) -> Pending {
  const profiling::Range range("accel::all_gather", what);
  group_.announce(Collective::all_gather, bytes_of(output), input, what);
  c10d::AllgatherOptions options;
  options.timeout = timeout();
  return group_.pending(backend()._allgather_base(output, input, options), std::move(what));
}

ACCEL_COMPILED_ONCE void Communicator::barrier(const std::string& what) {
  const profiling::Range range("accel::barrier", what);
  if (!distributed()) return;
  group_.announce(Collective::barrier, 0, at::Tensor(), what);
  c10d::BarrierOptions options;
  options.timeout = timeout();
  group_.pending(backend().barrier(options), what).wait();
}

}  // namespace accel::comm
#endif
