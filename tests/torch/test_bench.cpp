// accel::bench, the strategy comparison: its byte counts against the
// formulas worked out by hand here, its JSON read back, a failing strategy
// reported while the others run. Ranks are forked by compare itself
// (Options::spawn), so the checks run in this process on what came back.
#include <torch/optim/sgd.h>

#include <accel/bench.hpp>

#include "doctest_torch.hpp"

using namespace accel::testing;
using accel::comm::Collective;

namespace {

// Linear(8, 12) + Linear(12, 6): 96 + 12 + 72 + 6 = 186 parameters, a
// multiple of 2 and 3, so no bucket is padded on 2 or 3 ranks.
torch::nn::Sequential even_mlp() {
  at::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 12), torch::nn::Tanh(), torch::nn::Linear(12, 6));
}
// Linear(8, 11) + Linear(11, 5): 88 + 11 + 55 + 5 = 159 parameters: padded
// to 160 on 2 ranks, a multiple of 3.
torch::nn::Sequential odd_mlp() {
  at::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 11), torch::nn::Tanh(), torch::nn::Linear(11, 5));
}

template <class MakeModel>
auto workload(MakeModel make_model, std::int64_t classes) {
  return accel::bench::Workload{
      .model = [make_model](accel::comm::Communicator&) { return make_model(); },
      .optimizer = [](std::vector<at::Tensor> params) {
        return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
      },
      .batch = [classes](std::int64_t step, int rank) {
        auto b = global_batch(step * 8 + rank, 4, 8, classes);
        return accel::bench::Batch{b.x, b.y};
      },
      .loss = [](const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); }};
}

accel::bench::Options quick(int ranks) {
  return {.warmup = 1, .steps = 3, .rounds = 2, .print = false, .spawn = ranks,
          .spawn_timeout = std::chrono::seconds(120)};
}

std::uint64_t bytes(const accel::bench::CaseResult& r, Collective kind, int rank) {
  return r.ranks.at(rank).bytes[static_cast<std::size_t>(kind)] / r.steps;
}

// Every rank's counted bytes per step equal `expected` (kind -> bytes, the
// rest zero) and the library's formula says the same.
void check_traffic(const accel::bench::CaseResult& r, int world,
                   const std::vector<std::pair<Collective, std::uint64_t>>& expected) {
  INFO(r.name, " on ", world, " ranks");
  REQUIRE(r.ok);
  REQUIRE(r.ranks.size() == static_cast<std::size_t>(world));
  REQUIRE(r.predicted.has_value());
  for (std::size_t k = 0; k < accel::comm::collective_kinds; ++k) {
    const auto kind = static_cast<Collective>(k);
    std::uint64_t want = 0;
    for (auto [e, b] : expected)
      if (e == kind) want = b;
    INFO(accel::comm::collective_name(kind));
    for (int rank = 0; rank < world; ++rank) {
      CHECK(r.ranks[rank].bytes[k] % r.steps == 0);  // every step moves the same
      CHECK(bytes(r, kind, rank) == want);
    }
    CHECK((*r.predicted)[k] == want);
  }
}

}  // namespace

