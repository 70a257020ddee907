// Faults and the cross-rank helpers: a dead rank named by every survivor
// (NOTE [Naming the dead rank]), SIGPIPE that no longer kills a survivor
// silently, main_process_first, on_main_process, set_trigger/check_trigger.
// Ranks are forked as torchrun or srun would start them (no `accel launch`).
#include <torch/optim/sgd.h>

#include <csignal>
#include <thread>

#include "doctest_torch.hpp"

using namespace accel::testing;
using namespace std::chrono_literals;

namespace {

// `world` ranks train DDP steps; rank `victim` is SIGKILLed once the others
// are inside the all-reduce. Each survivor writes how its step ended to
// <result>_<rank>; returns those texts (the victim's is empty).
std::vector<std::string> kill_one(int world, int victim) {
  const std::string result = temp_path("killed");
  auto options = bounded(60s);
  options.stop_on_failure = false;  // watch the survivors fail by themselves
  try {
    accel::spawn(
        world,
        [&](int rank) {
          accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.timeout = 5s});
          auto net = tiny_mlp(0);
          torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
          trainer.prepare(net, opt);
          trainer.wait_for_everyone();
          if (rank == victim) {
            std::this_thread::sleep_for(300ms);  // the others are inside the all-reduce by now
            ::raise(SIGKILL);
          }
          report_collective_failure(result + "_" + std::to_string(rank), [&] {
            auto batch = global_batch(0, 4);
            trainer.step([&] { return loss_of(net, batch.x, batch.y); });
          });
        },
        options);
  } catch (const accel::SpawnError&) {
    // The victim's death fails the spawn; what matters is what the survivors said.
  }
  std::vector<std::string> texts;
  for (int rank = 0; rank < world; ++rank) texts.push_back(take_file(result + "_" + std::to_string(rank)));
  return texts;
}

}  // namespace

TEST_SUITE("faults") {
  TEST_CASE("a rank killed mid-collective is named by every survivor, within the timeout") {
    for (auto [world, victim] : {std::pair{2, 1}, std::pair{3, 2}, std::pair{3, 1}}) {
      const auto start = std::chrono::steady_clock::now();
      const auto texts = kill_one(world, victim);
      for (int rank = 0; rank < world; ++rank) {
        if (rank == victim) continue;
        INFO("world ", world, ", victim ", victim, ", survivor ", rank, ": ", texts[rank]);
        REQUIRE(reports_failure(texts[rank]));
        CHECK(texts[rank].find("rank " + std::to_string(rank) + ": all-reduce of DDP gradient bucket") !=
              std::string::npos);
        CHECK(texts[rank].find("rank " + std::to_string(victim) + " is gone") != std::string::npos);
        CHECK(texts[rank].find("collective #") != std::string::npos);
        CHECK(failure_seconds(texts[rank]) < 10.0);  // the 5 s timeout, and the roll call
      }
      CHECK(std::chrono::steady_clock::now() - start < 30s);
    }
  }

  TEST_CASE("rank 0 killed: the survivors say it is gone, with the store it hosted") {
    const auto texts = kill_one(3, 0);
    for (int rank : {1, 2}) {
      INFO("survivor ", rank, ": ", texts[rank]);
      REQUIRE(reports_failure(texts[rank]));
      CHECK(texts[rank].find("rank 0 is gone") != std::string::npos);
    }
  }

  TEST_CASE("connecting ignores SIGPIPE (a write to a dead peer fails instead of killing the rank), unless the "
            "program handles it") {
    accel::spawn(
        2,
        [](int rank) {
          if (rank == 1) ::signal(SIGPIPE, [](int) {});  // the program's own handler
          accel::Trainer<accel::DDP> trainer;
          struct sigaction now {};
          ::sigaction(SIGPIPE, nullptr, &now);
          if (rank == 0) require(now.sa_handler == SIG_IGN, "SIGPIPE ignored after connecting");
          else require(now.sa_handler != SIG_IGN && now.sa_handler != SIG_DFL, "the program's handler kept");
        },
        bounded());
  }

  TEST_CASE("main_process_first: the main process's block finishes before the others' start; on_main_process") {
    const std::string marker = temp_path("first");
    RemoveOnExit cleanup({marker});
    accel::spawn(
        3,
        [&](int rank) {
          accel::Trainer<accel::DDP> trainer;
          {
            auto first = trainer.main_process_first();
            if (rank == 0) {
              std::this_thread::sleep_for(300ms);  // the others would overtake it without the barrier
              std::ofstream(marker) << "done";
            } else {
              require(read_file(marker) == "done", "rank " + std::to_string(rank) + " ran before the main process");
            }
          }
          int calls = 0;
          trainer.on_main_process([&] { ++calls; });
          require(calls == (rank == 0 ? 1 : 0), "on_main_process runs on rank 0 only");
          trainer.wait_for_everyone();  // all left the block: no barrier pending on any rank
        },
        bounded());
  }

  TEST_CASE("main_process_first without the barrier would let the others overtake (companion)") {
    const std::string marker = temp_path("overtake");
    RemoveOnExit cleanup({marker});
    const std::string seen = temp_path("overtake_seen");
    accel::spawn(
        2,
        [&](int rank) {
          accel::Trainer<accel::DDP> trainer;
          if (rank == 0) {
            std::this_thread::sleep_for(300ms);
            std::ofstream(marker) << "done";
          } else {
            std::ofstream(seen) << read_file(marker);
          }
          trainer.wait_for_everyone();
        },
        bounded());
    CHECK(take_file(seen) == "");
  }

  TEST_CASE("set_trigger on one rank: every rank's check_trigger sees it at the same step, then it resets") {
    accel::spawn(
        3,
        [](int rank) {
          accel::Trainer<accel::DDP> trainer;
          for (int step = 0; step < 6; ++step) {
            if (rank == 1 && step == 3) trainer.set_trigger();
            const bool stop = trainer.check_trigger();
            require(stop == (step == 3), "rank " + std::to_string(rank) + " step " + std::to_string(step) +
                                             ": check_trigger " + (stop ? "true" : "false"));
          }
        },
        bounded());
  }
}
