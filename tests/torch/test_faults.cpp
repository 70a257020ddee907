// Faults and the cross-rank helpers: a dead rank named by every survivor
// (NOTE [Naming the dead rank]), SIGPIPE that no longer kills a survivor
// silently, debug mode's check that the ranks agree on each collective
// (NOTE [Debug mode]), main_process_first, on_main_process,
// set_trigger/check_trigger, and leaving the job in order (NOTE [Leaving
// the job]).
// Ranks are forked as torchrun or srun would start them (no `accel launch`).
#include <nlohmann/json.hpp>  // gather_object of JSON values (accel declares it only when compiled once)
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/optim/sgd.h>

#include <csignal>
#include <filesystem>
#include <thread>

#include "doctest_torch.hpp"

using namespace accel::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

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

  TEST_CASE("leaving the job: rank 0 keeps the store it hosts until the other ranks have left; a rank that threw "
            "does not wait; a collective with a rank that ended names it as ended") {
    // Rank 1 works on after rank 0's function returned and then reads the
    // store: before NOTE [Leaving the job], rank 0's process had ended and
    // taken the store with it.
    accel::spawn(
        2,
        [](int rank) {
          { accel::Trainer<accel::DDP> trainer; trainer.wait_for_everyone(); }
          if (rank == 0) return;
          std::this_thread::sleep_for(1500ms);
          c10d::TCPStoreOptions options;
          options.port = static_cast<std::uint16_t>(std::stoi(std::getenv("MASTER_PORT")));
          options.timeout = 5s;
          c10d::TCPStore store("127.0.0.1", options);
          require(store.check({"accel/left/0"}), "rank 0 said it left, and its store still answers");
          require(!store.check({"accel/left/1"}), "this rank has not left yet");
        },
        bounded(60s));

    // Rank 0 throws while rank 1 is still busy: it leaves without waiting
    // (a launcher stops the others only once rank 0 has exited).
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(accel::spawn(
                        2,
                        [](int rank) {
                          accel::Trainer<accel::DDP> trainer;
                          trainer.wait_for_everyone();
                          if (rank == 0) throw std::runtime_error("rank 0 fails");
                          std::this_thread::sleep_for(30s);
                        },
                        bounded(60s)),
                    accel::SpawnError);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(accel::comm::Liveness::longest_leave_wait));

    // Rank 1 ends; rank 0 then calls a collective it cannot complete.
    const std::string result = temp_path("left");
    accel::spawn(
        2,
        [&](int rank) {
          accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.timeout = 5s});
          trainer.wait_for_everyone();
          if (rank == 1) return;
          std::this_thread::sleep_for(500ms);
          report_collective_failure(result, [&] { trainer.wait_for_everyone(); });
        },
        bounded(60s));
    const std::string text = take_file(result);
    INFO(text);
    REQUIRE(reports_failure(text));
    CHECK(text.find("rank 1 has already ended its program (left the job)") != std::string::npos);
  }

  TEST_CASE("a collective the backend refuses at once (int16 on Gloo) is said to be refused, not blamed on a rank that "
            "did not come") {
    spawn_each({2}, [](int, int rank) {
      accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.timeout = 30s});
      const auto start = std::chrono::steady_clock::now();
      try {
        trainer.reduce(at::ones({3}, at::TensorOptions().dtype(at::kShort)));
      } catch (const accel::comm::CollectiveError& e) {
        const std::string what = e.what();
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        require(what.find("rank " + std::to_string(rank) + ": reduce(sum)") != std::string::npos, what);
        require(what.find("failed at once, not at its timeout: the backend refused it") != std::string::npos, what);
        require(what.find("did not reach this collective") == std::string::npos, what);
        require(what.find("Invalid scalar type") != std::string::npos, what);  // Gloo's own reason, kept
        require(seconds < 15, "within half the 30 s timeout: " + std::to_string(seconds) + " s");
        // Neither rank leaves before the other has read its error: a rank that exits takes the store it
        // hosts with it, and the other's diagnosis would then call it gone (seen once in CI). The refused
        // collective never reached the wire, so the group still agrees on what comes next.
        trainer.wait_for_everyone();
        return;
      }
      require(false, "Gloo reduced an int16 tensor: pick another dtype it refuses for this test");
    });
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
          // Gloo's handshake can still be under way on the peer when this rank's
          // connect returns: leaving at once closed it under rank 1 (seen once).
          trainer.wait_for_everyone();
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

  TEST_CASE("debug mode: a collective called on the main process only raises on every rank, with each rank's view, "
            "instead of pairing with the others' next collective") {
    const std::string result = temp_path("debug_main_only");
    accel::spawn(
        2,
        [&](int rank) {
          accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.timeout = 10s, .debug = true});
          report_collective_failure(result + "_" + std::to_string(rank), [&] {
            if (trainer.is_main_process()) (void)trainer.gather_for_metrics(at::ones({3}));
            trainer.wait_for_everyone();
          });
        },
        bounded(60s));
    for (int rank : {0, 1}) {
      const std::string text = take_file(result + "_" + std::to_string(rank));
      INFO("rank ", rank, ": ", text);
      REQUIRE(reports_failure(text));
      CHECK(text.find("accel: rank " + std::to_string(rank) + ": the ranks of a group of 2 disagree on its "
                      "collective #1 (debug mode)") != std::string::npos);
      const std::string me = " (this rank)";
      CHECK(text.find("rank 0" + (rank == 0 ? me : "") + ": all_gather #1 Float[3] for gather_for_metrics") !=
            std::string::npos);
      CHECK(text.find("rank 1" + (rank == 1 ? me : "") + ": barrier #1 for barrier (wait_for_everyone)") !=
            std::string::npos);
      CHECK(failure_seconds(text) < 5.0);  // found at once, not at the 10 s timeout
    }
  }

  TEST_CASE("debug mode: a shape that differs on one rank is caught before anything is reduced; off, nothing is "
            "checked") {
    const std::string result = temp_path("debug_shape");
    for (bool debug : {true, false}) {
      accel::spawn(
          2,
          [&](int rank) {
            auto comm = accel::comm::Communicator::connect(accel::comm::world_from_environment(),
                                                           accel::comm::BackendKind::gloo, 10s);
            comm.set_debug(debug);
            // The check is one all-gather of each rank's signature before the collective.
            using accel::comm::Collective;
            const auto gathers_before = accel::comm::process_traffic().calls_of(Collective::all_gather);
            at::Tensor agreed = at::full({2, 2}, rank + 1.0);
            comm.all_reduce(agreed, "agreed");  // the same shape everywhere: passes either way
            require(agreed.equal(at::full({2, 2}, 3.0)), "the agreed all-reduce sums");
            const auto checks = accel::comm::process_traffic().calls_of(Collective::all_gather) - gathers_before;
            require(checks == (debug ? 1u : 0u), "checks sent: " + std::to_string(checks));
            if (!debug) {
              std::ofstream(result + "_" + std::to_string(rank)) << "off";
              return;
            }
            at::Tensor mine = at::ones({rank == 0 ? 3 : 4});
            report_collective_failure(result + "_" + std::to_string(rank),
                                      [&] { comm.all_reduce(mine, "all-reduce of the loss"); });
            require(mine.equal(at::ones({rank == 0 ? 3 : 4})), "rank " + std::to_string(rank) + ": nothing reduced");
          },
          bounded(60s));
      for (int rank : {0, 1}) {
        const std::string text = take_file(result + "_" + std::to_string(rank));
        INFO("debug ", debug, ", rank ", rank, ": ", text);
        if (!debug) {
          CHECK(text == "off");
          continue;
        }
        REQUIRE(reports_failure(text));
        CHECK(text.find("disagree on its collective #2 (debug mode)") != std::string::npos);
        CHECK(failure_seconds(text) < 5.0);
        CHECK(text.find(": all_reduce #2 Float[3] for all-reduce of the loss") != std::string::npos);
        CHECK(text.find(": all_reduce #2 Float[4] for all-reduce of the loss") != std::string::npos);
      }
    }
  }

  TEST_CASE("debug mode comes from TrainerOptions::debug, else ACCELERATE_DEBUG_MODE (accel launch --debug); a value "
            "that is not true or false is refused") {
    ScopedEnv env;
    env.set("ACCELERATE_DEBUG_MODE", "false");
    CHECK_FALSE(accel::Trainer<accel::DDP>().communicator().debug());
    CHECK(accel::Trainer<accel::DDP>(accel::TrainerOptions{.debug = true}).communicator().debug());
    env.set("ACCELERATE_DEBUG_MODE", "true");
    CHECK(accel::Trainer<accel::DDP>().communicator().debug());
    CHECK_FALSE(accel::Trainer<accel::DDP>(accel::TrainerOptions{.debug = false}).communicator().debug());
    env.set("ACCELERATE_DEBUG_MODE", "maybe");
    CHECK_THROWS_WITH(accel::Trainer<accel::DDP>(), doctest::Contains("ACCELERATE_DEBUG_MODE='maybe' is not true or false"));
  }

  TEST_CASE("flight recorder: a failed collective writes its rank's record, SIGUSR1 a live rank's; the summary says "
            "which rank failed in which collective and which never entered it") {
    const std::string dir = temp_path("flight");
    RemoveOnExit cleanup{fs::path(dir)};
    ScopedEnv env;
    env.set("ACCEL_FLIGHT_RECORDER_DIR", dir);  // the forked ranks inherit it
    const std::string text = spawn_two_and_read_report("flight_result", [](int rank, const std::string& result) {
      accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.timeout = 2s});
      at::Tensor loss = at::ones({4});
      trainer.communicator().all_reduce(loss, "the loss");  // collective #1, on both
      if (rank == 1) {
        ::raise(SIGUSR1);                 // as accel launch asks: the heartbeat thread writes the record
        std::this_thread::sleep_for(4s);  // alive, but it never reaches the barrier
        return;
      }
      report_collective_failure(result, [&] { trainer.wait_for_everyone(); });
    });
    REQUIRE(reports_failure(text));
    auto read_record = [&](int rank) { return nlohmann::json::parse(read_file(dir + "/rank_" + std::to_string(rank) + ".json")); };
    const auto r0 = read_record(0), r1 = read_record(1);
    INFO(r0.dump(1), "\n", r1.dump(1));
    const auto& last0 = r0.at("entries").back();
    CHECK(last0.at("op") == "barrier");
    CHECK(last0.at("state") == "failed");
    CHECK(last0.at("sequence") == 2);
    CHECK(last0.at("group") == "world");
    const auto& last1 = r1.at("entries").back();
    CHECK(last1.at("op") == "all_reduce");
    CHECK(last1.at("what") == "the loss");
    CHECK(last1.at("state") == "completed");
    CHECK(last1.at("bytes") == 16);
    const std::string summary = accel::comm::summarize_flight_records({r0, r1}, {0, 1, 2});
    INFO(summary);
    CHECK(summary.find("group world: newest collective #2\n") != std::string::npos);
    CHECK(summary.find("rank 0: failed in barrier #2 (barrier (wait_for_everyone))\n") != std::string::npos);
    CHECK(summary.find("rank 1: last completed all_reduce #1 (the loss): never entered #2\n") != std::string::npos);
    CHECK(summary.find("no record from rank 2 ") != std::string::npos);
  }

  TEST_CASE("flight recorder: the last 256 collectives in order, each issued then ended; nothing written without "
            "ACCEL_FLIGHT_RECORDER_DIR") {
    accel::spawn(
        1,
        [](int) {
          auto& recorder = accel::comm::FlightRecorder::instance();
          for (int k = 1; k <= 300; ++k) {
            const auto id = recorder.issue("world", k, false, "all_reduce", "step " + std::to_string(k), 4);
            if (k < 300) recorder.finish(id, true);
          }
          const auto entries = recorder.entries();
          require(entries.size() == accel::comm::FlightRecorder::capacity, "the ring holds 256");
          require(entries.front().sequence == 45 && entries.back().sequence == 300, "the newest 256, oldest first");
          require(entries[254].state == accel::comm::FlightRecorder::State::completed, "ended");
          require(entries.back().state == accel::comm::FlightRecorder::State::issued, "still in flight");
          ::unsetenv("ACCEL_FLIGHT_RECORDER_DIR");
          require(!recorder.dump(0), "no directory, no file");
        },
        bounded());
  }
}
