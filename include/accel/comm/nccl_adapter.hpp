#pragma once
// NCCL, the CUDA backend: it moves device memory only, so the host tensors a
// blocking helper is handed (a gradient norm, an overflow flag, a checkpoint
// verdict, debug mode's signature) travel through the current GPU and back;
// the sharded collectives are its native flat ones (_reduce_scatter_base and
// _allgather_base, Python's reduce_scatter_tensor and all_gather_into_tensor,
// the all-gather in place with this rank's row as its input, as FSDP2 uses
// it). Made only where LibTorch was built with NCCL (USE_C10D_NCCL);
// elsewhere connecting says so.

#include "accel/comm/backend_adapter.hpp"

namespace accel::comm {

class NcclAdapter final : public BackendAdapter {
 public:
  const char* name() const override { return "NCCL"; }
  c10::intrusive_ptr<compat::CollectiveBackend> connect(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                        const WorldInfo& job,
                                                        std::chrono::milliseconds timeout) const override;
  Route route(Carried, const at::Tensor& tensor) const override {
    if (tensor.is_cpu()) return {at::Device(at::kCUDA), std::nullopt};
    return {};
  }
  at::Tensor on_wire(const at::Tensor& host) const override { return host.to(at::Device(at::kCUDA)); }
  Pending reduce_scatter_rows_async(Communicator& comm, at::Tensor& shard, at::Tensor& rows, at::Tensor& received,
                                    const at::Tensor& counted, std::string what,
                                    device::BufferPool* scratch) const override;
  bool overwrites_rows() const override { return false; }
  std::vector<Pending> all_gather_rows_async(Communicator& comm, at::Tensor& rows,
                                             const std::string& what) const override;
};

}  // namespace accel::comm

#if ACCEL_DEFINE_COMPILED_ONCE
#if defined(USE_C10D_NCCL) && __has_include(<torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define ACCEL_HAS_NCCL 1
#endif

#include "accel/comm/communicator.hpp"

namespace accel::comm {
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE auto NcclAdapter::connect(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                              const WorldInfo&, std::chrono::milliseconds timeout) const
    -> c10::intrusive_ptr<compat::CollectiveBackend> {
#ifdef ACCEL_HAS_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(std::move(store), rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  throw CollectiveError("accel: this LibTorch was built without NCCL; use accel::CPU (Gloo) or a CUDA LibTorch");
#endif
}

ACCEL_COMPILED_ONCE Pending NcclAdapter::reduce_scatter_rows_async(Communicator& comm, at::Tensor& shard,
                                                                   at::Tensor& rows, at::Tensor&, const at::Tensor&,
                                                                   std::string what, device::BufferPool*) const {
  return comm.reduce_scatter_base_async(shard, rows, std::move(what));
}

ACCEL_COMPILED_ONCE std::vector<Pending> NcclAdapter::all_gather_rows_async(Communicator& comm, at::Tensor& rows,
                                                                            const std::string& what) const {
  const std::int64_t len = rows.numel() / comm.size();
  at::Tensor mine = rows.narrow(0, comm.rank() * len, len);
  std::vector<Pending> out;
  out.push_back(comm.all_gather_base_async(rows, mine, what));
  return out;
}

}  // namespace accel::comm
#endif
