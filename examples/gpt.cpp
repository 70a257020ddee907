// Tutorial: a tiny GPT trained on synthetic tokens, with the strategy chosen
// by one type. The model is built from accel's tensor-parallel layers on
// `trainer.tensor_group()`, which is a one-rank group unless the strategy is
// tensor parallel; it is a torch::nn::Sequential, so a pipeline can split it.
//
//   ./build/examples/gpt --strategy single
//   ./build/tools/accel launch --num_processes 2 ./build/examples/gpt --strategy ddp
//   ./build/tools/accel launch --num_processes 2 ./build/examples/gpt --strategy zero3
//   ./build/tools/accel launch --num_processes 2 ./build/examples/gpt --strategy tensor2
//   ./build/tools/accel launch --num_processes 2 ./build/examples/gpt --strategy pipeline2
//   ./build/tools/accel launch --num_processes 2 ./build/examples/gpt --strategy zero3 --build_on_meta true
//
// `--strategy` only picks the Trainer's type; the training loop (train<T>)
// is the same code for all five.

#include <ATen/ops/randint.h>
#include <torch/optim/adam.h>

#include <accel/accel.hpp>
#include <accel/deferred_init/meta.hpp>

#include "flags.hpp"
#include "gpt_model.hpp"

#include <chrono>
#include <cstdio>
#include <string>
#include <type_traits>

namespace {

// 1. The model (gpt_model.hpp): blocks that each take and return one tensor,
//    (B, S) token ids -> (B, S, H) -> ... -> (B, S, V/T) logits.
using gpt::Config;
using gpt::make_gpt;

// 2. Synthetic data: sequences that follow a fixed random successor table
//    (so there is something to learn), the same on every rank.
accel::data::TensorDataset make_tokens(const Config& c, std::int64_t sequences) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(3);
  auto next = at::randint(c.vocab, {c.vocab}, generator, at::TensorOptions().dtype(at::kLong));
  auto seq = at::empty({sequences, c.context + 1}, at::TensorOptions().dtype(at::kLong));
  seq.select(1, 0).copy_(at::randint(c.vocab, {sequences}, generator, at::TensorOptions().dtype(at::kLong)));
  for (std::int64_t t = 1; t <= c.context; ++t) seq.select(1, t).copy_(next.index_select(0, seq.select(1, t - 1)));
  return {seq.narrow(1, 0, c.context).contiguous(), seq.narrow(1, 1, c.context).contiguous()};
}

// 3. The training loop: the same for every strategy.
template <class Strategy>
int train(Strategy strategy, int epochs, bool on_meta) {
  accel::Trainer<Strategy> trainer(strategy);
  trainer.set_seed(0);  // the same full initialisation on every rank (tensor-parallel slices are cut from it)
  Config config;
  auto& tp = trainer.tensor_group();
  // --build_on_meta: no weight is allocated while the model is built. ZeRO-3
  // then computes only this rank's shards of it, a unit at a time; the other
  // strategies keep the whole model on every rank, so it is given its values
  // whole here. Either way they are those of the line below it.
  auto gpt = on_meta ? accel::device::build_on_meta([&] { return make_gpt(config, tp); }) : make_gpt(config, tp);
  if constexpr (!std::is_same_v<Strategy, accel::ZeRO<3>>)
    if (on_meta) accel::device::materialize(*gpt);
  torch::optim::Adam optimizer(gpt->parameters(), torch::optim::AdamOptions(3e-3));
  trainer.prepare(gpt, optimizer);
  auto loader = trainer.prepare(make_tokens(config, 512), {.batch_size = 16, .shuffle = true});
  // The logits stay split over the tensor group: the loss never gathers them.
  auto loss_fn = [&](const at::Tensor& logits, const at::Tensor& targets) {
    return accel::nn::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), tp);
  };
  for (int epoch = 0; epoch < epochs; ++epoch) {
    loader.set_epoch(epoch);
    const auto start = std::chrono::steady_clock::now();
    double loss = 0;
    for (auto batch : loader) loss = trainer.step(batch.data, batch.target, loss_fn);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    trainer.print("epoch", epoch, "last loss", loss, "(chance:", std::log(double(config.vocab)), ")",
                  static_cast<long long>(loader.size() / seconds), "steps/s");
  }
  return 0;
}


}  // namespace

int main(int argc, char** argv) {
  using example::flag;
  const std::string strategy = flag(argc, argv, "strategy", "single");
  const int epochs = std::stoi(flag(argc, argv, "epochs", "3"));
  const bool on_meta = flag(argc, argv, "build_on_meta", "false") == "true";
  if (strategy == "single") return train(accel::SingleProcess{}, epochs, on_meta);
  if (strategy == "ddp") return train(accel::DDP{}, epochs, on_meta);
  if (strategy == "zero3")
    return train(accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP,
                                .transformer_layer_cls_to_wrap = {"BlockImpl"}},
                 epochs, on_meta);
  if (strategy == "tensor2") return train(accel::Parallel<>{.tensor = 2}, epochs, on_meta);
  if (strategy == "pipeline2") return train(accel::Parallel<>{.pipeline = 2, .micro_batches = 4}, epochs, on_meta);
  std::fprintf(stderr, "gpt: --strategy is single, ddp, zero3, tensor2 or pipeline2\n");
  return 2;
}