TEST_SUITE("bench") {
  TEST_CASE("bytes per step equal the formulas for DDP, ZeRO-1/2/3 and offloaded ZeRO-2 on 2 and 3 ranks, padded or not") {
    for (int world : {2, 3}) {
      for (bool odd : {false, true}) {
        auto w = odd ? workload(odd_mlp, 5) : workload(even_mlp, 6);
        const auto results =
            accel::bench::compare(w, quick(world), accel::DDP{}, accel::ZeRO<1>{}, accel::ZeRO<2>{}, accel::ZeRO<3>{},
                                  accel::ZeRO<2>{.cpu_offload = true});
        REQUIRE(results.size() == 5);
        // fp32 gradients; P: the parameters, P': each bucket (one here) padded to the rank count.
        const std::uint64_t P = (odd ? 159 : 186) * 4;
        const std::uint64_t padded = (odd && world == 2 ? 160 : odd ? 159 : 186) * 4;
        check_traffic(results[0], world, {{Collective::all_reduce, P}});
        check_traffic(results[1], world, {{Collective::all_reduce, padded}, {Collective::all_gather, padded}});
        check_traffic(results[2], world, {{Collective::reduce_scatter, padded}, {Collective::all_gather, padded}});
        check_traffic(results[3], world, {{Collective::all_gather, 2 * padded}, {Collective::reduce_scatter, padded}});
        // cpu_offload moves the shards between device and host, not between ranks: ZeRO-2's traffic.
        check_traffic(results[4], world, {{Collective::reduce_scatter, padded}, {Collective::all_gather, padded}});
        for (const auto& r : results) {
          CHECK(r.name != "");
          CHECK(r.step_ms.size() == 6u);  // 3 steps x 2 rounds
          CHECK(r.ratio_by_round.size() == 2u);
          CHECK(r.samples_per_step == 4 * world);
          CHECK(r.median_ms > 0);
          for (const auto& f : r.ranks) {
            CHECK(f.model_state_bytes > 0);
            CHECK(f.peak_memory_bytes > 0);
          }
        }
        CHECK(results[0].ratio == 1.0);
        // ZeRO-1 holds a 1/world shard of SGD's (empty) state but the full
        // parameters and gradients: the same model state as DDP here.
        CHECK(results[3].ranks[0].model_state_bytes < results[0].ranks[0].model_state_bytes);
      }
    }
  }

  TEST_CASE("a strategy that fails is reported with its error and the others still run") {
    auto w = workload(even_mlp, 6);
    const std::string lines = temp_path("bench.jsonl");
    auto options = quick(2);
    options.json_lines = lines;
    const auto results = accel::bench::compare(w, options, accel::DDP{}, accel::Parallel<>{.tensor = 3},
                                               accel::bench::Case<accel::ZeRO<2>, accel::BF16>{});
    REQUIRE(results.size() == 3);
    CHECK(results[0].ok);
    CHECK_FALSE(results[1].ok);
    INFO(results[1].error);
    CHECK(results[1].error.find("tensor") != std::string::npos);
    CHECK(results[1].name == "Parallel<DDP>(t3 p1)");
    CHECK(results[2].ok);
    CHECK(results[2].name == "ZeRO-2 bf16");
    // The sharded engine's buckets, as it built them: every trainable element once; none for DDP.
    CHECK(results[0].bucket_numels.empty());
    std::int64_t bucketed = 0;
    for (auto n : results[2].bucket_numels) bucketed += n;
    CHECK_FALSE(results[2].bucket_numels.empty());
    CHECK(bucketed == 186);  // even_mlp's parameters
    // The JSON lines the main process wrote, read back.
    std::vector<accel::bench::CaseResult> read;
    std::istringstream text(take_file(lines));
    for (std::string line; std::getline(text, line);)
      read.push_back(accel::bench::case_from_json(nlohmann::json::parse(line)));
    REQUIRE(read.size() == 3);
    for (std::size_t k = 0; k < 3; ++k) {
      CHECK(read[k].name == results[k].name);
      CHECK(read[k].ok == results[k].ok);
      CHECK(read[k].error == results[k].error);
      CHECK(read[k].step_ms == results[k].step_ms);
      CHECK(read[k].predicted == results[k].predicted);
      CHECK(read[k].bucket_numels == results[k].bucket_numels);
      CHECK(read[k].ranks.size() == results[k].ranks.size());
      for (std::size_t r = 0; r < read[k].ranks.size(); ++r) {
        CHECK(read[k].ranks[r].bytes == results[k].ranks[r].bytes);
        CHECK(read[k].ranks[r].peak_memory_bytes == results[k].ranks[r].peak_memory_bytes);
      }
    }
    // The table names the failure and shows measured (formula) bytes.
    const std::string table = accel::bench::format_table(results);
    CHECK(table.find("failed:") != std::string::npos);
    CHECK(table.find("reduce_scatter 0.0007 (0.0007)") != std::string::npos);
  }

  TEST_CASE("the traffic formulas pad each bucket and add HybridShard's replica all-reduce and FP16's flag") {
    accel::bench::TrafficInputs in{.world = 4, .trainable_numel = 10, .element_size = 4, .shard_count = 2,
                                   .bucket_numels = {7, 3}};
    // Buckets 7 and 3 padded to 8 and 4: 48 bytes.
    auto hybrid = accel::bench::predicted_traffic<accel::HybridShard, accel::FP32>({}, in);
    REQUIRE(hybrid);
    CHECK((*hybrid)[static_cast<std::size_t>(Collective::all_gather)] == 96u);
    CHECK((*hybrid)[static_cast<std::size_t>(Collective::reduce_scatter)] == 48u);
    CHECK((*hybrid)[static_cast<std::size_t>(Collective::all_reduce)] == 24u);
    auto ddp = accel::bench::predicted_traffic<accel::DDP, accel::FP16>({.comm_hook = accel::CommHook::fp16}, in);
    CHECK((*ddp)[static_cast<std::size_t>(Collective::all_reduce)] == 20u + 4u);
    CHECK_FALSE(accel::bench::predicted_traffic<accel::Parallel<>, accel::FP32>({}, in).has_value());
    in.world = 1;
    CHECK((*accel::bench::predicted_traffic<accel::ZeRO<3>, accel::FP32>({}, in)) == accel::bench::TrafficBytes{});
  }
}
