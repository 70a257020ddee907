// Tutorial: train an MLP classifier with accel.
//
// The training loop below is written once. The Trainer's type decides how it
// runs: `accel::Trainer<>` is one plain process; `accel::Trainer<accel::DDP>`
// (used here) trains one model on every process `accel launch` starts, and
// also runs alone as a single process:
//
//   ./build/examples/mlp                                  # one process
//   ./build/tools/accel launch --num_processes 2 ./build/examples/mlp
//
// With checkpoints every 20 steps, a job that loses a rank restarts by
// itself and carries on from its newest checkpoint, to the same weights:
//
//   ./build/tools/accel launch --num_processes 2 --max_restarts 3 ./build/examples/mlp
//       --checkpoint_every 20 --project_dir runs/mlp --save_weights runs/mlp/final.pt   (one line)
//
// The data is synthetic (Gaussian clusters, one per class), made in-process.

#include <ATen/ops/argmax.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <accel/accel.hpp>

#include "flags.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

// 1. The data: noisy points around one random centre per class. Every rank
//    makes the same data from the same seeds; the loader then gives each
//    rank its own shard.
at::Tensor make_centres(std::int64_t classes, std::int64_t features) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(0);
  return at::randn({classes, features}, generator) * 0.25;
}

accel::data::TensorDataset make_clusters(const at::Tensor& centres, std::int64_t samples, std::uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto labels = at::randint(centres.size(0), {samples}, generator, at::TensorOptions().dtype(at::kLong));
  auto points = centres.index_select(0, labels) + at::randn({samples, centres.size(1)}, generator);
  return {points, labels};
}

// 2. The model: a plain LibTorch module; accel needs nothing from it.
torch::nn::Sequential make_mlp(std::int64_t features, std::int64_t hidden, std::int64_t classes) {
  return torch::nn::Sequential(torch::nn::Linear(features, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, classes));
}

}  // namespace

int train(int argc, char** argv) {
  using example::flag;
  const std::int64_t epochs = flag(argc, argv, "epochs", 3);
  const std::int64_t batch_size = flag(argc, argv, "batch_size", 64);  // per process
  const std::int64_t features = 64, classes = 10;

  const std::int64_t checkpoint_every = flag(argc, argv, "checkpoint_every", 0);  // steps; 0: never

  // 3. The Trainer: the only line that changes between one process and many.
  //    Automatically named checkpoints go to project_dir/checkpoints (the
  //    newest two kept).
  //    A collective that waits longer than the timeout fails, naming the
  //    ranks that are gone, instead of hanging.
  accel::Trainer<accel::DDP> trainer(
      accel::TrainerOptions{.timeout = std::chrono::seconds(flag(argc, argv, "collective_timeout", 300)),
                            .project_dir = flag(argc, argv, "project_dir", "."),
                            .total_limit = 2});
  trainer.set_seed(42);  // same initial weights everywhere (DDP broadcasts rank 0's anyway)

  auto model = make_mlp(features, flag(argc, argv, "hidden", 256), classes);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  trainer.prepare(model, optimizer);

  const auto centres = make_centres(classes, features);
  auto train = trainer.prepare(make_clusters(centres, flag(argc, argv, "samples", 8192), 1),
                               {.batch_size = batch_size, .shuffle = true, .seed = 7});
  auto test = trainer.prepare(make_clusters(centres, 1000, 2), {.batch_size = 128});

  trainer.print("training on", trainer.num_processes(), "process(es),", train.size(), "batches of", batch_size,
                "per process and epoch");

  // 4. Resuming: after a restart (`accel launch --max_restarts`), carry on
  //    from the newest complete checkpoint: weights, optimizer, RNG and the
  //    loader's place in its epoch (the batches already seen are skipped).
  if (checkpoint_every > 0)
    if (auto resumed = trainer.load_latest_state())
      trainer.print("resumed from", resumed->string(), "after", trainer.completed_steps(), "steps");

  for (std::int64_t epoch = train.epoch(); epoch < epochs; ++epoch) {
    train.set_epoch(epoch);  // a new shuffle each epoch, the same on every rank
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::int64_t batches = 0;

    // 5. The loop: forward in the lambda; accel does backward, the gradient
    //    all-reduce, the optimizer step and zero_grad.
    for (auto batch : train) {
      auto loss = trainer.step([&] {
        return torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
      });
      loss_sum += loss.template item<double>();
      ++batches;
      if (checkpoint_every > 0 && trainer.completed_steps() % checkpoint_every == 0) trainer.save_state();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    // 6. Evaluation: every rank scores its shard; gather_for_metrics collects
    //    the predictions and drops the padding that evened out the shards,
    //    so each of the 1000 test samples counts exactly once.
    std::int64_t correct = 0, seen = 0;
    {
      c10::NoGradGuard no_grad;
      for (auto batch : test) {
        auto predictions = trainer.gather_for_metrics(model->forward(batch.data).argmax(1));
        auto targets = trainer.gather_for_metrics(batch.target);
        correct += predictions.eq(targets).sum().template item<std::int64_t>();
        seen += targets.size(0);
      }
    }
    const double samples_per_s =
        static_cast<double>(batches * batch_size * trainer.num_processes()) / seconds;
    // Every process reports its own progress (accel launch prefixes the rank).
    std::printf("epoch %lld: mean loss %.4f over this process's %lld batches\n", static_cast<long long>(epoch),
                loss_sum / std::max<std::int64_t>(batches, 1), static_cast<long long>(batches));
    trainer.print("epoch", epoch, "accuracy", static_cast<double>(correct) / seen, "on", seen,
                  "test samples; global samples/s", static_cast<long long>(samples_per_s));
  }
  if (auto path = flag(argc, argv, "save_weights", ""); !path.empty() && trainer.is_main_process())
    torch::save(model, path);
  return EXIT_SUCCESS;
}

// 7. Errors: a failed collective (a dead peer, a timeout) throws an
//    accel::comm::CollectiveError naming this rank, the operation and the
//    ranks that are gone; report it and exit non-zero, as any error.
int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp: %s\n", e.what());
    return EXIT_FAILURE;
  }
}
