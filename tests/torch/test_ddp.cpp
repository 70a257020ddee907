// DDP on real processes and real Gloo process groups (accel::spawn forks the
// ranks on loopback). Every spawn has a timeout: a hang fails the test.
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sort.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>


#include <chrono>
#include <csignal>
#include <thread>

#include <cstdio>

#include "doctest_torch.hpp"

using namespace accel::testing;
using namespace std::chrono_literals;

namespace {

// Trains `steps` SGD-with-momentum steps on a plain single process with the
// global batch: the reference every DDP run must match.
torch::nn::Sequential single_process_reference(int steps, std::int64_t global) {
  auto net = tiny_mlp(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    auto batch = global_batch(step, global);
    opt.zero_grad();
    loss_of(net, batch.x, batch.y).backward();
    opt.step();
  }
  return net;
}

}  // namespace

TEST_SUITE("ddp") {
  TEST_CASE("equivalence: 2 and 3 ranks with batch b equal one process on the global batch") {
    // Tolerance 1e-5 (fp32): the reductions sum in a different order than
    // the single process's matmul does, so bits may differ, values must not.
    spawn_each({2, 3}, [](int world, int rank) {
      const std::int64_t per_rank = 6, steps = 5;
      // Several small buckets, so bucketing and launch order are exercised.
      accel::Trainer<accel::DDP> trainer(accel::DDP{.bucket_cap_mb = 0.0005, .first_bucket_cap_mb = 0.0002});
      auto net = tiny_mlp(rank == 0 ? 0 : 99);  // other ranks start elsewhere: prepare broadcasts rank 0's
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      trainer.prepare(net, opt);
      require(trainer.strategy_engine().bucket_count() > 2, "several buckets");
      for (int step = 0; step < steps; ++step) {
        auto batch = global_batch(step, per_rank * world);
        auto x = batch.x.narrow(0, rank * per_rank, per_rank), y = batch.y.narrow(0, rank * per_rank, per_rank);
        trainer.step([&] { return loss_of(net, x, y); });
      }
      auto reference = single_process_reference(steps, per_rank * world);
      const double diff = max_param_diff(*net, *reference);
      // measured (1.13): 4.5e-8 on 2 ranks, 6.0e-8 on 3
      require(diff < 3e-7, "max |DDP - single process| = " + sci(diff));
      // The companion: this rank's rows alone, as without communication, are far outside the bound.
      auto alone = tiny_mlp(0);
      torch::optim::SGD alone_opt(alone->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < steps; ++step) {
        auto batch = global_batch(step, per_rank * world);
        alone_opt.zero_grad();
        loss_of(alone, batch.x.narrow(0, rank * per_rank, per_rank), batch.y.narrow(0, rank * per_rank, per_rank)).backward();
        alone_opt.step();
      }
      const double apart = max_param_diff(*net, *alone);
      require(apart > 1e-3, "a rank alone is only " + sci(apart) + " away: the bound could not fail");
    });
  }

  TEST_CASE("overlap: the first bucket's all-reduce is issued before backward has finished") {
    accel::spawn(
        2,
        [](int rank) {
          accel::Trainer<accel::DDP> trainer(accel::DDP{.bucket_cap_mb = 0.001, .first_bucket_cap_mb = 0.001});
          auto net = tiny_mlp(0, 8, 32, 4, 4);
          torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
          trainer.prepare(net, opt);
          auto& engine = trainer.strategy_engine();
          require(engine.bucket_count() >= 3, "at least 3 buckets");
          // Bucket 0 holds the last layer: reverse registration order.
          require(engine.bucket_parameters(0).front().rfind("8.", 0) == 0,
                  "bucket 0 starts with the last layer, got " + engine.bucket_parameters(0).front());
          engine.record_events(true);
          auto batch = global_batch(0, 8);
          trainer.backward(loss_of(net, batch.x.narrow(0, rank * 4, 4), batch.y.narrow(0, rank * 4, 4)));
          const auto& events = engine.events();
          std::size_t first_launch = events.size(), last_ready = 0, launches = 0;
          for (std::size_t i = 0; i < events.size(); ++i) {
            if (events[i].kind == accel::strategy::DDPEvent::bucket_launched) {
              first_launch = std::min(first_launch, i);
              require(events[i].index == launches++, "buckets launch in bucket order");
            } else {
              last_ready = i;
            }
          }
          require(launches == engine.bucket_count(), "every bucket launched during backward");
          require(first_launch < last_ready, "bucket 0 was launched before the last gradient was ready");
          trainer.optimizer_step();
        },
        bounded());
  }

  TEST_CASE("gather_for_metrics counts every sample exactly once when the dataset does not divide") {
    spawn_each({2, 3}, [](int, int) {
      accel::Trainer<accel::DDP> trainer;
      const std::int64_t n = 11;
      auto loader = trainer.prepare(
          accel::data::TensorDataset(at::arange(n).unsqueeze(1).to(at::kFloat), at::arange(n)),
          {.batch_size = 2, .shuffle = true, .seed = 3});
      std::vector<at::Tensor> gathered;
      std::int64_t plain = 0;
      for (auto batch : loader) {
        gathered.push_back(trainer.gather_for_metrics(batch.target));
        plain += trainer.gather(batch.target).size(0);
      }
      auto all = std::get<0>(at::cat(gathered).sort());
      require(all.equal(at::arange(n)), "each of the 11 samples exactly once");
      // Accelerate's order pads 11 samples to whole rounds of 2 per rank: 12 rows on 2 ranks (3 rounds of 4)
      // and on 3 ranks (2 rounds of 6); gather keeps that padding, gather_for_metrics drops it.
      require(plain == 12, "gather keeps the padding: " + std::to_string(plain) + " rows, 12 expected");
    });
  }

  TEST_CASE("a failed CHECK inside a rank fails that rank, and with it the spawn") {
    // tests/torch/main.cpp's listener: without it rank 1 would exit 0 and the failure be lost.
    std::string error;
    try {
      accel::spawn(2, [](int rank) { CHECK(rank == 0); }, bounded(std::chrono::seconds(30)));
    } catch (const std::exception& e) {
      error = e.what();
    }
    INFO(error);
    CHECK(error.find("rank 1") != std::string::npos);
    CHECK(error.find("rank 0") == std::string::npos);
  }

  TEST_CASE("gather, reduce and wait_for_everyone across ranks") {
    accel::spawn(
        3,
        [](int rank) {
          accel::Trainer<accel::DDP> trainer;
          auto mine = at::ones({2}) * rank;
          require(trainer.gather(mine).equal(at::cat({at::ones({2}) * 0, at::ones({2}) * 1, at::ones({2}) * 2})),
                  "gather concatenates in rank order");
          require(trainer.reduce(mine).equal(at::ones({2}) * 3), "reduce sums");
          require(trainer.reduce(mine, "mean").equal(at::ones({2})), "reduce averages");
          trainer.wait_for_everyone();
        },
        bounded());
  }

  TEST_CASE("prepare's broadcast: rank 0's state in chunks of the cap, a larger tensor alone, dtypes apart") {
    accel::spawn(
        2,
        [](int rank) {
          accel::Trainer<accel::DDP> trainer;
          // weight 0: 800 bytes, over the 300-byte cap (alone, in place); the rest in chunks;
          // BatchNorm's step count (int64) a group of its own
          torch::nn::Sequential net(torch::nn::Linear(20, 10), torch::nn::Linear(10, 6), torch::nn::Linear(6, 2),
                                    torch::nn::BatchNorm1d(2));
          net->register_buffer("nothing", at::empty({0}, at::TensorOptions().dtype(at::kDouble)));  // nothing to send
          auto state = [&] {
            std::vector<at::Tensor> all = net->parameters();
            for (auto& b : net->buffers()) all.push_back(b);
            return all;
          };
          // Each rank its own values; rank 0's are (i + 1) * (0, 1, 2, ...).
          auto expected = [](const at::Tensor& t, std::size_t i) {
            return (at::arange(t.numel(), t.options()) * static_cast<std::int64_t>(i + 1)).view(t.sizes());
          };
          {
            c10::NoGradGuard no_grad;
            auto all = state();
            for (std::size_t i = 0; i < all.size(); ++i) all[i].copy_(expected(all[i], i) + rank * 1000);
          }
          const auto before = accel::comm::process_traffic();
          accel::strategy::detail::broadcast_module_state(*net, trainer.data_group(), "test broadcast", 300);
          const auto all = state();
          for (std::size_t i = 0; i < all.size(); ++i)
            require(all[i].equal(expected(all[i], i)), "tensor " + std::to_string(i) + " is rank 0's");
          // 12 float tensors (weights 800, 240, 48 bytes; biases 40, 24, 8; BatchNorm's 4 of 8) and one int64:
          // [w0] alone, [b0 w1], [b1 w2 b2 gamma beta mean var], [count]; the empty double buffer not at all
          require((accel::comm::process_traffic() - before).calls_of(accel::comm::Collective::broadcast) == 4, "four broadcasts");
        },
        bounded());
  }

  TEST_CASE("set_seed: the same stream on every rank, or with device_specific the seed plus the rank") {
    accel::spawn(
        2,
        [](int rank) {
          accel::Trainer<accel::DDP> trainer;
          trainer.set_seed(7);
          auto shared = at::randn({8});
          trainer.set_seed(7, /*device_specific=*/true);
          auto own = at::randn({8});
          at::manual_seed(7 + rank);  // Accelerate's set_seed(seed, device_specific=True): seed + process index
          auto expected = at::randn({8});
          require(own.equal(expected), "device_specific draws from seed + rank");
          auto all_shared = trainer.communicator().all_gather(shared, "test");
          auto all_own = trainer.communicator().all_gather(own, "test");
          require(all_shared[0].equal(all_shared[1]), "set_seed(7): the same draws on both ranks");
          require(!all_own[0].equal(all_own[1]), "device_specific: different draws per rank");
        },
        bounded());
  }

  TEST_CASE("unused parameters: an error that names them, or find_unused_parameters") {
    // A model whose second head is unused by the loss.
    struct TwoHeads : torch::nn::Module {
      TwoHeads() {
        at::manual_seed(0);
        body = register_module("body", torch::nn::Linear(8, 8));
        used = register_module("used", torch::nn::Linear(8, 4));
        unused = register_module("unused", torch::nn::Linear(8, 4));
      }
      torch::nn::Linear body{nullptr}, used{nullptr}, unused{nullptr};
    };
    accel::spawn(
        2,
        [](int rank) {
          for (bool find_unused : {false, true}) {
            for (bool static_graph : {false, true}) {
              if (!find_unused && static_graph) continue;
              auto model = std::make_shared<TwoHeads>();
              torch::nn::ModuleHolder<TwoHeads> net(model);
              torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
              accel::Trainer<accel::DDP> trainer(
                  accel::DDP{.find_unused_parameters = find_unused, .static_graph = static_graph});
              trainer.prepare(net, opt);
              for (int step = 0; step < 2; ++step) {
                auto batch = global_batch(step, 8);
                auto x = batch.x.narrow(0, rank * 4, 4), y = batch.y.narrow(0, rank * 4, 4);
                auto forward = [&] {
                  return torch::nn::functional::cross_entropy(model->used(model->body(x).tanh()), y);
                };
                if (find_unused) {
                  trainer.step(forward);
                } else {
                  try {
                    trainer.step(forward);
                    require(false, "a parameter without gradient must be an error");
                  } catch (const std::runtime_error& e) {
                    require(std::string(e.what()).find("'unused.weight'") != std::string::npos ||
                                std::string(e.what()).find("'unused.bias'") != std::string::npos,
                            std::string("the error names the parameter: ") + e.what());
                    require(std::string(e.what()).find("find_unused_parameters") != std::string::npos,
                            "the error names the fix");
                    break;
                  }
                }
              }
              if (find_unused) require(model->unused->weight.grad().abs().sum().item<double>() == 0.0,
                                       "unused gradients are zero");
            }
          }
        },
        bounded());
  }

  TEST_CASE("ranks with different models fail at prepare, naming the rank") {
    accel::spawn(
        2,
        [](int rank) {
          accel::Trainer<accel::DDP> trainer;
          auto net = tiny_mlp(0, 8, rank == 0 ? 16 : 12);
          torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
          try {
            trainer.prepare(net, opt);
            require(false, "prepare must refuse different models");
          } catch (const std::runtime_error& e) {
            require(std::string(e.what()).find("rank 1's model") != std::string::npos, e.what());
          }
        },
        bounded());
  }

  TEST_CASE("a rank that never joins a collective: the other fails after the configured timeout") {
    const std::string text = spawn_two_and_read_report("hang", [](int rank, const std::string& result) {
      accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.timeout = 2s});
      if (rank == 1) {
        std::this_thread::sleep_for(8s);  // never reaches the barrier in time
        return;
      }
      report_collective_failure(result, [&] { trainer.wait_for_everyone(); });
    });
    INFO(text);
    REQUIRE(reports_failure(text));
    const double seconds = failure_seconds(text);
    CHECK(seconds >= 1.5);
    CHECK(seconds < 6.0);  // the 2 s timeout and the 0.75 s roll call
    CHECK(text.find("rank 0: barrier") != std::string::npos);
    // Rank 1 is alive (asleep): the error says so rather than calling it dead.
    CHECK(text.find("every other rank is alive") != std::string::npos);
  }
}
