#pragma once
// The tiny GPT of examples/gpt.cpp (also measured by bench/parallel_bench.cpp):
// token embedding, pre-norm transformer blocks, LM head, all built from
// accel's tensor-parallel layers on a tensor group (one rank: plain layers).
// Per block and step, Megatron's communication: two all-reduces forward
// (after the attention output and the MLP down projection) and two backward
// (the gradients entering the fused QKV and the MLP up projection).

#include <ATen/ops/arange.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/triu.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>

#include <accel/checkpoint/safetensors.hpp>
#include <accel/nn/tensor_parallel.hpp>

namespace gpt {

struct Config {
  std::int64_t vocab = 64, context = 16, width = 32, heads = 4, layers = 2;
};

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
        qkv(register_module("qkv", accel::nn::ColumnParallelLinear(c.width, 3 * c.width, tp, false, /*stride=*/3))),
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
    auto projections = qkv(h).chunk(3, -1);  // this rank's heads of Q, K and V: (B, S, H/T) each
    auto& q = projections[0];
    auto& k = projections[1];
    auto& v = projections[2];
    auto scores = at::matmul(split(q), split(k).transpose(-2, -1)) / std::sqrt(double(head_width));
    auto causal = at::ones({seq, seq}, x.options().dtype(at::kBool)).triu(1);
    auto attention = at::softmax(scores.masked_fill(causal, -1e9), -1);
    auto mixed = at::matmul(attention, split(v)).transpose(1, 2).reshape({batch, seq, heads_here * head_width});
    auto y = x + out(mixed);
    return y + down(at::gelu(up(norm2(y))));
  }

  std::int64_t heads_here, head_width;
  torch::nn::LayerNorm norm1;
  accel::nn::ColumnParallelLinear qkv;
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

inline torch::nn::Sequential make_gpt(const Config& c, accel::comm::Communicator& tp) {
  torch::nn::Sequential gpt(Embed(c, tp));
  for (int i = 0; i < c.layers; ++i) gpt->push_back(Block(c, tp));
  gpt->push_back(Head(c, tp));
  return gpt;
}

// ---- Hugging Face transformers' GPT2LMHeadModel, weight for weight
//
// This model is GPT-2's architecture: learned positions, pre-norm blocks
// with a fused QKV projection (biases everywhere but the LM head), LayerNorm
// eps 1e-5. So its weights map one to one onto transformers' names, for the
// GPT2Config with vocab_size = vocab, n_positions = context, n_embd = width,
// n_head = heads, n_layer = layers, activation_function = "gelu" (this
// model's at::gelu; GPT-2's default "gelu_new" is the tanh approximation) and
// tie_word_embeddings = False (a separate LM head):
//   0.tokens.weight          transformer.wte.weight
//   0.positions.weight       transformer.wpe.weight
//   <l>.norm1.*              transformer.h.<l-1>.ln_1.*        (l = 1 .. layers)
//   <l>.qkv.*                transformer.h.<l-1>.attn.c_attn.*  weight transposed
//   <l>.out.*                transformer.h.<l-1>.attn.c_proj.*  weight transposed
//   <l>.norm2.*              transformer.h.<l-1>.ln_2.*
//   <l>.up.*                 transformer.h.<l-1>.mlp.c_fc.*     weight transposed
//   <l>.down.*               transformer.h.<l-1>.mlp.c_proj.*   weight transposed
//   <layers+1>.norm.*        transformer.ln_f.*
//   <layers+1>.logits.weight lm_head.weight
// transformers' Conv1D stores its weight [in, out], a Linear [out, in]: the
// four projections are transposed on the way in and out. One rank of
// tensor parallelism only (each rank's slice is not mapped).
struct TransformersNames {
  std::map<std::string, std::string> theirs, ours;  // ours -> theirs, theirs -> ours
  std::set<std::string> transposed;                  // our names
};

inline std::shared_ptr<const TransformersNames> transformers_names(const Config& c) {
  auto names = std::make_shared<TransformersNames>();
  auto both = [&](const std::string& our, const std::string& their, bool transpose = false) {
    names->theirs[our] = their;
    names->ours[their] = our;
    if (transpose) names->transposed.insert(our);
  };
  both("0.tokens.weight", "transformer.wte.weight");
  both("0.positions.weight", "transformer.wpe.weight");
  const std::map<std::string, std::pair<std::string, bool>> block{{"norm1", {"ln_1", false}},
                                                                   {"qkv", {"attn.c_attn", true}},
                                                                   {"out", {"attn.c_proj", true}},
                                                                   {"norm2", {"ln_2", false}},
                                                                   {"up", {"mlp.c_fc", true}},
                                                                   {"down", {"mlp.c_proj", true}}};
  for (int l = 1; l <= c.layers; ++l)
    for (const auto& [our, their] : block) {
      const std::string prefix = std::to_string(l) + "." + our, theirs = "transformer.h." + std::to_string(l - 1) + "." + their.first;
      both(prefix + ".weight", theirs + ".weight", their.second);
      both(prefix + ".bias", theirs + ".bias");
    }
  const std::string head = std::to_string(c.layers + 1);
  both(head + ".norm.weight", "transformer.ln_f.weight");
  both(head + ".norm.bias", "transformer.ln_f.bias");
  both(head + ".logits.weight", "lm_head.weight");
  return names;
}

// Loads a transformers GPT-2 checkpoint (save_pretrained's directory):
//   accel::load_safetensors(*model, dir, gpt::from_transformers(config));   // or trainer.load_safetensors
// A name it does not know is kept, so a strict load lists it as unexpected.
inline accel::LoadOptions from_transformers(const Config& c) {
  auto names = transformers_names(c);
  return {.strict = true,
          .name_map = [names](const std::string& theirs) {
            const auto it = names->ours.find(theirs);
            return it == names->ours.end() ? theirs : it->second;
          },
          .transform = [names](const std::string& ours, const at::Tensor& t) {
            return names->transposed.count(ours) ? t.t() : t;
          }};
}

// Saves for GPT2LMHeadModel.from_pretrained (with its config.json beside):
//   trainer.save_model(model, dir, gpt::to_transformers(config));
inline accel::SaveModelOptions to_transformers(const Config& c, std::uint64_t max_shard_size = 10'000'000'000) {
  auto names = transformers_names(c);
  return {.max_shard_size = max_shard_size,
          .name_map =
              [names](const std::string& ours) {
                const auto it = names->theirs.find(ours);
                if (it == names->theirs.end())
                  throw std::invalid_argument("gpt::to_transformers: \"" + ours + "\" is not a GPT-2 weight");
                return it->second;
              },
          .transform = [names](const std::string& ours, const at::Tensor& t) {
            return names->transposed.count(ours) ? t.t() : t;
          }};
}

}  // namespace gpt
