// The torch-free core: policies and concepts (checked at compile time),
// reading the job layout from launcher variables, the process supervisor.
// This binary has no LibTorch on its include path.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "../support/doctest.hpp"

#include <chrono>
#include <map>
#include <thread>

#include "accel/comm/address.hpp"
#include "accel/comm/environment.hpp"
#include "accel/core/concepts.hpp"
#include "accel/core/rules.hpp"
#include "accel/launch/spawn.hpp"
#include "accel/strategy/bucket_plan.hpp"
#include "accel/strategy/unit_plan.hpp"

namespace {

// ---- concepts: static checks (Kokkos TestConcepts style)
static_assert(accel::strategy_policy<accel::SingleProcess>);
static_assert(accel::strategy_policy<accel::DDP>);
static_assert(!accel::strategy_policy<int>);
static_assert(accel::precision_policy<accel::FP32> && accel::precision_policy<accel::BF16> &&
              accel::precision_policy<accel::FP16>);
static_assert(!accel::precision_policy<float>);
static_assert(accel::device_policy<accel::CPU> && accel::device_policy<accel::CUDA>);
static_assert(!accel::device_policy<accel::FP32>);
static_assert(!accel::step_function<float (*)()>);
static_assert(!accel::step_function<int>);

// FSDP's names are the ZeRO stages (and DDP).
static_assert(std::is_same_v<accel::FSDP<accel::ShardingStrategy::FULL_SHARD>, accel::ZeRO<3>>);
static_assert(std::is_same_v<accel::FSDP<accel::ShardingStrategy::SHARD_GRAD_OP>, accel::ZeRO<2>>);
static_assert(std::is_same_v<accel::FSDP<accel::ShardingStrategy::NO_SHARD>, accel::DDP>);
static_assert(accel::strategy_policy<accel::ZeRO<1>> && accel::strategy_policy<accel::ZeRO<3>>);

// Settings are aggregates with designated initialisers and sensible defaults.
static_assert(accel::DDP{}.bucket_cap_mb == 25.0 && accel::DDP{}.first_bucket_cap_mb == 1.0);
static_assert(accel::DDP{.bucket_cap_mb = 50}.bucket_cap_mb == 50.0);
static_assert(accel::FP16{}.init_scale == 65536.0 && accel::FP16{}.growth_interval == 2000);

// A user-defined strategy opts in and is then accepted (mdspan's custom
// layout test); the same shape without the opt-in is refused.
struct UserStrategy {
  using engine = accel::strategy::SingleProcessEngine;
  static constexpr bool distributed = false;
};
struct NotOptedIn : UserStrategy {};
static_assert(!accel::strategy_policy<NotOptedIn>);

}  // namespace

template <>
inline constexpr bool accel::enable_strategy_policy<UserStrategy> = true;
static_assert(accel::strategy_policy<UserStrategy>);
static_assert(accel::detail::check_policies<UserStrategy, accel::BF16, accel::CPU>::value);

