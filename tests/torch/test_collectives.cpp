// Sharded collectives (reduce_scatter, all_gather_flat) on real processes and
// real Gloo process groups. Every rank builds every rank's input from a seed,
// so each can compute the reference result itself. Every spawn has a timeout.
#include <ATen/ops/arange.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <accel/comm/collectives.hpp>

#include <chrono>
#include <thread>

#include "doctest_torch.hpp"

using namespace accel::testing;
using namespace std::chrono_literals;
using accel::comm::all_gather_flat;
using accel::comm::reduce_scatter;
using accel::comm::shard_range;

namespace {

accel::comm::Communicator connect_gloo(std::chrono::milliseconds timeout = 20s) {
  return accel::comm::Communicator::connect(accel::comm::world_from_environment(), accel::comm::BackendKind::gloo,
                                            timeout);
}

// Sizes for `world` ranks: empty, fewer elements than ranks (so some shards
// are empty), divisible, not divisible, and large enough for several TCP writes.
std::vector<std::int64_t> sizes_for(int world) {
  return {0, 1, world - 1, 2, 3 * world, 3 * world + 1, 1001, 64 * 1024 + world - 1};
}

// Rank `rank`'s input of `numel` elements: integer-valued, so sums are exact
// in any order (|sum| <= 3 * 64 is exact in bf16 too).
at::Tensor int_valued_input(std::uint64_t seed, int rank, std::int64_t numel, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 101 + rank);
  return at::randint(-64, 64, {numel}, gen, at::TensorOptions().dtype(at::kLong)).to(dtype);
}

at::Tensor random_input(std::uint64_t seed, int rank, std::int64_t numel, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 101 + rank);
  return at::randn({numel}, gen).to(dtype);
}

// The reference: the plain sum of every rank's input (accumulated in fp64
// where floating), sliced to this rank's shard.
template <class MakeInput>
at::Tensor reference_shard(MakeInput make, int world, int rank, std::int64_t numel, at::ScalarType dtype) {
  const bool floating = at::isFloatingType(dtype);
  auto sum = at::zeros({numel}, at::TensorOptions().dtype(floating ? at::kDouble : dtype));
  for (int q = 0; q < world; ++q) sum += make(q).to(sum.scalar_type());
  const auto s = shard_range(numel, world, rank);
  return sum.narrow(0, s.offset, s.size).to(dtype);
}

std::string describe(const char* what, std::int64_t numel, int world, int rank) {
  return std::string(what) + " numel=" + std::to_string(numel) + " world=" + std::to_string(world) +
         " rank=" + std::to_string(rank);
}

}  // namespace

