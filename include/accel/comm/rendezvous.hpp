#pragma once
// Rendezvous: the ranks of a job meet at a c10d TCPStore (rank 0 hosts it at
// MASTER_ADDR:MASTER_PORT) and connect a process group through their backend's
// adapter. The job's connection is made once per process and shared by every
// Communicator (Accelerate's PartialState, torch.distributed's default
// group): a second Trainer in the same program reuses it instead of racing a
// second rendezvous on the same port. Sub-groups connect over the same store
// under a prefix of their own.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "accel/comm/backend_adapter.hpp"
#include "accel/comm/environment.hpp"
#include "accel/comm/liveness.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/core/rank_end.hpp"

namespace accel::comm {

/// A connected process group: its backend over the job's store, and what
/// every handle on it shares.
struct Connection {
  WorldInfo world;  ///< this group's rank and size
  WorldInfo job;    ///< the whole job's
  const BackendAdapter* adapter = nullptr;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<compat::CollectiveBackend> backend;
  std::uint64_t sequence = 0;  ///< collectives issued on this group by this process (NOTE [Debug mode])
  std::string name = "world";  ///< in the flight recorder
  std::shared_ptr<Liveness> liveness;  ///< last: its heartbeat stops before the store goes
  bool is_job = false;                 ///< the job's own connection, not a sub-group's copy: it leaves the job

  Connection() = default;
  Connection(const Connection&) = default;
  // Once a collective of the job failed, the backend is left to the
  // operating system: ProcessGroupGloo's destructor would wait for the
  // collectives still queued, each until the timeout (NOTE [Naming the dead rank]).
  // Otherwise the job's connection leaves the job in order before its
  // backend and store close (NOTE [Leaving the job]).
  ~Connection() {
    if (liveness && liveness->failed()) (void)backend.release();
    else if (is_job && liveness && store) liveness->leave(*store);
  }
};

// Ranks of one job start seconds apart on a loaded machine: the timeout a
// user chose to catch a hung collective is too short to wait for a late
// starter at the store. Every collective still passes the user's timeout
// in its options.
inline constexpr std::chrono::milliseconds minimum_rendezvous_timeout{std::chrono::seconds(60)};
inline std::chrono::milliseconds rendezvous_timeout(std::chrono::milliseconds timeout) {
  return std::max(timeout, minimum_rendezvous_timeout);
}

/// This process's connection to the job `info` describes over `adapter`'s
/// backend, made on first use (the store, the process group, the liveness
/// watch) and shared afterwards. Fails with a CollectiveError naming the rank
/// and the address when a peer does not arrive within rendezvous_timeout.
ACCEL_COMPILED_ONCE std::shared_ptr<Connection> connect_job(const WorldInfo& info, const BackendAdapter& adapter,
                                                            std::chrono::milliseconds timeout);

/// Ends this process's part in every job it joined (NOTE [Leaving the job]),
/// for a process that ends without running static destructors (_exit):
/// accel::spawn calls it as each rank ends, with `ok` false when the rank
/// threw (then rank 0 does not wait for the others). A no-op for a job
/// already left; a connection still held by a Trainer stays usable for
/// collectives but no longer beats.
ACCEL_COMPILED_ONCE void leave_jobs(bool ok = true) noexcept;

/// A sub-group of `parent`'s job, this rank being `rank` of `size`, under
/// `name` (the n-th group of that name this process makes connects under
/// the n-th prefix, so a later group never reads an earlier one's keys).
ACCEL_COMPILED_ONCE std::shared_ptr<Connection> connect_subgroup(const Connection& parent, const std::string& name,
                                                                 int rank, int size,
                                                                 std::chrono::milliseconds timeout);

}  // namespace accel::comm

#if ACCEL_DEFINE_COMPILED_ONCE
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <csignal>
#include <map>
#include <mutex>
#include <vector>

#include "accel/comm/flight_recorder.hpp"