// ---- the environment
namespace {
using Vars = std::map<std::string, std::string>;

accel::comm::WorldInfo read(const Vars& vars) {
  return accel::comm::world_from_environment([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const Vars& vars) {
  try {
    read(vars);
  } catch (const accel::comm::EnvironmentError& e) {
    return e.what();
  }
  return "(no error)";
}
}  // namespace

TEST_SUITE("environment") {
  TEST_CASE("no launcher variables: one process") {
    auto w = read({});
    CHECK(w.rank == 0);
    CHECK(w.world_size == 1);
    CHECK(w.launcher == "none");
  }

  TEST_CASE("torchrun's variables") {
    auto w = read({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29600"}});
    CHECK(w.rank == 3);
    CHECK(w.world_size == 4);
    CHECK(w.local_rank == 1);
    CHECK(w.local_world_size == 2);
    CHECK(w.master_addr == "10.1.2.3");
    CHECK(w.master_port == 29600);
    CHECK(w.launcher == "torchrun");
  }

  TEST_CASE("Open MPI's variables") {
    auto w = read({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                   {"MASTER_ADDR", "node0"}});
    CHECK(w.launcher == "openmpi");
    CHECK(w.rank == 1);
    CHECK(w.world_size == 2);
    CHECK(w.master_port == 29500);
  }

  TEST_CASE("SLURM's variables, with SLURM_NTASKS_PER_NODE in its compressed form") {
    auto w = read({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "1"},
                   {"SLURM_NTASKS_PER_NODE", "2(x3)"}, {"MASTER_ADDR", "node0"}});
    CHECK(w.launcher == "slurm");
    CHECK(w.rank == 5);
    CHECK(w.world_size == 6);
    CHECK(w.local_rank == 1);
    CHECK(w.local_world_size == 2);  // "2(x3)": 2 tasks on each of 3 nodes
    // Unequal counts name no single local size: the world size stands in.
    auto uneven = read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "5"}, {"SLURM_LOCALID", "0"},
                        {"SLURM_NTASKS_PER_NODE", "2(x2),1"}, {"MASTER_ADDR", "node0"}});
    CHECK(uneven.local_world_size == 5);
    auto plain = read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
                       {"SLURM_NTASKS_PER_NODE", "4"}, {"MASTER_ADDR", "node0"}});
    CHECK(plain.local_world_size == 4);
  }

  TEST_CASE("torchrun inside a one-task SLURM allocation is not a contradiction") {
    auto w = read({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1234"},
                   {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
    CHECK(w.launcher == "torchrun");
    CHECK(w.rank == 1);
  }

  TEST_CASE("incomplete, malformed and contradictory variables name the variable") {
    CHECK(error_of({{"RANK", "0"}}).find("RANK is set but WORLD_SIZE is not") != std::string::npos);
    CHECK(error_of({{"WORLD_SIZE", "2"}}).find("WORLD_SIZE is set but RANK is not") != std::string::npos);
    CHECK(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x' is not an integer") != std::string::npos);
    CHECK(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}})
              .find("RANK=2 is not below WORLD_SIZE=2") != std::string::npos);
    CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).find("MASTER_ADDR is not set") !=
          std::string::npos);
    CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}}).find("MASTER_PORT is not set") !=
          std::string::npos);
    CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}})
              .find("MASTER_PORT=70000 is not a TCP port") != std::string::npos);
    CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}})
              .find("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2") != std::string::npos);
    CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"},
                    {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}})
              .find("contradictory launcher variables: RANK=0 but OMPI_COMM_WORLD_RANK=1") != std::string::npos);
  }
}

