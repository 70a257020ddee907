// The Accelerate helpers around the loop, on real Gloo ranks where ranks are
// involved: gather_object, pad_across_processes, reduce, find_executable_batch_size,
// split_batches, sync_with_dataloader, trackers and the progress bar on the
// main process only, and the launcher's mixed_precision against the compiled one.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <torch/optim/sgd.h>

#include <map>

#include <accel/profiling/profiler.hpp>

#include "doctest_torch.hpp"

using namespace accel::testing;

namespace {

accel::data::TensorDataset numbered(std::int64_t n) {
  return accel::data::TensorDataset(at::arange(n).unsqueeze(1).to(at::kFloat), at::arange(n));
}

std::vector<std::string> file_lines(const std::filesystem::path& file) {
  std::vector<std::string> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

}  // namespace

TEST_SUITE("toolbox") {
  TEST_CASE("gather_object, pad_across_processes, reduce(max) and gathers of every dtype on 3 ranks") {
    spawn_each({3}, [](int world, int rank) {
      accel::Trainer<accel::DDP> trainer;
      // Objects of different sizes per rank, the empty string included.
      auto words = trainer.gather_object(std::string(static_cast<std::size_t>(rank), 'x'));
      require(words == std::vector<std::string>{"", "x", "xx"}, "strings in rank order");
      std::map<std::string, std::vector<int>> mine{{"rank", {rank}}, {"items", std::vector<int>(rank, 7)}};
      auto maps = trainer.gather_object(mine);
      require(static_cast<int>(maps.size()) == world, "one object per rank");
      for (int r = 0; r < world; ++r)
        require(maps[r].at("rank") == std::vector<int>{r} && maps[r].at("items").size() == static_cast<std::size_t>(r),
                "rank " + std::to_string(r) + "'s map");

      // (rank+1, 2) filled with the rank, padded to the longest (3 rows) with -1.
      const at::Tensor ragged = at::full({rank + 1, 2}, static_cast<float>(rank));
      const at::Tensor padded = trainer.pad_across_processes(ragged, 0, -1);
      require(padded.sizes() == at::IntArrayRef({3, 2}), "padded to 3 rows");
      require(padded.narrow(0, 0, rank + 1).equal(ragged), "own rows first");
      require((padded.narrow(0, rank + 1, 2 - rank) == -1).all().item<bool>(), "padding after");
      const at::Tensor first = trainer.pad_across_processes(ragged, 0, -1, /*pad_first=*/true);
      require(first.narrow(0, 2 - rank, rank + 1).equal(ragged), "own rows last with pad_first");
      const at::Tensor gathered = trainer.gather(padded);  // what padding is for
      require(gathered.size(0) == 9, "gathered after padding");
      const at::Tensor wide = trainer.pad_across_processes(at::ones({2, rank + 1}), -1);
      require(wide.sizes() == at::IntArrayRef({2, 3}) && wide.sum().item<double>() == 2.0 * (rank + 1),
              "along the last dimension, zeros by default");

      // gather takes the dtypes Gloo's all-gather refuses (bool and int16; bf16 on 1.13), exactly.
      const at::Tensor flags = at::tensor({rank == 1 ? 1 : 0, 1}).to(at::kBool);  // 1.13 has no at::tensor of bools
      require(trainer.gather(flags).equal(at::tensor({0, 1, 1, 1, 0, 1}).to(at::kBool)), "bool gathered");
      require(trainer.gather_for_metrics(flags).scalar_type() == at::kBool, "bool stays bool");
      const at::Tensor shorts = at::full({1}, 1000 + rank, at::TensorOptions().dtype(at::kShort));
      require(trainer.gather(shorts).equal(at::tensor({1000, 1001, 1002}).to(at::kShort)), "int16 gathered");
      const at::Tensor halves = at::full({1}, 0.5 + rank, at::TensorOptions().dtype(at::kBFloat16));
      require(trainer.gather(halves).equal(at::tensor({0.5, 1.5, 2.5}).to(at::kBFloat16)), "bf16 gathered");

      const at::Tensor values = at::tensor({static_cast<float>(rank), -static_cast<float>(rank)});
      require(trainer.reduce(values, "max").equal(at::tensor({2.0f, 0.0f})), "element-wise maximum");
      require(trainer.reduce(values, "sum").equal(at::tensor({3.0f, -3.0f})), "sum");
      require(trainer.reduce(values, "mean").equal(at::tensor({1.0f, -1.0f})), "mean");
      require(values.equal(at::tensor({static_cast<float>(rank), -static_cast<float>(rank)})), "input untouched");
      bool refused = false;
      try {
        trainer.reduce(values, "min");
      } catch (const std::invalid_argument& e) {
        refused = std::string(e.what()).find("\"min\"") != std::string::npos;
      }
      require(refused, "an unknown reduction is named");
    });
  }

  TEST_CASE("find_executable_batch_size: rank 1 runs out of memory above 50, both ranks retry together and settle on 46") {
    // Accelerate's rule, 0.9 of the size: 128, 115, 103, 92, 82, 73, 65, 58, 52, 46. Rank 1 really runs out:
    // a 16 TB allocation fails in LibTorch's CPU allocator. Rank 0 never does, yet must follow.
    spawn_each({2}, [](int, int rank) {
      accel::Trainer<accel::DDP> trainer;
      std::vector<std::int64_t> tried;
      const std::int64_t found = trainer.find_executable_batch_size(128, [&](std::int64_t batch_size) {
        tried.push_back(batch_size);
        if (rank == 1 && batch_size > 50) at::empty({std::int64_t{1} << 42});
        return batch_size;
      });
      require(found == 46, "settled on " + std::to_string(found));
      require(tried == std::vector<std::int64_t>{128, 115, 103, 92, 82, 73, 65, 58, 52, 46},
              "every rank tried every size");
      const auto sizes = trainer.gather_object(found);
      require(sizes == std::vector<std::int64_t>{46, 46}, "the ranks agree");
    });
  }

  TEST_CASE("find_executable_batch_size: other errors pass through, a custom rule, and reaching zero is an error") {
    accel::Trainer<> trainer;
    CHECK_THROWS_WITH(trainer.find_executable_batch_size(8, [](std::int64_t) -> int { throw std::runtime_error("bad data"); }),
                      "bad data");
    std::vector<std::int64_t> tried;
    trainer.find_executable_batch_size(
        8,
        [&](std::int64_t b) {
          tried.push_back(b);
          if (b > 2) throw std::bad_alloc();
        },
        [](std::int64_t b) { return b / 2; });
    CHECK(tried == std::vector<std::int64_t>{8, 4, 2});
    CHECK_THROWS_WITH(trainer.find_executable_batch_size(3, [](std::int64_t) { at::empty({std::int64_t{1} << 42}); }),
                      doctest::Contains("no executable batch size found, reached zero (starting from 3)"));
  }

  TEST_CASE("split_batches: the global batch of 8 is split over 2 ranks, equal in order to one process's batch of 8") {
    spawn_each({2}, [](int, int) {
      accel::Trainer<accel::DDP> trainer;
      const accel::LoaderOptions options{.batch_size = 8, .shuffle = true, .seed = 5, .split_batches = true};
      auto loader = trainer.prepare(numbered(29), options);
      require(loader.size() == 4, "29 samples in global batches of 8: 4 steps");
      auto cursor = std::make_shared<accel::data::LoaderCursor>();
      accel::data::DataLoader<accel::data::TensorDataset> alone(numbered(29), {.batch_size = 8, .shuffle = true, .seed = 5},
                                                                1, 0, at::Device(at::kCPU), cursor,
                                                                std::make_shared<accel::data::LoaderPosition>());
      auto one = alone.begin();
      for (auto batch : loader) {
        require(batch.target.size(0) == 4, "each rank reads 4");
        const at::Tensor global = trainer.gather(batch.target);
        const at::Tensor expected = (*one).target;
        ++one;
        // The last step: 29 = 3*8 + 5; one process reads 5, the ranks 8 with 3 repeats (Accelerate pads).
        require(global.narrow(0, 0, expected.size(0)).equal(expected), "the same samples in the same order");
      }
      // The companion: per-rank batches of 8 make a global batch of 16.
      auto per_rank = trainer.prepare(numbered(29), {.batch_size = 8, .shuffle = true, .seed = 5});
      require(trainer.gather((*per_rank.begin()).target).size(0) == 16, "without split_batches, 16 a step");
      bool refused = false;
      try {
        trainer.prepare(numbered(29), {.batch_size = 7, .split_batches = true});
      } catch (const std::invalid_argument& e) {
        refused = std::string(e.what()).find("divides by the 2 data ranks, got 7") != std::string::npos;
      }
      require(refused, "a batch that does not divide is refused");
    });
  }

  TEST_CASE("even_batches off: nothing repeated, as many batches on every rank (the short ones smaller or empty), "
            "gather_for_metrics counts each sample once") {
    spawn_each({3}, [](int, int rank) {
      accel::Trainer<accel::DDP> trainer;
      for (auto sharding : {accel::Sharding::batches, accel::Sharding::samples}) {
        // 9 samples in batches of 2 over 3 ranks: Accelerate's order deals [0,1] [2,3] [4,5] [6,7] [8]:
        // ranks read 4, 3 and 2 samples; every rank runs 2 batches, rank 2's second one empty.
        auto loader = trainer.prepare(numbered(9), {.batch_size = 2, .shuffle = true, .seed = 1, .sharding = sharding,
                                                    .even_batches = false});
        require(loader.size() == 2, "as many batches on every rank");
        std::vector<at::Tensor> seen;
        std::int64_t mine = 0;
        for (auto batch : loader) {
          mine += batch.target.size(0);
          seen.push_back(trainer.gather_for_metrics(batch.target));
        }
        const std::int64_t expected = sharding == accel::Sharding::batches ? std::vector<std::int64_t>{4, 3, 2}[rank]
                                                                            : std::vector<std::int64_t>{3, 3, 3}[rank];
        require(mine == expected, "rank " + std::to_string(rank) + " read " + std::to_string(mine));
        const auto all = std::get<0>(at::cat(seen).sort());
        require(all.equal(at::arange(9)), "each of the 9 samples exactly once");
      }
      // The companion: with even_batches (the default) the tail is padded and gather keeps the repeats.
      auto even = trainer.prepare(numbered(9), {.batch_size = 2, .shuffle = true, .seed = 1});
      std::int64_t gathered = 0;
      for (auto batch : even) gathered += trainer.gather(batch.target).size(0);
      require(gathered == 12, "even batches: 12 rows gathered for 9 samples");
    });
  }

  TEST_CASE("a checkpoint at an epoch's end resumes at the next epoch, and an evaluation loader is read whole again") {
    const auto dir = std::filesystem::path(temp_path("epoch_end"));
    RemoveOnExit cleanup({dir});
    auto run = [&](bool resume) {
      accel::Trainer<> trainer(accel::TrainerOptions{.project_dir = dir});
      auto net = tiny_mlp(0, 1, 4, 6);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
      trainer.prepare(net, opt);
      auto train = trainer.prepare(numbered(6), {.batch_size = 2, .shuffle = true});
      auto eval = trainer.prepare(numbered(4), {.batch_size = 2});
      if (resume) REQUIRE(trainer.load_latest_state().has_value());
      std::vector<std::int64_t> evaluated;
      for (std::int64_t epoch = train.epoch(); epoch < 2; ++epoch) {
        train.set_epoch(epoch);
        for (auto batch : train) trainer.step([&] { return loss_of(net, batch.data, batch.target); });
        std::int64_t seen = 0;
        for (auto batch : eval) seen += batch.target.size(0);
        evaluated.push_back(seen);
        if (!resume && epoch == 0) trainer.save_state();  // after epoch 0 and its evaluation
      }
      return std::make_pair(train.epoch(), evaluated);
    };
    CHECK(run(false) == std::make_pair(std::int64_t{1}, std::vector<std::int64_t>{4, 4}));
    // Resumed: epoch 1 only (not epoch 0 again with every batch skipped), its evaluation over all 4 samples.
    CHECK(run(true) == std::make_pair(std::int64_t{1}, std::vector<std::int64_t>{4}));
  }

  TEST_CASE("sync_with_dataloader: the epoch's last batch syncs (and restarts the cycle) only when on") {
    auto syncs = [](bool with_dataloader) {
      accel::Trainer<> trainer(accel::TrainerOptions{.gradient_accumulation_steps = 4,
                                                     .sync_with_dataloader = with_dataloader});
      auto net = tiny_mlp(0, 1, 4, 6);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
      trainer.prepare(net, opt);
      auto loader = trainer.prepare(numbered(6), {.batch_size = 1});
      std::string seen;
      for (int epoch = 0; epoch < 2; ++epoch) {
        loader.set_epoch(epoch);
        for (auto batch : loader)
          trainer.step([&] {
            seen += trainer.sync_gradients() ? 'S' : '.';
            return loss_of(net, batch.data, batch.target);
          });
        seen += '|';
      }
      return std::make_pair(seen, trainer.completed_steps());
    };
    CHECK(syncs(true) == std::make_pair(std::string("...S.S|...S.S|"), std::int64_t{4}));
    CHECK(syncs(false) == std::make_pair(std::string("...S..|.S...S|"), std::int64_t{3}));
  }

  TEST_CASE("trackers on 2 ranks: the main process writes, the other keeps none; steps default to optimizer steps") {
    const auto dir = std::filesystem::path(temp_path("trackers"));
    RemoveOnExit cleanup({dir.string()});
    spawn_each({2}, [&](int, int rank) {
      accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.project_dir = dir, .log_with = {"jsonl", "csv"}});
      auto net = tiny_mlp(0);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
      trainer.prepare(net, opt);
      bool refused = false;
      try {
        trainer.log({{"loss", 1.0}});
      } catch (const std::logic_error&) {
        refused = true;
      }
      require(refused, "log before init_trackers is refused on every rank");
      trainer.init_trackers("run", {{"lr", 0.1}, {"rank", rank}});
      require((trainer.get_tracker<accel::tracking::JsonlTracker>() != nullptr) == (rank == 0), "trackers on rank 0 only");
      for (int step = 0; step < 2; ++step) {
        auto batch = global_batch(step, 4);
        auto loss = trainer.step([&] { return loss_of(net, batch.x, batch.y); });
        trainer.log({{"loss", loss.item<double>()}, {"from_rank", rank}});
      }
      trainer.log({{"final", true}}, 10);
      trainer.end_training();
      require(!trainer.progress_bar(10, {.force = true}).enabled() || rank == 0, "the bar draws on rank 0 only");
    });
    auto rows = file_lines(dir / "run" / "metrics.jsonl");
    REQUIRE(rows.size() == 3);
    CHECK(nlohmann::json::parse(rows[0])["step"] == 1);
    CHECK(nlohmann::json::parse(rows[0])["from_rank"] == 0);
    CHECK(nlohmann::json::parse(rows[1])["step"] == 2);
    CHECK(nlohmann::json::parse(rows[2])["step"] == 10);
    CHECK(nlohmann::json::parse(rows[2])["final"] == true);
    CHECK(file_lines(dir / "run" / "metrics.csv").size() == 4);
    CHECK(nlohmann::json::parse(read_file((dir / "run" / "config.json").string()))["rank"] == 0);
    CHECK_THROWS_WITH_AS(accel::Trainer<>(accel::TrainerOptions{.log_with = {"wandb"}}), doctest::Contains("'wandb'"),
                         accel::ConfigurationError);
  }

  TEST_CASE("profiler: the schedule's active steps as one Chrome trace per rank, with LibTorch's operators and accel's ranges") {
    const auto dir = std::filesystem::path(temp_path("profiles"));
    RemoveOnExit cleanup({dir});
    spawn_each({2}, [&](int, int rank) {
      accel::Trainer<accel::DDP> trainer;
      auto net = tiny_mlp(0);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
      trainer.prepare(net, opt);
      // Steps 0: wait, 1: warmup, 2-3: active (cycle 0); 4: wait, 5: warmup, 6-7: active (cycle 1); then done.
      accel::profiling::Profiler profiler(trainer, {.wait = 1, .warmup = 1, .active = 2, .repeat = 2,
                                                    .output_trace_dir = dir});
      for (int step = 0; step < 10; ++step) {
        auto batch = global_batch(step, 4);
        trainer.step([&] { return loss_of(net, batch.x, batch.y); });
        profiler.step();
        require(profiler.traces().size() == (step >= 7 ? 2u : step >= 3 ? 1u : 0u),
                "a trace is written as its active window ends (step " + std::to_string(step) + ")");
      }
      require(profiler.traces().back() == dir / ("trace_rank" + std::to_string(rank) + "_cycle1.json"), "named by rank and cycle");
    });
    for (int rank = 0; rank < 2; ++rank) {
      CAPTURE(rank);
      const auto trace = nlohmann::json::parse(read_file((dir / ("trace_rank" + std::to_string(rank) + "_cycle0.json")).string()));
      REQUIRE(trace["traceEvents"].is_array());
      std::map<std::string, int> names;
      int steps_of_addmm = 0;
      for (const auto& event : trace["traceEvents"]) {
        REQUIRE(event["pid"] == rank);  // one process per rank, so Perfetto shows them side by side
        const std::string name = event["name"];
        ++names[name.substr(0, name.find(' '))];
        if (name == "aten::addmm") ++steps_of_addmm;
        if (event["ph"] == "X") CHECK(event["dur"].get<double>() >= 0);
      }
      INFO(nlohmann::json(names).dump());
      CHECK(names["process_name"] == 1);
      // 2 active steps, each: the MLP's 3 Linear layers forward (addmm) and the DDP bucket all-reduce and its wait.
      CHECK(steps_of_addmm == 6);
      CHECK(names["accel::all_reduce"] >= 2);
      CHECK(names["accel::wait"] >= 2);
      bool bucket_wait = false;
      for (const auto& event : trace["traceEvents"])
        bucket_wait = bucket_wait || event["name"].get<std::string>().starts_with("accel::wait all-reduce of DDP gradient bucket");
      CHECK(bucket_wait);
    }
    CHECK_FALSE(std::filesystem::exists(dir / "trace_rank0_cycle2.json"));  // repeat = 2 cycles only
  }

  TEST_CASE("the launcher's mixed_precision: absent, the compiled precision runs; asked for, a mismatch says what to change") {
    ScopedEnv env;
    env.unset("ACCELERATE_MIXED_PRECISION");
    env.unset("ACCEL_MIXED_PRECISION_FROM");
    CHECK_NOTHROW(accel::Trainer<accel::SingleProcess, accel::BF16>{});  // a plain `accel launch` sets nothing
    env.set("ACCELERATE_MIXED_PRECISION", "no");
    env.set("ACCEL_MIXED_PRECISION_FROM", "--mixed_precision");
    CHECK_THROWS_WITH_AS((accel::Trainer<accel::SingleProcess, accel::BF16>{}),
                         doctest::Contains("mixed_precision=no was asked for (by accel launch --mixed_precision no) but "
                                           "this program's Trainer is compiled with mixed_precision=bf16: launch with "
                                           "--mixed_precision bf16"),
                         accel::ConfigurationError);
    env.set("ACCEL_MIXED_PRECISION_FROM", "config file /tmp/c.json");
    CHECK_THROWS_WITH((accel::Trainer<accel::SingleProcess, accel::BF16>{}),
                      doctest::Contains("(by mixed_precision in config file /tmp/c.json)"));
    CHECK_NOTHROW(accel::Trainer<>{});  // asked for no, compiled fp32: they agree
  }
}
