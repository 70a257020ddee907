// Pipeline parallelism on 2 stages (real Gloo send/recv): GPipe and 1F1B
// equal one process on the global batch; 1F1B holds at most `stages`
// micro-batches of activations; a model too short for its stages is refused.
#include <torch/optim/sgd.h>

#include "accel/comm/mesh.hpp"
#include "accel/pipeline/pipeline.hpp"
#include "doctest_torch.hpp"

using namespace accel::testing;
using accel::comm::MeshDim;

namespace {
constexpr double kBound = 3e-7, kLossBound = 1.2e-6;
}  // namespace

TEST_SUITE("pipeline") {
  TEST_CASE("2 stages, 4 micro-batches, GPipe and 1F1B: parameters equal single-process training on the same "
            "global batch; 1F1B never holds more than 2 micro-batches") {
    // Measured on LibTorch 1.13: the parameters at most 3e-8 apart, the
    // losses 1.2e-7; bounds 10x that. The companion: the
    // reference moved far more than the bound, so a stage that did not train
    // (or trained on the wrong gradients) would fail.
    for (auto schedule : {accel::pipeline::Schedule::gpipe, accel::pipeline::Schedule::one_f_one_b}) {
      accel::spawn(
          2,
          [schedule](int rank) {
            accel::Trainer<accel::DDP> world;
            accel::comm::DeviceMesh mesh(world.communicator(), {.pipeline = 2});
            auto model = tiny_mlp(0, 8, 16, 4, 3);  // 7 layers: stage 0 gets 3, stage 1 gets 4
            auto reference = tiny_mlp(0, 8, 16, 4, 3);
            std::vector<at::Tensor> initial;
            for (const auto& p : reference->parameters()) initial.push_back(p.detach().clone());
            double worst_loss = 0, worst = 0, moved = 0;
            accel::pipeline::Pipeline pipe(model, mesh.group(MeshDim::pipeline), {.micro_batches = 4, .schedule = schedule});
            torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
            torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
            for (int step = 0; step < 3; ++step) {
              auto batch = global_batch(step, 8);
              opt.zero_grad();
              const double loss = pipe.train_step(batch.x, batch.y, [](const at::Tensor& out, const at::Tensor& y) {
                return torch::nn::functional::cross_entropy(out, y);
              });
              opt.step();
              ref_opt.zero_grad();
              auto ref_loss = loss_of(reference, batch.x, batch.y);
              ref_loss.backward();
              ref_opt.step();
              worst_loss = std::max(worst_loss, std::abs(loss - ref_loss.item<double>()));
              require(std::abs(loss - ref_loss.item<double>()) < kLossBound, "the loss is reported on every stage");
            }
            // This stage's layers against the same layers of the reference.
            auto mine = pipe.parameters();
            auto all = reference->parameters();
            const std::size_t offset = rank == 0 ? 0 : all.size() - mine.size();
            for (std::size_t i = 0; i < mine.size(); ++i) {
              const double diff = (mine[i] - all[offset + i]).abs().max().item<double>();
              worst = std::max(worst, diff);
              moved = std::max(moved, (all[offset + i] - initial[offset + i]).abs().max().item<double>());
              require(diff < kBound, "stage parameter " + std::to_string(i) + " differs by " + std::to_string(diff));
            }
            std::printf("pipeline stage %d: parameters %.2g apart (bound %.0e), losses %.2g (bound %.0e), moved %.2g\n",
                        rank, worst, kBound, worst_loss, kLossBound, moved);
            require(moved > 100 * kBound, "the reference moved only " + std::to_string(moved) + ": the check could not fail");
            if (schedule == accel::pipeline::Schedule::one_f_one_b)
              require(pipe.peak_in_flight() <= 2, "1F1B held " + std::to_string(pipe.peak_in_flight()) + " micro-batches");
            else
              require(pipe.peak_in_flight() == 4, "GPipe holds all 4 micro-batches");
          },
          bounded());
    }
  }

  TEST_CASE("the schedules' orders, by hand: 1F1B's warm-up, and interleaved 1F1B's groups of p micro-batches per "
            "chunk with (p-s-1)*2 + (v-1)*p warm-up forwards") {
    // "F1.0": the forward of micro-batch 0 through this rank's chunk 1.
    auto order = [](accel::pipeline::Schedule schedule, int p, int s, int m, int v) {
      std::string text;
      for (const auto& pass : accel::pipeline::schedule_for(schedule, p, s, m, v))
        text += std::string(text.empty() ? "" : " ") + (pass.forward ? "F" : "B") + std::to_string(pass.chunk) + "." +
                std::to_string(pass.micro);
      return text;
    };
    using S = accel::pipeline::Schedule;
    CHECK(order(S::one_f_one_b, 2, 0, 3, 1) == "F0.0 F0.1 B0.0 F0.2 B0.1 B0.2");
    CHECK(order(S::one_f_one_b, 2, 1, 3, 1) == "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2");
    CHECK(order(S::gpipe, 2, 1, 2, 1) == "F0.0 F0.1 B0.1 B0.0");
    CHECK(order(S::interleaved_one_f_one_b, 2, 0, 4, 2) ==
          "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3");
    CHECK(order(S::interleaved_one_f_one_b, 2, 1, 4, 2) ==
          "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3");
    // m = p: every forward first (Megatron's rule), then every backward, last chunk first.
    CHECK(order(S::interleaved_one_f_one_b, 2, 1, 2, 2) == "F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1");
  }

  TEST_CASE("a model whose layer count cannot be split into the requested stages is refused") {
    accel::spawn(
        3,
        [](int) {
          accel::Trainer<accel::DDP> world;
          accel::comm::DeviceMesh mesh(world.communicator(), {.pipeline = 3});
          torch::nn::Sequential two(torch::nn::Linear(2, 2), torch::nn::Linear(2, 2));
          try {
            accel::pipeline::Pipeline pipe(two, mesh.group(MeshDim::pipeline));
          } catch (const std::invalid_argument& e) {
            require(std::string(e.what()).find("a model of 2 layers cannot be split into 3 stages") != std::string::npos,
                    e.what());
            world.wait_for_everyone();  // no rank leaves while another still connects to it
            return;
          }
          require(false, "must refuse");
        },
        bounded());
  }
}