// ---- the in-process launcher and its supervisor
TEST_SUITE("spawn") {
  TEST_CASE("every rank runs with torchrun's variables") {
    accel::spawn(3, [](int rank) {
      auto w = accel::comm::world_from_environment();
      if (w.rank != rank || w.world_size != 3 || w.local_rank != rank || w.master_addr != "127.0.0.1")
        throw std::runtime_error("wrong environment");
    });
  }

  TEST_CASE("a failing rank is named and the others are terminated quickly") {
    const auto start = std::chrono::steady_clock::now();
    try {
      accel::spawn(2, [](int rank) {
        if (rank == 1) throw std::runtime_error("boom");
        std::this_thread::sleep_for(std::chrono::seconds(60));
      });
      FAIL("spawn did not report the failure");
    } catch (const accel::SpawnError& e) {
      CHECK(std::string(e.what()).find("rank 1") != std::string::npos);
      CHECK(std::string(e.what()).find("exited with status 1") != std::string::npos);
    }
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  }

  TEST_CASE("a rank killed by a signal is named with the signal") {
    try {
      accel::spawn(2, [](int rank) {
        if (rank == 0) ::raise(SIGKILL);
        std::this_thread::sleep_for(std::chrono::seconds(60));
      });
      FAIL("spawn did not report the failure");
    } catch (const accel::SpawnError& e) {
      CHECK(std::string(e.what()).find("rank 0") != std::string::npos);
      CHECK(std::string(e.what()).find("signal 9") != std::string::npos);
    }
  }

  // Both ends of a broken connection exit: the CI once reported only "rank 0
  // exited with status 1: ... Connection closed by peer", the error of the
  // rank whose peer had gone, because one pass found both and named the
  // lower rank. The supervisor is driven directly so that both have ended
  // before its first look.
  TEST_CASE("of two failures found at once, the crash is named first and the other is named too") {
    auto child = [](auto body) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        body();
        ::_exit(0);
      }
      return pid;
    };
    accel::launch::ProcessSupervisor supervisor;
    const pid_t replying = child([] { ::_exit(1); }), crashing = child([] { ::raise(SIGKILL); });
    supervisor.add(0, replying);  // the error exit in reply
    supervisor.add(1, crashing);  // the crash
    for (pid_t pid : {replying, crashing}) {  // both ended (left for the supervisor to reap)
      siginfo_t info{};
      REQUIRE(::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) == 0);
    }
    const auto outcome = supervisor.wait(std::chrono::seconds(10), std::chrono::seconds(2));
    REQUIRE(outcome.first_failure);
    CHECK(outcome.first_failure->rank == 1);
    const std::string text = outcome.describe();
    INFO(text);
    CHECK(text.find("rank 1 (pid ") == 0);
    CHECK(text.find(") was killed by signal 9 (Killed); also rank 0 (pid ") != std::string::npos);
    CHECK(text.find(") exited with status 1") != std::string::npos);
  }

  TEST_CASE("a rank that crashes while it is being stopped is named, not reaped quietly") {
    int ready[2];  // rank 1 says here that its handler is in place; rank 0 fails only then
    REQUIRE(::pipe(ready) == 0);
    try {
      accel::spawn(2, [&](int rank) {
        if (rank == 0) {
          char byte = 0;
          if (::read(ready[0], &byte, 1) != 1) throw std::runtime_error("rank 1 never got ready");
          throw std::runtime_error("boom");
        }
        // Rank 1 dies of another signal when the supervisor's SIGTERM arrives
        // (SIGUSR2: no core dump to wait for).
        ::signal(SIGTERM, [](int) {
          ::signal(SIGUSR2, SIG_DFL);
          ::raise(SIGUSR2);
        });
        const char byte = 1;
        if (::write(ready[1], &byte, 1) != 1) throw std::runtime_error("could not tell rank 0");
        std::this_thread::sleep_for(std::chrono::seconds(60));
      });
      FAIL("spawn did not report the failure");
    } catch (const accel::SpawnError& e) {
      const std::string text = e.what();
      INFO(text);
      CHECK(text.find("rank 0 (pid ") != std::string::npos);
      CHECK(text.find("exited with status 1: boom; also rank 1 (pid ") != std::string::npos);
      CHECK(text.find(") was killed by signal 12 (User defined signal 2) as it was being stopped") != std::string::npos);
    }
    ::close(ready[0]);
    ::close(ready[1]);
  }

  TEST_CASE("a hang is a failure: the timeout kills every rank") {
    const auto start = std::chrono::steady_clock::now();
    accel::SpawnOptions options;
    options.timeout = std::chrono::milliseconds(1500);
    CHECK_THROWS_WITH_AS(
        accel::spawn(2, [](int) { std::this_thread::sleep_for(std::chrono::seconds(60)); }, options),
        doctest::Contains("did not finish within its timeout"), accel::SpawnError);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  }
}

TEST_SUITE("bucket plan") {
  using accel::strategy::ParameterSlot;
  using accel::strategy::plan_buckets;
  const std::int64_t mib_of_floats = 262144;  // 1 MiB of fp32

  TEST_CASE("reverse registration order; the first bucket closes at its small cap, the others at theirs") {
    const std::vector<ParameterSlot> slots(4, ParameterSlot{.numel = mib_of_floats});
    const auto plan = plan_buckets(slots, {.caps = accel::strategy::BucketCaps{.first_mb = 1, .rest_mb = 2}});
    REQUIRE(plan.size() == 3);
    CHECK(plan[0].params == std::vector<std::size_t>{3});
    CHECK(plan[1].params == std::vector<std::size_t>{2, 1});
    CHECK(plan[2].params == std::vector<std::size_t>{0});
    CHECK(plan[1].offsets == std::vector<std::int64_t>{0, mib_of_floats});
    CHECK(plan[1].numel == 2 * mib_of_floats);
  }

  TEST_CASE("another kind, optimizer group or unit closes the bucket; without caps a bucket is a whole run") {
    std::vector<ParameterSlot> slots(6, ParameterSlot{.numel = 10});
    slots[4].group = slots[5].group = 1;  // [0..3] group 0, [4, 5] group 1
    slots[0].kind = 1;                    // another dtype or device
    slots[1].unit = slots[2].unit = 1;    // a ZeRO-3 unit of its own
    const auto plan = plan_buckets(slots, {.caps = std::nullopt});
    REQUIRE(plan.size() == 4);
    CHECK(plan[0].params == std::vector<std::size_t>{5, 4});
    CHECK(plan[0].group == 1);
    CHECK(plan[1].params == std::vector<std::size_t>{3});
    CHECK(plan[2].params == std::vector<std::size_t>{2, 1});
    CHECK(plan[2].unit == 1);
    CHECK(plan[3].params == std::vector<std::size_t>{0});
  }

  TEST_CASE("each bucket is padded to a multiple of the shard count, its real size kept") {
    const std::vector<ParameterSlot> slots{{.numel = 3}, {.numel = 4}};
    const auto plan = plan_buckets(slots, {.caps = std::nullopt, .pad_to_multiple = 3});
    REQUIRE(plan.size() == 1);
    CHECK(plan[0].numel == 7);
    CHECK(plan[0].padded == 9);
    CHECK(plan[0].offsets == std::vector<std::int64_t>{0, 4});  // parameter 1 first: reverse order
    const auto unpadded = plan_buckets(slots, {.caps = std::nullopt});
    CHECK(unpadded[0].padded == 7);
  }
}

