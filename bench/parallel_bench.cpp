// Tensor- and pipeline-parallel measurements, on 2 ranks:
//   accel launch --num_processes 2 build/bench/parallel_bench --mode bubble
//     pipeline bubble fraction of GPipe, 1F1B and interleaved 1F1B (v = 2
//     virtual stages) for m = 1, 2, 4, 8 micro-batches against
//     (p-1)/(v*m+p-1) (v = 1 but interleaved), and peak activation memory;
//   accel launch --num_processes 2 build/bench/parallel_bench --mode tp_bytes
//     all-reduces and bytes per transformer layer under tensor parallelism
//     against Megatron-LM's count (2 forward + 2 backward of B*S*H).
// The bubble is measured as the time each stage spends blocked waiting for
// its neighbour, over the schedule's length, averaged over stages and the
// median over steps.

#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <accel/accel.hpp>
#include <accel/comm/mesh.hpp>
#include <accel/pipeline/pipeline.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "../examples/gpt_model.hpp"
#include "bench_common.hpp"

namespace {

using accel::comm::MeshDim;

std::string flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) return argv[i + 1];
  return fallback;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int bubble(accel::Trainer<accel::DDP>& world) {
  accel::comm::DeviceMesh mesh(world.communicator(), {.pipeline = world.num_processes()});
  auto& group = mesh.group(MeshDim::pipeline);
  const int p = group.size();
  at::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < 8; ++i) {
    model->push_back(torch::nn::Linear(1024, 1024));
    model->push_back(torch::nn::Tanh());
  }
  world.print("pipeline bubble,", p, "stages, 8 x Linear(1024, 1024) in all, 64 samples per micro-batch");
  world.print("schedule     m  measured_bubble  ideal_(p-1)/(v*m+p-1)  peak_micro_batches_held  peak_activation_KiB");
  using accel::pipeline::Schedule;
  for (auto schedule : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved_one_f_one_b}) {
    const int v = schedule == Schedule::interleaved_one_f_one_b ? 2 : 1;
    for (int m : {1, 2, 4, 8}) {
      if (v > 1 && m % p != 0) continue;  // interleaving runs micro-batches in groups of p
      accel::pipeline::Pipeline pipe(model, group, {.micro_batches = m, .schedule = schedule, .virtual_stages = v});
      std::vector<double> fractions;
      for (int step = 0; step < 8; ++step) {
        auto x = at::randn({64 * m, 1024});
        auto y = at::randint(1024, {64 * m}, at::TensorOptions().dtype(at::kLong));
        pipe.train_step(x, y, [](const at::Tensor& out, const at::Tensor& t) {
          return torch::nn::functional::cross_entropy(out, t);
        });
        // Average over the stages: every stage's idle share of the schedule.
        auto share = at::full({1}, pipe.wait_seconds() / pipe.step_seconds(), at::TensorOptions().dtype(at::kDouble));
        group.all_reduce(share, "bubble average");
        if (step >= 2) fractions.push_back(share.item<double>() / p);
      }
      auto peak = at::full({2}, 0.0, at::TensorOptions().dtype(at::kDouble));
      peak[0] = pipe.peak_in_flight();
      peak[1] = static_cast<double>(pipe.peak_activation_bytes());
      group.all_reduce_max(peak, "peak activations");
      if (world.is_main_process())
        std::printf("%-11s %2d  %15.3f  %21.3f  %23d  %19.1f\n",
                    schedule == Schedule::gpipe ? "gpipe" : v > 1 ? "interleaved" : "1f1b", m, median(fractions),
                    double(p - 1) / (v * m + p - 1), static_cast<int>(peak[0].item<double>()), peak[1].item<double>() / 1024);
    }
  }
  return 0;
}

int tp_bytes(accel::Trainer<accel::DDP>& world) {
  accel::comm::DeviceMesh mesh(world.communicator(), {.tensor = world.num_processes()});
  auto& tp = mesh.group(MeshDim::tensor);
  gpt::Config config;
  at::manual_seed(0);
  gpt::Block block(config, tp);
  const std::int64_t batch = 8;
  auto x = at::randn({batch, config.context, config.width}).requires_grad_(true);
  const auto calls0 = tp.collectives_issued();
  const auto bytes0 = tp.all_reduce_bytes();
  auto y = block(x);
  const auto forward_calls = tp.collectives_issued() - calls0;
  const auto forward_bytes = tp.all_reduce_bytes() - bytes0;
  y.sum().backward();
  const auto backward_calls = tp.collectives_issued() - calls0 - forward_calls;
  const auto backward_bytes = tp.all_reduce_bytes() - bytes0 - forward_bytes;
  const double activation = double(batch * config.context * config.width * 4);  // B*S*H fp32
  world.print("tensor parallel", tp.size(), "ranks, one transformer layer, B*S*H =", batch * config.context * config.width);
  world.print("forward:  all-reduces", forward_calls, "bytes", forward_bytes, "=", forward_bytes / activation,
              "x B*S*H*4 (Megatron-LM: 2 all-reduces, 2x)");
  world.print("backward: all-reduces", backward_calls, "bytes", backward_bytes, "=", backward_bytes / activation,
              "x B*S*H*4 (Megatron-LM: 2 all-reduces, 2x)");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::one_thread();
  accel::Trainer<accel::DDP> world;
  const std::string mode = flag(argc, argv, "mode", "bubble");
  if (mode == "bubble") return bubble(world);
  if (mode == "tp_bytes") return tp_bytes(world);
  std::fprintf(stderr, "parallel_bench: --mode is bubble or tp_bytes\n");
  return 2;
}
