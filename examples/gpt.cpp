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
//
// `--strategy` only picks the Trainer's type; the training loop (train<T>)
// is the same code for all five.

#include <ATen/ops/arange.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/triu.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>

#include <accel/accel.hpp>
#include <accel/nn/tensor_parallel.hpp>

#include <chrono>
#include <cstdio>
#include <string>

namespace {

struct Config {
  std::int64_t vocab = 64, context = 16, width = 32, heads = 4, layers = 2;
};

// 1. The model, in three kinds of blocks, each taking and returning one tensor.
//    Shapes: (B, S) token ids -> (B, S, H) -> ... -> (B, S, V/T) logits.

// Token embedding (vocabulary split over the tensor group) plus positions.
struct EmbedImpl : torch::nn::Module {
  EmbedImpl(const Config& c, accel::comm::Communicator& tp)
      : tokens(register_module("tokens", accel::nn::VocabParallelEmbedding(c.vocab, c.width, tp))),
        positions(register_module("positions", torch::nn::Embedding(c.context, c.width))) {}
  at::Tensor forward(const at::Tensor& ids) {  // (B, S) -> (B, S, H)
    return tokens(ids) + positions(at::arange(ids.size(1), ids.options()));
  }
  accel::nn::VocabParallelEmbedding tokens;
  torch::nn::Embedding positions;
};
TORCH_MODULE(Embed);

// Pre-norm transformer block: causal self-attention with the heads split
// over the tensor group, then an MLP with its hidden layer split (Megatron).
struct BlockImpl : torch::nn::Module {
  BlockImpl(const Config& c, accel::comm::Communicator& tp)
      : heads_here(c.heads / tp.size()), head_width(c.width / c.heads),
        norm1(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        q(register_module("q", accel::nn::ColumnParallelLinear(c.width, c.width, tp))),
        k(register_module("k", accel::nn::ColumnParallelLinear(c.width, c.width, tp))),
        v(register_module("v", accel::nn::ColumnParallelLinear(c.width, c.width, tp))),
        out(register_module("out", accel::nn::RowParallelLinear(c.width, c.width, tp))),
        norm2(register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        up(register_module("up", accel::nn::ColumnParallelLinear(c.width, 4 * c.width, tp))),
        down(register_module("down", accel::nn::RowParallelLinear(4 * c.width, c.width, tp))) {}

  at::Tensor forward(const at::Tensor& x) {  // (B, S, H) -> (B, S, H)
    const auto batch = x.size(0), seq = x.size(1);
    auto h = norm1(x);
    auto split = [&](const at::Tensor& t) {  // (B, S, H/T) -> (B, heads/T, S, H/heads)
      return t.view({batch, seq, heads_here, head_width}).transpose(1, 2);
    };
    auto scores = at::matmul(split(q(h)), split(k(h)).transpose(-2, -1)) / std::sqrt(double(head_width));
    auto causal = at::ones({seq, seq}, x.options().dtype(at::kBool)).triu(1);
    auto attention = at::softmax(scores.masked_fill(causal, -1e9), -1);
    auto mixed = at::matmul(attention, split(v(h))).transpose(1, 2).reshape({batch, seq, heads_here * head_width});
    auto y = x + out(mixed);
    return y + down(at::gelu(up(norm2(y))));
  }

  std::int64_t heads_here, head_width;
  torch::nn::LayerNorm norm1;
  accel::nn::ColumnParallelLinear q, k, v;
  accel::nn::RowParallelLinear out;
  torch::nn::LayerNorm norm2;
  accel::nn::ColumnParallelLinear up;
  accel::nn::RowParallelLinear down;
};
TORCH_MODULE(Block);

// Final norm and the language-model head, its vocabulary split over the group.
struct HeadImpl : torch::nn::Module {
  HeadImpl(const Config& c, accel::comm::Communicator& tp)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        logits(register_module("logits", accel::nn::ColumnParallelLinear(
                                            torch::nn::Linear(torch::nn::LinearOptions(c.width, c.vocab).bias(false)), tp))) {}
  at::Tensor forward(const at::Tensor& x) { return logits(norm(x)); }  // (B, S, H) -> (B, S, V/T)
  torch::nn::LayerNorm norm;
  accel::nn::ColumnParallelLinear logits;
};
TORCH_MODULE(Head);

torch::nn::Sequential make_gpt(const Config& c, accel::comm::Communicator& tp) {
  torch::nn::Sequential gpt(Embed(c, tp));
  for (int i = 0; i < c.layers; ++i) gpt->push_back(Block(c, tp));
  gpt->push_back(Head(c, tp));
  return gpt;
}

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
int train(Strategy strategy, int epochs) {
  accel::Trainer<Strategy> trainer(strategy);
  trainer.set_seed(0);  // the same full initialisation on every rank (tensor-parallel slices are cut from it)
  Config config;
  auto& tp = trainer.tensor_group();
  auto gpt = make_gpt(config, tp);
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

std::string flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) return argv[i + 1];
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string strategy = flag(argc, argv, "strategy", "single");
  const int epochs = std::stoi(flag(argc, argv, "epochs", "3"));
  if (strategy == "single") return train(accel::SingleProcess{}, epochs);
  if (strategy == "ddp") return train(accel::DDP{}, epochs);
  if (strategy == "zero3")
    return train(accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP,
                                .transformer_layer_cls_to_wrap = {"BlockImpl"}},
                 epochs);
  if (strategy == "tensor2") return train(accel::Parallel<>{.tensor = 2}, epochs);
  if (strategy == "pipeline2") return train(accel::Parallel<>{.pipeline = 2, .micro_batches = 4}, epochs);
  std::fprintf(stderr, "gpt: --strategy is single, ddp, zero3, tensor2 or pipeline2\n");
  return 2;
}