TEST_SUITE("collectives") {
  TEST_CASE("shard_range: contiguous, in rank order, as even as possible, first total % world longer") {
    for (int world = 1; world <= 5; ++world)
      for (std::int64_t total = 0; total <= 23; ++total) {
        CAPTURE(world);
        CAPTURE(total);
        std::int64_t next = 0;
        for (int rank = 0; rank < world; ++rank) {
          const auto s = shard_range(total, world, rank);
          CHECK(s.offset == next);
          CHECK(s.size == total / world + (rank < total % world ? 1 : 0));
          next += s.size;
        }
        CHECK(next == total);
      }
    CHECK(shard_range(2, 3, 2) == accel::comm::ShardRange{2, 0});
    CHECK(shard_range(10, 3, 0) == accel::comm::ShardRange{0, 4});
    CHECK(shard_range(10, 3, 1) == accel::comm::ShardRange{4, 3});
    CHECK(shard_range(10, 3, 2) == accel::comm::ShardRange{7, 3});
    CHECK_THROWS_AS(shard_range(4, 2, 2), std::invalid_argument);
    CHECK_THROWS_AS(shard_range(-1, 2, 0), std::invalid_argument);
  }

  TEST_CASE("each backend's adapter says how a tensor travels: Gloo sums bf16 in fp32 and carries what its "
            "all-gather refuses; NCCL takes host tensors through the GPU") {
    using accel::comm::adapter_for;
    using accel::comm::BackendKind;
    using accel::comm::Carried;
    const auto& gloo = adapter_for(BackendKind::gloo);
    const auto& nccl = adapter_for(BackendKind::nccl);
    CHECK(std::string(gloo.name()) == "Gloo");
    CHECK(std::string(nccl.name()) == "NCCL");
    const auto bf16 = at::zeros({4}, at::TensorOptions().dtype(at::kBFloat16));
    const auto fp32 = at::zeros({4});
    const auto reduced = gloo.route(Carried::reduced, bf16);
    CHECK((reduced.dtype == std::optional<at::ScalarType>(at::kFloat)));
    CHECK_FALSE(reduced.device.has_value());
    CHECK(gloo.route(Carried::reduced, fp32).as_is());
    CHECK(gloo.route(Carried::broadcast, bf16).as_is());  // broadcast moves bytes as they are
    CHECK((gloo.route(Carried::gathered, bf16).dtype == accel::compat::gloo_all_gather_carrier(at::kBFloat16)));
    CHECK(gloo.route(Carried::gathered, fp32).as_is());
    CHECK(gloo.overwrites_rows());
    CHECK(gloo.on_wire(fp32).is_same(fp32));
    for (auto what : {Carried::reduced, Carried::broadcast, Carried::gathered}) {
      const auto route = nccl.route(what, fp32);
      CHECK((route.device.has_value() && route.device->is_cuda()));
      CHECK_FALSE(route.dtype.has_value());
    }
    CHECK_FALSE(nccl.overwrites_rows());
    // A handle takes the adapter of the backend it was connected with (one process: no rendezvous).
    CHECK(&accel::comm::Communicator{}.adapter() == &gloo);
    CHECK(&accel::comm::Communicator::connect(accel::comm::WorldInfo{}, BackendKind::nccl, 1s).adapter() == &nccl);
  }

  TEST_CASE("the padded layout the native (NCCL) collectives use round-trips for every shard_range split") {
    // No NCCL here: this checks the padding arithmetic that path relies on.
    for (int world : {1, 2, 3, 4})
      for (std::int64_t total : {0, 1, 2, 3, 7, 8, 13}) {
        CAPTURE(world);
        CAPTURE(total);
        auto x = at::arange(total).to(at::kFloat).add(1);  // (total), no zeros, so padding is visible
        auto rows = accel::comm::detail::pad_to_rows(x, world);
        const auto longest = shard_range(total, world, 0).size;
        CHECK(rows.sizes() == at::IntArrayRef{world, longest});
        for (int r = 0; r < world; ++r) {
          const auto s = shard_range(total, world, r);
          CHECK(rows[r].narrow(0, 0, s.size).equal(x.narrow(0, s.offset, s.size)));
          CHECK(rows[r].narrow(0, s.size, longest - s.size).eq(0).all().item<bool>());
        }
        CHECK(accel::comm::detail::unpad_rows(rows, total, world).equal(x));
      }
  }

  TEST_CASE("one process: both are copies, and a shard of the wrong size is refused") {
    accel::comm::Communicator single;
    auto x = at::arange(5).to(at::kFloat);
    auto reduced = reduce_scatter(single, x, "test");
    CHECK(reduced.equal(x));
    CHECK(reduced.data_ptr() != x.data_ptr());
    CHECK(all_gather_flat(single, x, 5, "test").equal(x));
    CHECK_THROWS_AS(all_gather_flat(single, x, 6, "test"), std::invalid_argument);
    CHECK_THROWS_AS(reduce_scatter(single, x.view({5, 1}), "test"), std::invalid_argument);
  }

  TEST_CASE("reduce_scatter: this rank's shard of the sum, 2 and 3 ranks, divisible and not, empty shards") {
    spawn_each({2, 3}, [](int world, int rank) {
      auto comm = connect_gloo();
      std::uint64_t seed = 1;
      for (std::int64_t numel : sizes_for(world)) {
        // Integer-valued fp32 and int64: exact whatever order the ranks' rows are added in.
        for (auto dtype : {at::kFloat, at::kLong}) {
          auto make = [&](int q) { return int_valued_input(seed, q, numel, dtype); };
          auto got = reduce_scatter(comm, make(rank), "test reduce-scatter");
          auto want = reference_shard(make, world, rank, numel, dtype);
          require(got.scalar_type() == dtype, describe("dtype kept", numel, world, rank));
          require(got.sizes() == want.sizes() && got.equal(want), describe("exact sum", numel, world, rank));
          ++seed;
        }
        // Random fp64: equal up to summation order.
        auto make = [&](int q) { return random_input(seed, q, numel, at::kDouble); };
        auto got = reduce_scatter(comm, make(rank), "test reduce-scatter");
        auto want = reference_shard(make, world, rank, numel, at::kDouble);
        require(got.sizes() == want.sizes() && (numel == 0 || got.allclose(want, 0, 1e-12)),
                describe("fp64 sum", numel, world, rank));
        ++seed;
      }
    });
  }

  TEST_CASE("debug mode: reduce_scatter and all_gather_flat of every size on 3 ranks raise no false mismatch; a "
            "length that differs on one rank is caught on every rank, also where both pad to the same rows") {
    spawn_each({3}, [](int world, int rank) {
      auto comm = connect_gloo();
      comm.set_debug(true);
      for (std::int64_t numel : sizes_for(world)) {
        auto make = [&](int q) { return int_valued_input(7, q, numel, at::kFloat); };
        auto got = reduce_scatter(comm, make(rank), "test reduce-scatter");
        require(got.equal(reference_shard(make, world, rank, numel, at::kFloat)), describe("sum", numel, world, rank));
        auto whole = all_gather_flat(comm, got, numel, "test all-gather");
        require(whole.numel() == numel, describe("gathered", numel, world, rank));
      }
      // 13 against 12 pad to rows of 5 and 4; 11 against 12 both to rows of 4.
      for (std::int64_t odd : {13, 11}) {
        bool caught = false;
        try {
          reduce_scatter(comm, at::ones({rank == 2 ? odd : 12}), "gradients of unequal length");
        } catch (const accel::comm::CollectiveMismatch& e) {
          caught = std::string(e.what()).find("for gradients of unequal length") != std::string::npos;
        }
        require(caught, "rank " + std::to_string(rank) + ": the mismatch (12 against " + std::to_string(odd) +
                            ") raised, naming the collective");
      }
    });
  }

  TEST_CASE("all_gather_ragged: every rank's tensor of its own length (empty included), in rank order") {
    spawn_each({3}, [](int world, int rank) {
      auto comm = connect_gloo();
      // Rank r holds r * 2 elements valued 100 * r + i: rank 0's is empty.
      auto mine = at::arange(rank * 2, at::TensorOptions().dtype(at::kLong)) + 100 * rank;
      const auto parts = accel::comm::all_gather_ragged(comm, mine, "test ragged");
      require(static_cast<int>(parts.size()) == world, "one part per rank");
      for (int q = 0; q < world; ++q)
        require(parts[q].equal(at::arange(q * 2, at::TensorOptions().dtype(at::kLong)) + 100 * q),
                "rank " + std::to_string(q) + "'s part, seen by rank " + std::to_string(rank));
    });
  }

  TEST_CASE("all_gather_flat: shard_range pieces reconstruct the original exactly, any dtype") {
    spawn_each({2, 3}, [](int world, int rank) {
      auto comm = connect_gloo();
      std::uint64_t seed = 100;
      for (std::int64_t numel : sizes_for(world)) {
        // bool and int16 are refused by 1.13's Gloo all-gather; they travel as bytes here.
        for (auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kShort, at::kBool, at::kBFloat16}) {
          auto original = dtype == at::kBool ? int_valued_input(seed, 0, numel, at::kLong).gt(0)
                                             : random_input(seed, 0, numel, at::kDouble).mul(100).to(dtype);
          const auto s = shard_range(numel, world, rank);
          auto mine = original.narrow(0, s.offset, s.size).clone();
          auto full = all_gather_flat(comm, mine, numel, "test all-gather");
          require(full.scalar_type() == dtype, describe("dtype kept", numel, world, rank));
          require(full.sizes() == original.sizes() && full.equal(original),
                  describe(c10::toString(dtype), numel, world, rank));
          ++seed;
        }
      }
      // A shard of the wrong size is refused before anything is sent.
      bool refused = false;
      try {
        all_gather_flat(comm, at::zeros({5}), 4, "test");
      } catch (const std::invalid_argument&) {
        refused = true;
      }
      require(refused, "mis-sized shard refused");
    });
  }

  TEST_CASE("reduce_scatter then all_gather_flat is an all-reduce (the ZeRO gradient/parameter round trip)") {
    accel::spawn(
        3,
        [](int rank) {
          auto comm = connect_gloo();
          const std::int64_t numel = 1000;
          auto make = [](int q) { return int_valued_input(7, q, numel, at::kFloat); };
          auto shard = reduce_scatter(comm, make(rank), "test round trip");
          auto full = all_gather_flat(comm, shard, numel, "test round trip");
          auto all_reduced = make(rank);
          comm.all_reduce(all_reduced, "test round trip reference");
          require(full.equal(all_reduced), "reduce-scatter + all-gather == all-reduce");
        },
        bounded());
  }

  TEST_CASE("bf16 on Gloo: reduce_scatter sums as fp32 and returns bf16") {
    spawn_each({2, 3}, [](int world, int rank) {
      auto comm = connect_gloo();
      std::uint64_t seed = 300;
      for (std::int64_t numel : sizes_for(world)) {
        // Integer-valued: exact.
        auto make_int = [&](int q) { return int_valued_input(seed, q, numel, at::kBFloat16); };
        auto got = reduce_scatter(comm, make_int(rank), "test bf16 reduce-scatter");
        require(got.scalar_type() == at::kBFloat16, describe("bf16 kept", numel, world, rank));
        require(got.equal(reference_shard(make_int, world, rank, numel, at::kBFloat16)),
                describe("bf16 exact sum", numel, world, rank));
        ++seed;
        // Random: the fp32 sum rounded once, so within one bf16 rounding of the exact sum.
        auto make = [&](int q) { return random_input(seed, q, numel, at::kBFloat16); };
        auto rounded = reduce_scatter(comm, make(rank), "test bf16 reduce-scatter").to(at::kDouble);
        auto exact = reference_shard(make, world, rank, numel, at::kDouble);
        require(numel == 0 || rounded.allclose(exact, 1.0 / 128, 1e-6), describe("bf16 sum", numel, world, rank));
        ++seed;
      }
    });
  }

  TEST_CASE("ZeRO's Gloo building blocks: the in-place all-gather fills every rank's chunk, any dtype, and writes "
            "nothing else; the all-to-all among the other ranks delivers theirs in rank order") {
    spawn_each({2, 3}, [](int world, int rank) {
      auto comm = connect_gloo();
      std::uint64_t seed = 300;
      for (std::int64_t chunk : {1, 7, 64 * 1024 + 3}) {
        for (auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kShort, at::kBool, at::kBFloat16}) {
          auto make = [&](std::uint64_t s, int q, std::int64_t n) {
            auto values = int_valued_input(s, q, n, at::kLong);
            return dtype == at::kBool ? values.gt(0) : values.to(dtype);
          };
          std::vector<at::Tensor> expected;
          for (int q = 0; q < world; ++q) expected.push_back(make(seed, q, chunk));
          // The bucket, between a guard element on each side that must survive.
          auto buffer = make(seed + 1000, rank, world * chunk + 2);
          const auto guards = at::stack({buffer[0], buffer[-1]}).clone();
          auto flat = buffer.narrow(0, 1, world * chunk);
          std::vector<at::Tensor> chunks;
          for (int q = 0; q < world; ++q) chunks.push_back(flat.narrow(0, q * chunk, chunk));
          chunks[rank].copy_(expected[rank]);
          for (auto& pending : comm.all_gather_in_place_async(chunks, "test in-place all-gather")) pending.wait();
          require(flat.equal(at::cat(expected)), describe(c10::toString(dtype), chunk, world, rank));
          require(at::stack({buffer[0], buffer[-1]}).equal(guards), describe("guards kept", chunk, world, rank));
          ++seed;
        }
      }
      for (std::int64_t chunk : {1, 5, 1000}) {
        // Rank q sends rank j values made of (q, j, element): who sent it, to
        // whom, which element. As bytes, so dtypes 1.13's Gloo refuses go too.
        for (auto dtype : {at::kDouble, at::kBFloat16, at::kShort, at::kBool}) {
          auto from_to = [&](int q, int j) {
            auto values = at::arange(chunk, at::TensorOptions().dtype(at::kDouble));
            if (dtype == at::kDouble) return values + 1e6 * q + 1e3 * j;
            values = (values + 10 * q + 3 * j).remainder(dtype == at::kBool ? 2 : 100);
            return values.to(dtype);
          };
          std::vector<at::Tensor> mine, theirs;
          for (int j = 0; j < world; ++j)
            if (j != rank) mine.push_back(from_to(rank, j)), theirs.push_back(from_to(j, rank));
          auto others = at::cat(mine);
          auto received = at::empty_like(others);
          comm.all_to_all_others_async(received, others, "test all-to-all among the others",
                                       accel::comm::Collective::all_to_all, others)
              .wait();
          require(received.equal(at::cat(theirs)),
                  describe(c10::toString(dtype), chunk, world, rank) + " (all-to-all among the others)");
        }
      }
    });
  }

  TEST_CASE("reduce_scatter and all_gather_flat are each counted as one collective of the whole tensor, with no "
            "point-to-point traffic and no all-reduce") {
    spawn_each({2, 3}, [](int world, int rank) {
      using accel::comm::Collective;
      auto comm = connect_gloo();
      // Only the collective itself, once, and no point-to-point parts (the
      // old send/recv ring's). What Gloo does inside one call is not seen
      // here: the hang test below is what keeps 2.x's native reduce-scatter
      // (whose wait ignores the timeout) out.
      auto counted_once = [&](const accel::comm::Traffic& d, Collective kind, std::uint64_t bytes,
                              const std::string& what) {
        require(d.calls_of(kind) == 1 && d.bytes_of(kind) == bytes,
                what + ": " + std::to_string(d.calls_of(kind)) + " calls, " + std::to_string(d.bytes_of(kind)) +
                    " bytes, expected 1 of " + std::to_string(bytes));
        require(d.total_bytes() == bytes, what + ": nothing else counted");
        for (auto other : {Collective::send, Collective::recv, Collective::all_reduce, Collective::barrier})
          require(d.calls_of(other) == 0, what + ": no " + std::string(accel::comm::collective_name(other)));
      };
      for (std::int64_t numel : {std::int64_t{6 * 1024}, std::int64_t{6 * 1024 + 1}, std::int64_t{2}}) {
        auto before = accel::comm::process_traffic();
        reduce_scatter(comm, int_valued_input(1, rank, numel, at::kFloat), "test bytes");
        counted_once(accel::comm::process_traffic() - before, Collective::reduce_scatter, numel * sizeof(float),
                     describe("fp32 reduce-scatter", numel, world, rank));
        // bf16 goes as fp32: twice its own width, the price of one rounding.
        before = accel::comm::process_traffic();
        reduce_scatter(comm, int_valued_input(2, rank, numel, at::kBFloat16), "test bytes");
        counted_once(accel::comm::process_traffic() - before, Collective::reduce_scatter, numel * sizeof(float),
                     describe("bf16 reduce-scatter, as fp32", numel, world, rank));
        // The all-gather fills rows of the longest shard.
        before = accel::comm::process_traffic();
        all_gather_flat(comm, at::zeros({shard_range(numel, world, rank).size}), numel, "test bytes");
        counted_once(accel::comm::process_traffic() - before, Collective::all_gather,
                     world * shard_range(numel, world, 0).size * sizeof(float),
                     describe("all-gather", numel, world, rank));
      }
    });
  }

  TEST_CASE("a rank that never joins reduce_scatter: the other fails after the timeout, naming op and rank") {
    const std::string text = spawn_two_and_read_report("collectives_hang", [](int rank, const std::string& result) {
      auto comm = connect_gloo(2s);
      if (rank == 1) {
        std::this_thread::sleep_for(12s);  // alive but absent: only the timeout can end rank 0's wait
        return;
      }
      report_collective_failure(result,
                                [&] { reduce_scatter(comm, at::ones({100}), "reduce-scatter of ZeRO gradients"); });
    });
    INFO(text);
    REQUIRE(reports_failure(text));
    const double seconds = failure_seconds(text);
    CHECK(seconds >= 1.5);
    // The 2 s timeout and the roll call, well before rank 1 leaves at 12 s (5.3 s was seen on a loaded machine).
    CHECK(seconds < 9.0);
    CHECK(text.find("rank 0: reduce-scatter of ZeRO gradients") != std::string::npos);
  }
}