namespace accel::comm {
namespace detail {

// Writing to a dead peer's socket raises SIGPIPE, whose default action
// ends the process with no message at all. Ignored (as Python does), the
// write fails instead and the collective reports it. A handler the program
// installed itself is left alone.
ACCEL_COMPILED_ONCE void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

// The job connections this process made (one per job and backend).
struct JobConnections {
  std::mutex mutex;
  std::vector<std::shared_ptr<Connection>> list;
};
ACCEL_COMPILED_ONCE JobConnections& job_connections() {
  static JobConnections connections;
  return connections;
}

// accel::spawn's ranks end by _exit (core/rank_end.hpp): what a normal end's
// static destructors do, they do here.
ACCEL_COMPILED_ONCE void leave_jobs_at_rank_end(bool ok) noexcept { leave_jobs(ok); }

// How many sub-groups of this name this process has made in this job.
ACCEL_COMPILED_ONCE int next_generation(const std::string& name, const WorldInfo& world) {
  static std::mutex mutex;
  static std::map<std::string, int> made;
  std::lock_guard<std::mutex> lock(mutex);
  return made[world.master_addr + ":" + std::to_string(world.master_port) + "/" + name]++;
}

ACCEL_COMPILED_ONCE c10::intrusive_ptr<compat::CollectiveBackend> connect_backend(
    const BackendAdapter& adapter, c10::intrusive_ptr<c10d::Store> store, int rank, int size, const WorldInfo& job,
    std::chrono::milliseconds timeout) {
  try {
    return adapter.connect(std::move(store), rank, size, job, timeout);
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError("accel: rank " + std::to_string(rank) + ": connecting the " + adapter.name() +
                          " process group of " + std::to_string(size) + " ranks failed: " + e.what());
  }
}

}  // namespace detail

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE std::shared_ptr<Connection> connect_job(const WorldInfo& info, const BackendAdapter& adapter,
                                                            std::chrono::milliseconds timeout) {
  auto& [mutex, connections] = detail::job_connections();
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& c : connections)
    if (c->adapter == &adapter && c->world.rank == info.rank && c->world.world_size == info.world_size &&
        c->world.master_addr == info.master_addr && c->world.master_port == info.master_port)
      return c;
  detail::ignore_sigpipe();
  FlightRecorder::install_signal_handler();
  auto connection = std::make_shared<Connection>();
  connection->world = info;
  connection->job = info;
  connection->adapter = &adapter;
  connection->is_job = true;
  const std::string where = info.master_addr + ":" + std::to_string(info.master_port);
  try {
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(info.master_port);
    options.isServer = info.rank == 0;
    options.numWorkers = static_cast<std::size_t>(info.world_size);
    options.waitWorkers = true;
    options.timeout = rendezvous_timeout(timeout);
    connection->store = c10::make_intrusive<c10d::TCPStore>(info.master_addr, options);
  } catch (const std::exception& e) {
    throw CollectiveError("accel: rank " + std::to_string(info.rank) + ": rendezvous at " + where +
                          " failed (is MASTER_ADDR/MASTER_PORT right, the port free, every rank started?): " +
                          e.what());
  }
  connection->backend =
      detail::connect_backend(adapter, c10::make_intrusive<c10d::PrefixStore>("accel/world", connection->store),
                              info.rank, info.world_size, info, timeout);
  connection->liveness =
      std::make_shared<Liveness>(info.master_addr, info.master_port, info.rank, info.world_size, timeout);
  connections.push_back(connection);
  ::accel::detail::rank_end_hook() = &detail::leave_jobs_at_rank_end;
  return connection;
}

ACCEL_COMPILED_ONCE void leave_jobs(bool ok) noexcept {
  auto& [mutex, connections] = detail::job_connections();
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& c : connections)
    if (c->liveness && !c->liveness->failed() && c->store) c->liveness->leave(*c->store, ok);
  connections.clear();
}

ACCEL_COMPILED_ONCE std::shared_ptr<Connection> connect_subgroup(const Connection& parent, const std::string& name,
                                                                 int rank, int size,
                                                                 std::chrono::milliseconds timeout) {
  auto group = std::make_shared<Connection>(parent);
  group->is_job = false;
  group->sequence = 0;
  group->world.rank = rank;
  group->world.world_size = size;
  const int generation = detail::next_generation(name, parent.world);
  const std::string prefix = "accel/group/" + name + "/" + std::to_string(generation);
  group->name = name + (generation ? "#" + std::to_string(generation) : "");
  group->backend = detail::connect_backend(*parent.adapter, c10::make_intrusive<c10d::PrefixStore>(prefix, parent.store),
                                           rank, size, parent.job, timeout);
  return group;
}

}  // namespace accel::comm
#endif
