#pragma once
// What differs between the c10d backends accel runs on, behind one interface:
// one adapter per backend (comm/gloo_adapter.hpp, comm/nccl_adapter.hpp)
// connects its process group, says how a tensor must travel on it (NCCL
// moves device memory only; Gloo reduces bf16 in fp32 and gathers some
// dtypes only as others) and issues the sharded collectives the ZeRO/FSDP
// engines use with the primitives that backend does best. The Communicator
// asks its adapter; nothing else branches on the backend.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "accel/comm/environment.hpp"
#include "accel/comm/pending.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/compiled_once.hpp"

namespace accel::device {
class BufferPool;
}

namespace c10d {
class Store;
}

namespace accel::comm {

class Communicator;

/// The backend a Device policy names (device/device.hpp): Gloo on CPU, NCCL on CUDA.
enum class BackendKind { gloo, nccl };

/// What a blocking collective does with a tensor, for BackendAdapter::route.
enum class Carried { reduced, broadcast, gathered };

/// How a tensor travels for one collective: as it is, or as a copy on
/// another device or in another dtype (converted back afterwards).
struct Route {
  std::optional<at::Device> device{};
  std::optional<at::ScalarType> dtype{};
  bool as_is() const { return !device && !dtype; }
  /// `tensor` as it travels (a copy unless already on that device and dtype).
  at::Tensor applied_to(const at::Tensor& tensor) const {
    return tensor.to(device.value_or(tensor.device()), dtype.value_or(tensor.scalar_type()));
  }
};

/// One c10d backend's rules and the collectives built from them. Stateless:
/// one instance per backend (adapter_for), shared by every Communicator on it.
class BackendAdapter {
 public:
  virtual ~BackendAdapter() = default;

  /// "Gloo" or "NCCL", in messages.
  virtual const char* name() const = 0;

  /// This rank's process group of `size` ranks over `store`; `job` is the
  /// whole job's world (where this process is, for the transport).
  virtual c10::intrusive_ptr<compat::CollectiveBackend> connect(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                                int size, const WorldInfo& job,
                                                                std::chrono::milliseconds timeout) const = 0;

  /// How `tensor` must travel to be `what` on this backend.
  virtual Route route(Carried what, const at::Tensor& tensor) const = 0;

  /// `host` (a CPU tensor of the communicator's own, as debug mode's
  /// signature) where this backend can move it.
  virtual at::Tensor on_wire(const at::Tensor& host) const = 0;

  /// Starts the reduce-scatter (sum) of `rows` into `shard`
  /// (comm::reduce_scatter_rows_async documents the contract); `received`
  /// is filled where the sum is finished locally (finish_reduce_scatter_rows),
  /// from `scratch` when there is one.
  virtual Pending reduce_scatter_rows_async(Communicator& comm, at::Tensor& shard, at::Tensor& rows,
                                            at::Tensor& received, const at::Tensor& counted, std::string what,
                                            device::BufferPool* scratch) const = 0;

  /// Whether reduce_scatter_rows_async writes over its `rows`.
  virtual bool overwrites_rows() const = 0;

  /// Starts the in-place all-gather of `rows` (comm::all_gather_rows_async).
  virtual std::vector<Pending> all_gather_rows_async(Communicator& comm, at::Tensor& rows,
                                                     const std::string& what) const = 0;
};

/// The adapter of `kind` (compiled once, comm/communicator.hpp).
ACCEL_COMPILED_ONCE const BackendAdapter& adapter_for(BackendKind kind);

}  // namespace accel::comm
