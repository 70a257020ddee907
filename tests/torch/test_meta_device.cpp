// Models built on the meta device (NOTE [Models built on meta],
// deferred_init/meta.hpp): materialize gives bitwise the values of a real build,
// and ZeRO-3 / HybridShard prepare such a model a unit at a time, so no rank
// ever holds it whole.
#include <ATen/ops/arange.h>
#include <ATen/ops/rand.h>
#include <torch/nn/modules/activation.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <accel/device/allocation_counter.hpp>
#include <accel/deferred_init/meta.hpp>

#include "../../examples/gpt_model.hpp"
#include "doctest_torch.hpp"

using namespace accel::testing;

TEST_SUITE("meta_device") {
  TEST_CASE("build_on_meta, then materialize: bitwise the values of a real build from the same seed (the GPT, whose "
            "tensor-parallel layers cut a full Linear; values computed from other tensors, drawn through views, copied "
            "from a real tensor), the generator where a real build leaves it; refusals with a sentence") {
    const auto constant = at::arange(3, at::TensorOptions().dtype(at::kFloat));  // made outside: a real tensor
    struct InitialisersImpl : torch::nn::Module {
      explicit InitialisersImpl(const at::Tensor& constant) {
        c10::NoGradGuard no_grad;
        register_parameter("scaled", at::randn({5, 3}) * 0.02);  // computed from another tensor
        auto halves = register_parameter("halves", at::empty({6, 4}));
        halves.narrow(0, 0, 3).normal_(0, 1);  // drawn through views
        halves.narrow(0, 3, 3).uniform_(-1, 1);
        register_parameter("copied", at::empty({3})).copy_(constant);
        register_buffer("running", at::ones({4}) * 3);
        // Options taken from a meta tensor name the meta device: replayed where the model lives.
        register_parameter("options_of_meta", at::randn({2, 2}, halves.options()));
        register_buffer("mask", at::ones({4}, halves.options().dtype(at::kBool)));
      }
    };
    accel::comm::Communicator one_rank;
    const gpt::Config c{.vocab = 40, .context = 8, .width = 16, .heads = 2, .layers = 2};
    auto build = [&] {  // the GPT and the initialisers above, in one module
      auto all = std::make_shared<torch::nn::Module>();
      auto net = all->register_module("gpt", gpt::make_gpt(c, one_rank));
      all->register_module("initialisers", std::make_shared<InitialisersImpl>(constant));
      return std::make_pair(all, net);
    };
    at::manual_seed(7);
    auto [real, real_gpt] = build();
    const auto after_real = at::rand({4});
    at::manual_seed(7);
    auto [meta, meta_gpt] = accel::device::build_on_meta(build);
    const auto after_meta = at::rand({4});
    CHECK(after_real.equal(after_meta));
    for (const auto& p : meta->parameters()) REQUIRE(p.is_meta());
    at::manual_seed(9);
    const auto expected_next = at::rand({2});
    at::manual_seed(9);
    accel::device::materialize(*meta);
    CHECK(at::rand({2}).equal(expected_next));  // materialising leaves the generator alone
    auto compare = [](const auto& a, const auto& b) {
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        INFO(a[i].key());
        REQUIRE(a[i].key() == b[i].key());
        REQUIRE_FALSE(b[i].value().is_meta());
        CHECK(a[i].value().equal(b[i].value()));
      }
    };
    compare(real->named_parameters(), meta->named_parameters());
    compare(real->named_buffers(), meta->named_buffers());
    // It trains: autograd's accumulators expect host gradients now.
    auto ids = at::randint(c.vocab, {2, c.context}, at::TensorOptions().dtype(at::kLong));
    meta_gpt->forward(ids).sum().backward();
    CHECK(meta->parameters().front().grad().defined());

    auto converted = accel::device::build_on_meta([] { return torch::nn::Linear(3, 2); });
    converted->to(at::kDouble);  // made again outside the build
    CHECK_THROWS_WITH_AS(accel::device::materialize(*converted), doctest::Contains("made again outside it"),
                         std::logic_error);
    struct ResizedImpl : torch::nn::Module {
      ResizedImpl() {
        auto t = at::empty({2});
        t.resize_({4});
        register_parameter("w", t);
      }
    };
    auto resized = accel::device::build_on_meta([] { return std::make_shared<ResizedImpl>(); });
    CHECK_THROWS_WITH_AS(accel::device::materialize(*resized), doctest::Contains("'w' cannot be computed again: aten::resize_"),
                         std::logic_error);
    auto linear = accel::device::build_on_meta([] { return torch::nn::Linear(3, 2); });
    accel::Trainer<accel::DDP> ddp;
    CHECK_THROWS_WITH_AS(ddp.prepare(linear), doctest::Contains("only ZeRO<3> and HybridShard"), std::logic_error);
    accel::Trainer<accel::Parallel<accel::ZeRO<3>>> mesh;  // the data engine gets a part of the model, not a meta model
    CHECK_THROWS_WITH_AS(mesh.prepare(linear), doctest::Contains("call accel::device::materialize(model) before prepare"),
                         std::logic_error);
    for (const auto& p : linear->parameters()) CHECK(p.is_meta());  // refused before anything was moved
    // One rank built on meta, the other whole: both told, instead of a hang or different weights.
    accel::spawn(2, [](int rank) {
      accel::Trainer<accel::ZeRO<3>> zero3;
      auto build = [] { return torch::nn::Linear(3, 2); };
      auto model = rank == 1 ? accel::device::build_on_meta(build) : build();
      try {
        zero3.prepare(model);
      } catch (const std::runtime_error& e) {
        require(std::string(e.what()).find("rank 1's model is built on the meta device, rank 0's is not") !=
                    std::string::npos,
                e.what());
        return;
      }
      require(false, "rank " + std::to_string(rank) + " prepared a model built on meta beside one built whole");
    }, bounded(std::chrono::seconds(60)));
  }

  TEST_CASE("a model built on meta under ZeRO-3 (2 ranks, with and without cpu_offload) and HybridShard (2x2): parameters after prepare and after "
            "three Adam steps bitwise those of the model built whole, rank 0's initialisation winning on every rank; "
            "when the trainer goes, it returns to meta instead of being gathered whole") {
    const gpt::Config c{.vocab = 64, .context = 16, .width = 32, .heads = 4, .layers = 4};
    const auto blocks = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP;
    auto train = [&](auto strategy, int rank, bool on_meta, int steps, bool unwrap = true) {
      auto net = [&] {
        accel::Trainer<decltype(strategy)> trainer(strategy);
        at::manual_seed(1000 + rank);  // different generators: prepare gives every rank rank 0's values either way
        auto build = [&] { return gpt::make_gpt(c, trainer.tensor_group()); };
        auto model = on_meta ? accel::device::build_on_meta(build) : build();
        torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
        trainer.prepare(model, adam);
        for (const auto& p : model->parameters()) require(!p.is_meta(), "a parameter is still meta after prepare");
        for (int step = 0; step < steps; ++step) {
          at::manual_seed(100 * step + rank);
          auto ids = at::randint(c.vocab, {4, c.context}, at::TensorOptions().dtype(at::kLong));
          auto logits = model->forward(ids);
          trainer.backward(accel::nn::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), ids.reshape({-1}),
                                                                   trainer.tensor_group()));
          trainer.optimizer_step();
          trainer.zero_grad();
        }
        // Whole on every rank: a model built whole is given back whole when
        // the trainer goes, one built on meta goes back to meta (it may not fit).
        if (unwrap) trainer.unwrap_model();
        return model;
      }();
      std::vector<at::Tensor> out;
      for (const auto& p : net->parameters()) out.push_back(unwrap ? p.detach().clone() : p);
      return out;
    };
    auto check = [&](auto strategy, const std::string& name, int world) {
      accel::spawn(world, [&](int rank) {
        for (int steps : {0, 3}) {
          const auto whole = train(strategy, rank, false, steps);
          const auto built_on_meta = train(strategy, rank, true, steps);
          require(whole.size() == built_on_meta.size(), name + ": parameter count");
          for (std::size_t i = 0; i < whole.size(); ++i)
            require(whole[i].equal(built_on_meta[i]), name + ": rank " + std::to_string(rank) + ", parameter " +
                                                          std::to_string(i) + " differs after " + std::to_string(steps) +
                                                          " steps when the model was built on meta");
        }
        for (const auto& p : train(strategy, rank, true, 1, /*unwrap=*/false))
          require(p.is_meta(), name + ": a model built on meta was given back whole when the trainer went");
      }, bounded(std::chrono::seconds(120)));
    };
    check(accel::ZeRO<3>{.auto_wrap_policy = blocks, .transformer_layer_cls_to_wrap = {"BlockImpl"}}, "ZeRO-3", 2);
    check(accel::ZeRO<3>{.auto_wrap_policy = blocks, .transformer_layer_cls_to_wrap = {"BlockImpl"}, .cpu_offload = true},
          "ZeRO-3 + cpu_offload", 2);
    check(accel::HybridShard{.zero = {.auto_wrap_policy = blocks, .transformer_layer_cls_to_wrap = {"BlockImpl"}},
                             .shard_group_size = 2},
          "HybridShard 2x2", 4);
  }

  TEST_CASE("a model built on meta, prepared by ZeRO-3 on 4 ranks: the most host memory a rank holds while building "
            "and preparing stays within its shards (parameters and gradients) plus two units; built whole, it "
            "passes the whole model") {
    constexpr int layers = 16, width = 256;
    const std::int64_t unit_bytes = (width * width + width) * 4, model_bytes = layers * unit_bytes;
    auto make = [&] {
      torch::nn::Sequential net;
      for (int i = 0; i < layers; ++i) net->push_back(torch::nn::Linear(width, width));
      return net;
    };
    accel::spawn(4, [&](int rank) {
      auto peak = [&](bool on_meta) {
        accel::Trainer<accel::ZeRO<3>> trainer(
            accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 60000});
        accel::device::HostAllocationCounter counter;  // after the trainer connected: the model's bytes only
        auto model = on_meta ? accel::device::build_on_meta(make) : make();
        torch::optim::Adam adam(model->parameters());
        trainer.prepare(model, adam);
        require(trainer.strategy_engine().unit_count() == layers + 1, "one unit per layer, and the (empty) root");
        return counter.peak_bytes();
      };
      const auto whole = peak(false), built_on_meta = peak(true);
      const std::int64_t shards = 2 * model_bytes / 4, bound = shards + 2 * unit_bytes + 256 * 1024;
      if (rank == 0)
        std::printf("ZeRO-3 on 4 ranks, a %lld-byte model of %d layers: peak while building and preparing %lld bytes "
                    "built on meta, %lld built whole (shards %lld, one unit %lld)\n",
                    static_cast<long long>(model_bytes), layers, static_cast<long long>(built_on_meta),
                    static_cast<long long>(whole), static_cast<long long>(shards), static_cast<long long>(unit_bytes));
      require(built_on_meta <= bound, "rank " + std::to_string(rank) + ": built on meta, the peak " +
                                          std::to_string(built_on_meta) + " passes shards plus two units, " +
                                          std::to_string(bound));
      require(whole > model_bytes, "rank " + std::to_string(rank) + ": built whole, the peak " + std::to_string(whole) +
                                       " is under the model's " + std::to_string(model_bytes) + " bytes");
    }, bounded(std::chrono::seconds(120)));
  }

}