TEST_SUITE("unit plan") {
  using accel::AutoWrapPolicy;
  using accel::strategy::ModuleNode;
  // root (param 0) -> "body": Block {param 1, "inner": Linear {param 2}} and
  // Block {"inner": Linear {param 3}}; "head": Linear {param 4}
  ModuleNode linear(std::size_t p) { return {.class_name = "torch::nn::LinearImpl", .params = {p}}; }
  ModuleNode block(std::vector<std::size_t> own, ModuleNode inner) {
    return {.class_name = "my::BlockImpl", .params = std::move(own), .children = {{"inner", std::move(inner)}}};
  }
  ModuleNode model() {
    ModuleNode body{.class_name = "torch::nn::SequentialImpl",
                    .children = {{"0", block({1}, linear(2))}, {"1", block({}, linear(3))}}};
    return {.class_name = "Net", .params = {0}, .children = {{"body", body}, {"head", linear(4)}}};
  }
  const std::vector<std::int64_t> numels{5, 10, 40, 40, 30};

  TEST_CASE("transformer-based: each listed class by short or full name, children first; the rest is the root unit") {
    std::vector<std::string> names;
    const auto units = accel::strategy::assign_units(model(), numels, AutoWrapPolicy::TRANSFORMER_BASED_WRAP, 0, {"BlockImpl"}, names);
    CHECK(units == std::vector<std::size_t>{2, 0, 0, 1, 2});
    CHECK(names == std::vector<std::string>{"body.0", "body.1", "(root)"});
    names.clear();
    const auto full = accel::strategy::assign_units(model(), numels, AutoWrapPolicy::TRANSFORMER_BASED_WRAP, 0,
                                                    {"torch::nn::LinearImpl"}, names);
    CHECK(full == std::vector<std::size_t>{3, 3, 0, 1, 2});  // param 1 sits on a Block, not a Linear
    CHECK(names == std::vector<std::string>{"body.0.inner", "body.1.inner", "head", "(root)"});
  }

  TEST_CASE("size-based: a module wraps what its children left once it reaches the minimum") {
    std::vector<std::string> names;
    const auto units = accel::strategy::assign_units(model(), numels, AutoWrapPolicy::SIZE_BASED_WRAP, 45, {}, names);
    // The inner Linears (40) are too small; Block 0 reaches 50 with its own
    // parameter; Block 1 and "body" hold only 40 more, the head 30: the root takes them.
    CHECK(units == std::vector<std::size_t>{1, 0, 0, 1, 1});
    CHECK(names == std::vector<std::string>{"body.0", "(root)"});
    names.clear();
    const auto none = accel::strategy::assign_units(model(), numels, AutoWrapPolicy::NO_WRAP, 0, {}, names);
    CHECK(none == std::vector<std::size_t>(5, 0));
    CHECK(names == std::vector<std::string>{"(root)"});
  }
}

TEST_SUITE("address") {
  TEST_CASE("the address a rank advertises: on the route to MASTER_ADDR; loopback recognised") {
    using namespace accel::comm;
    CHECK(local_address_towards("127.0.0.1", 29500) == std::optional<std::string>("127.0.0.1"));
    CHECK(local_address_towards("localhost", 29500).has_value());
    CHECK_FALSE(local_address_towards("no-such-host.invalid", 29500).has_value());
    CHECK(interface_address("lo") == std::optional<std::string>("127.0.0.1"));
    CHECK_FALSE(interface_address("no-such-if0").has_value());
    CHECK(is_loopback_address("127.0.1.1"));
    CHECK(is_loopback_address("::1"));
    CHECK_FALSE(is_loopback_address("10.0.0.1"));
    CHECK_FALSE(is_loopback_address("1.127.0.0"));
  }
}
