// Activation checkpointing: the function accel::nn::checkpoint (gradients
// bitwise those of the plain backward, the forward's random numbers
// replayed) and the strategies' activation_checkpointing setting, which
// checkpoints every auto-wrap unit through its Sequential entry.
#include <ATen/ops/dropout.h>
#include <ATen/ops/rand.h>
#include <torch/nn/modules/activation.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <accel/device/allocation_counter.hpp>
#include <accel/estimate/module.hpp>
#include <accel/nn/activation_checkpoint.hpp>

#include "tiny_gpt.hpp"
#include "doctest_torch.hpp"

using namespace accel::testing;
namespace estimate = accel::estimate;

namespace {

// The activation_checkpointing field of a ZeRO strategy, or of Parallel's data strategy.
template <class Strategy>
bool& strategy_checkpointing(Strategy& strategy) {
  if constexpr (requires { strategy.data.activation_checkpointing; }) return strategy.data.activation_checkpointing;
  else if constexpr (requires { strategy.zero.activation_checkpointing; }) return strategy.zero.activation_checkpointing;
  else return strategy.activation_checkpointing;
}

}  // namespace

TEST_SUITE("activation_checkpointing") {
  TEST_CASE("activation checkpointing: gradients bitwise equal to the plain backward through GPT blocks; the peak "
            "activation bytes fall with the layers") {
    accel::Trainer<> trainer;
    const gpt::Config c{.vocab = 64, .context = 32, .width = 64, .heads = 4, .layers = 8};
    auto net = gpt::make_gpt(c, trainer.tensor_group());
    auto ids = at::randint(c.vocab, {4, c.context}, at::TensorOptions().dtype(at::kLong));
    auto loss = [&](bool checkpointed) {
      at::Tensor x = net[0]->as<gpt::Embed>()->forward(ids);
      for (int l = 1; l <= c.layers; ++l) {
        auto* block = net[l]->as<gpt::Block>();
        x = checkpointed ? accel::nn::checkpoint([block](const at::Tensor& in) { return block->forward(in); }, x)
                         : block->forward(x);
      }
      auto logits = net[c.layers + 1]->as<gpt::Head>()->forward(x);
      return accel::nn::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), ids.reshape({-1}),
                                                     trainer.tensor_group());
    };
    auto gradients = [&](bool checkpointed) {
      for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
      loss(checkpointed).backward();
      std::vector<at::Tensor> out;
      for (auto& p : net->parameters()) out.push_back(p.grad().clone());
      return out;
    };
    const auto plain = gradients(false), recomputed = gradients(true);
    REQUIRE(plain.size() == recomputed.size());
    for (std::size_t i = 0; i < plain.size(); ++i) REQUIRE(plain[i].equal(recomputed[i]));
    // Peak bytes of a forward and backward (the gradients already there):
    // 8 blocks each keep only their input instead of all their activations.
    const auto without = estimate::peak_bytes_during([&] { loss(false).backward(); });
    const auto with = estimate::peak_bytes_during([&] { loss(true).backward(); });
    MESSAGE("activation checkpointing, gpt of 8 blocks: peak " << with << " bytes against " << without << " ("
                                                                << double(without) / double(with) << "x less)");
    CHECK(3 * with < without);
  }

  TEST_CASE("activation checkpointing replays the forward's random numbers (dropout) and leaves the generator "
            "where the plain run leaves it; parameters passed when no input requires a gradient") {
    auto w = at::randn({16, 16}).requires_grad_(true);
    auto x = at::randn({8, 16}).requires_grad_(true);
    auto f = [&](const at::Tensor& in) { return at::dropout(at::matmul(in, w).tanh(), 0.5, true); };
    auto run = [&](bool checkpointed, std::uint64_t seed) {
      w.mutable_grad() = at::Tensor();
      x.mutable_grad() = at::Tensor();
      at::manual_seed(seed);
      auto y = checkpointed ? accel::nn::checkpoint(f, x) : f(x);
      y.pow(2).sum().backward();
      return std::vector<at::Tensor>{w.grad().clone(), x.grad().clone(), at::rand({4})};
    };
    const auto plain = run(false, 3), recomputed = run(true, 3), other_seed = run(false, 4);
    for (std::size_t i = 0; i < plain.size(); ++i) CHECK(plain[i].equal(recomputed[i]));
    CHECK_FALSE(plain[0].equal(other_seed[0]));  // the dropout is live: another mask, other gradients

    // The data alone feeds the first layer: its parameters are passed so that they get their gradient.
    auto data = at::randn({8, 16});
    w.mutable_grad() = at::Tensor();
    at::matmul(data, w).tanh().sum().backward();
    const auto expected = w.grad().clone();
    w.mutable_grad() = at::Tensor();
    accel::nn::checkpoint([&](const at::Tensor& in) { return at::matmul(in, w).tanh(); }, data, {w}).sum().backward();
    REQUIRE(w.grad().defined());
    CHECK(w.grad().equal(expected));
  }

  TEST_CASE("activation_checkpointing, the strategy setting: every GPT block checkpointed through its Sequential "
            "entry under ZeRO-3, ZeRO-2, HybridShard and Parallel<ZeRO<3>> with a pipeline and with tensor 2; "
            "parameters bitwise those of the run without; the activations a forward keeps fall with the layers") {
    const gpt::Config c{.vocab = 64, .context = 32, .width = 64, .heads = 4, .layers = 8};
    const auto blocks = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP;
    auto checkpointed_entries = [](torch::nn::Sequential& net) {
      std::vector<std::string> out;
      for (const auto& entry : *net)
        if (auto* wrapped = dynamic_cast<accel::nn::CheckpointedEntryImpl*>(entry.ptr().get())) out.push_back(wrapped->path());
      return out;
    };
    // Three steps of the GPT; the parameters this rank ends with (the trainer
    // gives a ZeRO-3 model back whole when it goes), and the bytes the second
    // step's forward kept for backward.
    struct Run {
      std::vector<at::Tensor> parameters;
      std::vector<std::string> checkpointed;
      std::int64_t kept = 0;
    };
    auto train = [&](auto strategy, int rank) {
      Run run;
      accel::device::HostAllocationCounter counter;
      auto net = [&] {
        accel::Trainer<decltype(strategy)> trainer(strategy);
        trainer.set_seed(0);
        auto model = gpt::make_gpt(c, trainer.tensor_group());
        torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
        trainer.prepare(model, adam);
        run.checkpointed = checkpointed_entries(model);
        auto loss_fn = [&](const at::Tensor& logits, const at::Tensor& targets) {
          return accel::nn::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                                                         trainer.tensor_group());
        };
        for (int step = 0; step < 3; ++step) {
          at::manual_seed(100 * step + rank);
          auto ids = at::randint(c.vocab, {4, c.context}, at::TensorOptions().dtype(at::kLong));
          if constexpr (requires { strategy.pipeline; }) {
            trainer.step(ids, ids, loss_fn);
          } else {
            // Gloo's worker may drop its hold on the last step's buffers just after wait() returned.
            if (step == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
            const auto before = counter.live_bytes();
            auto loss = loss_fn(model->forward(ids), ids);
            if (step == 1) run.kept = counter.live_bytes() - before;
            trainer.backward(loss);
            trainer.optimizer_step();
            trainer.zero_grad();
          }
        }
        return model;
      }();
      for (const auto& p : net->parameters()) run.parameters.push_back(p.detach().clone());
      return run;
    };
    auto check = [&](auto strategy, const std::string& name, std::vector<std::string> expected, int world = 2) {
      accel::spawn(world, [&](int rank) {
        auto plain = train(strategy, rank);
        strategy_checkpointing(strategy) = true;
        auto checkpointed = train(strategy, rank);
        require(plain.checkpointed.empty(), name + ": entries checkpointed without the setting");
        require(checkpointed.checkpointed == expected,
                name + ": rank " + std::to_string(rank) + " checkpointed " + std::to_string(checkpointed.checkpointed.size()) +
                    " entries");
        for (std::size_t i = 0; i < plain.parameters.size(); ++i)
          require(plain.parameters[i].equal(checkpointed.parameters[i]),
                  name + ": parameter " + std::to_string(i) + " differs with activation checkpointing");
        if (rank == 0 && plain.kept > 0) {
          std::printf("activation_checkpointing %s, gpt of %d blocks: the forward keeps %lld bytes against %lld (%.1fx less)\n",
                      name.c_str(), static_cast<int>(c.layers), static_cast<long long>(checkpointed.kept),
                      static_cast<long long>(plain.kept), double(plain.kept) / double(checkpointed.kept));
          require(3 * checkpointed.kept < plain.kept, name + ": the checkpointed forward keeps " +
                                                         std::to_string(checkpointed.kept) + " bytes against " +
                                                         std::to_string(plain.kept));
        }
      }, bounded(std::chrono::seconds(120)));
    };
    std::vector<std::string> every_block;
    for (int l = 1; l <= c.layers; ++l) every_block.push_back(std::to_string(l));
    check(accel::ZeRO<3>{.auto_wrap_policy = blocks, .transformer_layer_cls_to_wrap = {"BlockImpl"}}, "ZeRO-3", every_block);
    // Size-based units are the blocks' large linear layers: each checkpoints its block, once.
    check(accel::ZeRO<2>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 8000}, "ZeRO-2",
          every_block);
    // Wrapped before the split, on the whole model: each stage's blocks run checkpointed.
    check(accel::Parallel<accel::ZeRO<3>>{.data = {.auto_wrap_policy = blocks, .transformer_layer_cls_to_wrap = {"BlockImpl"}},
                                          .pipeline = 2, .micro_batches = 2},
          "Parallel<ZeRO<3>> pipeline 2", every_block);
    // The recomputation repeats the tensor-parallel forward's all-reduces, in the same order on both ranks.
    check(accel::Parallel<accel::ZeRO<3>>{.data = {.auto_wrap_policy = blocks, .transformer_layer_cls_to_wrap = {"BlockImpl"}},
                                          .tensor = 2},
          "Parallel<ZeRO<3>> tensor 2", every_block);
    check(accel::HybridShard{.zero = {.auto_wrap_policy = blocks, .transformer_layer_cls_to_wrap = {"BlockImpl"}},
                             .shard_group_size = 2},
          "HybridShard 2x2", every_block, 4);
  }

  TEST_CASE("activation_checkpointing refused with a sentence: no units (NO_WRAP), a unit in no Sequential, the "
            "launcher's variable for a strategy without units; the variable sets the field") {
    CHECK_THROWS_WITH_AS(accel::Trainer<accel::ZeRO<3>>(accel::ZeRO<3>{.activation_checkpointing = true}),
                         doctest::Contains("auto_wrap_policy is NO_WRAP: set TRANSFORMER_BASED_WRAP"),
                         accel::ConfigurationError);
    struct TwoLayersImpl : torch::nn::Module {
      torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 8))};
      torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(8, 8))};
      at::Tensor forward(const at::Tensor& x) { return fc2(fc1(x).relu()); }
    };
    accel::Trainer<accel::ZeRO<2>> trainer(accel::ZeRO<2>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP,
                                                          .min_num_params = 10,
                                                          .activation_checkpointing = true});
    torch::nn::ModuleHolder<TwoLayersImpl> two_layers(std::make_shared<TwoLayersImpl>());
    CHECK_THROWS_WITH_AS(trainer.prepare(two_layers),
                         doctest::Contains("cannot reach the unit 'fc1': it is in no torch::nn::Sequential"),
                         accel::ConfigurationError);

    ScopedEnv env;
    env.set("FSDP_ACTIVATION_CHECKPOINTING", "true");
    accel::Trainer<accel::ZeRO<2>> sharded(accel::ZeRO<2>{.auto_wrap_policy = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP,
                                                          .transformer_layer_cls_to_wrap = {"BlockImpl"}});
    auto net = gpt::make_gpt(tiny_gpt, sharded.tensor_group());
    sharded.prepare(net);
    int checkpointed = 0;
    for (const auto& entry : *net) checkpointed += dynamic_cast<accel::nn::CheckpointedEntryImpl*>(entry.ptr().get()) != nullptr;
    CHECK(checkpointed == tiny_gpt.layers);
    CHECK_THROWS_WITH_AS(accel::Trainer<accel::DDP>{}, doctest::Contains("fsdp_activation_checkpointing=true"),
                         accel::ConfigurationError);
    env.set("FSDP_ACTIVATION_CHECKPOINTING", "maybe");
    CHECK_THROWS_WITH_AS(accel::Trainer<accel::ZeRO<2>>{}, doctest::Contains("FSDP_ACTIVATION_CHECKPOINTING='maybe'"),
                         accel::ConfigurationError);
  }

}
