#pragma once
// Gloo, the CPU backend: how a tensor travels on it and how the sharded
// collectives are built from what it does well.
//   - bf16 is reduced in fp32, rounded once instead of at every hop of the
//     ring (1.13's Gloo refuses bf16 outright: "Invalid scalar type");
//   - a list all-gather carries the dtypes it refuses as others of the same
//     size (compat::gloo_all_gather_carrier);
//   - reduce-scatter: Gloo has none in 1.13, and 2.x's clones the whole input
//     and all-reduces it (twice the bytes, a copy more memory, and a wait
//     that ignores its timeout), so it is an all-to-all among the other ranks
//     and a local sum: (n-1)/n of the tensor sent and received per rank;
//   - in-place all-gather: one broadcast per rank straight into its row, as
//     bytes (any dtype; Gloo's own all-gather stages the whole output in a
//     buffer of its own).

#include "accel/comm/backend_adapter.hpp"

namespace gloo::transport {
class Device;
}

namespace accel::comm {

class GlooAdapter final : public BackendAdapter {
 public:
  const char* name() const override { return "Gloo"; }
  c10::intrusive_ptr<compat::CollectiveBackend> connect(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                        const WorldInfo& job,
                                                        std::chrono::milliseconds timeout) const override;
  Route route(Carried what, const at::Tensor& tensor) const override;
  at::Tensor on_wire(const at::Tensor& host) const override { return host; }
  Pending reduce_scatter_rows_async(Communicator& comm, at::Tensor& shard, at::Tensor& rows, at::Tensor& received,
                                    const at::Tensor& counted, std::string what,
                                    device::BufferPool* scratch) const override;
  bool overwrites_rows() const override { return true; }
  std::vector<Pending> all_gather_rows_async(Communicator& comm, at::Tensor& rows,
                                             const std::string& what) const override;

 private:
  // The address this rank's Gloo binds to and advertises (NOTE [Which
  // address a rank advertises] in comm/address.hpp): GLOO_SOCKET_IFNAME's,
  // else the one on the route to MASTER_ADDR. A loopback one while ranks run
  // on other machines would only end in "Connection refused" there.
  static std::shared_ptr<::gloo::transport::Device> device_for(const WorldInfo& job);
};

}  // namespace accel::comm

#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/empty_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>

#include "accel/comm/address.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/comm/rendezvous.hpp"
#include "accel/device/buffer_pool.hpp"

namespace accel::comm {
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE auto GlooAdapter::connect(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                              const WorldInfo& job, std::chrono::milliseconds timeout) const
    -> c10::intrusive_ptr<compat::CollectiveBackend> {
  // Connecting waits for every rank: where each operation carries its own
  // timeout, the group's is the rendezvous's.
  auto options = c10d::ProcessGroupGloo::Options::create(
      compat::gloo_has_per_operation_timeout ? rendezvous_timeout(timeout) : timeout);
  options->devices.push_back(device_for(job));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(std::move(store), rank, size, options);
}

ACCEL_COMPILED_ONCE Route GlooAdapter::route(Carried what, const at::Tensor& tensor) const {
  if (what == Carried::reduced && tensor.scalar_type() == at::kBFloat16) return {std::nullopt, at::kFloat};
  if (what == Carried::gathered)
    if (const auto carrier = compat::gloo_all_gather_carrier(tensor.scalar_type())) return {std::nullopt, *carrier};
  return {};
}

ACCEL_COMPILED_ONCE Pending GlooAdapter::reduce_scatter_rows_async(Communicator& comm, at::Tensor& shard,
                                                                   at::Tensor& rows, at::Tensor& received,
                                                                   const at::Tensor& counted, std::string what,
                                                                   device::BufferPool* scratch) const {
  const int n = comm.size(), r = comm.rank();
  const std::int64_t len = shard.numel();
  c10::NoGradGuard no_grad;
  shard.copy_(rows.narrow(0, r * len, len));
  for (int j = r + 1; j < n; ++j) rows.narrow(0, (j - 1) * len, len).copy_(rows.narrow(0, j * len, len));
  at::Tensor others = rows.narrow(0, 0, (n - 1) * len);  // (n-1) x (len,): the rows for ranks != r, in rank order
  received = scratch != nullptr ? scratch->empty(others.numel(), others.options()) : at::empty_like(others);
  return comm.all_to_all_others_async(received, others, std::move(what), Collective::reduce_scatter, counted);
}

ACCEL_COMPILED_ONCE std::vector<Pending> GlooAdapter::all_gather_rows_async(Communicator& comm, at::Tensor& rows,
                                                                            const std::string& what) const {
  const std::int64_t len = rows.numel() / comm.size();
  std::vector<at::Tensor> chunks;  // rank j's row of `rows`
  for (int j = 0; j < comm.size(); ++j) chunks.push_back(rows.narrow(0, j * len, len));
  return comm.all_gather_in_place_async(chunks, what);
}

ACCEL_COMPILED_ONCE auto GlooAdapter::device_for(const WorldInfo& job) -> std::shared_ptr<::gloo::transport::Device> {
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

}  // namespace accel::comm
#endif
