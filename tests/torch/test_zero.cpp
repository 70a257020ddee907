// ZeRO stages 1 and 2 on real processes and real Gloo: equivalence with DDP
// and with one process, the per-rank memory model, overlap, clipping.
#include <torch/optim/adam.h>

#include "doctest_torch.hpp"

using namespace accel::testing;
using namespace std::chrono_literals;

namespace {

// Equivalence bound for fp32 runs of 3 or 4 Adam steps on odd_mlp: every
// difference measured (printed in the log) is at most 3e-8 on LibTorch 1.13
// and 2.15 (0 between ZeRO and DDP with one bucket), so 10x that. The
// companions show a rank alone, without communication, is far outside it.
constexpr double kFp32Bound = 3e-7;

// The companion: `diff` (from a run without communication) must be far outside the bound.
void outside(double diff, int rank, const std::string& what) {
  if (rank == 0) std::printf("zero: %s: %.2g (must exceed %.0e)\n", what.c_str(), diff, 100 * kFp32Bound);
  require(diff > 100 * kFp32Bound, what + ": " + std::to_string(diff) + " is inside the bound: the check could not fail");
}

// 7-13-13-5: 356 parameters, divisible neither by 2 nor by 3 (per bucket either).
torch::nn::Sequential odd_mlp() { return tiny_mlp(0, 7, 13, 5); }

GlobalBatch odd_batch(std::int64_t step, std::int64_t size) { return global_batch(step, size, 7, 5); }

// Trains `steps` Adam steps with per-rank batch `b` under Strategy; rank
// `rank` of `world` takes its slice of each global batch.
template <class Strategy>
torch::nn::Sequential train(Strategy strategy, int rank, int world, int steps, std::int64_t b, int accumulation = 1,
                            double clip = 0) {
  accel::Trainer<Strategy> trainer(strategy, accel::TrainerOptions{.gradient_accumulation_steps = accumulation});
  auto net = odd_mlp();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  trainer.prepare(net, opt);
  for (int step = 0; step < steps; ++step) {
    auto batch = odd_batch(step, b * world * accumulation);
    for (int m = 0; m < accumulation; ++m) {
      const std::int64_t first = (m * world + rank) * b;
      auto micro = trainer.accumulate();
      trainer.backward(loss_of(net, batch.x.narrow(0, first, b), batch.y.narrow(0, first, b)));
      if (clip > 0 && trainer.sync_gradients()) trainer.clip_grad_norm(clip);
      trainer.optimizer_step();
      trainer.zero_grad();
    }
  }
  return net;
}

torch::nn::Sequential reference(int steps, std::int64_t global, double clip = 0) {
  auto net = odd_mlp();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < steps; ++step) {
    auto batch = odd_batch(step, global);
    opt.zero_grad();
    loss_of(net, batch.x, batch.y).backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), clip);
    opt.step();
  }
  return net;
}

// An equivalence check: the measured difference beside its bound in the log
// (rank 0), so that how tight each bound is can be read off a run.
void within(double diff, double bound, int rank, const std::string& what) {
  if (rank == 0) std::printf("zero: %s: %.2g (bound %.0e)\n", what.c_str(), diff, bound);
  require(diff < bound, what + ": " + std::to_string(diff) + " is not below " + std::to_string(bound));
}

// One process on rank `rank`'s slice alone: what no communication would give.
torch::nn::Sequential alone(int steps, std::int64_t b, int world, int rank) {
  auto net = odd_mlp();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < steps; ++step) {
    auto batch = odd_batch(step, b * world);
    opt.zero_grad();
    loss_of(net, batch.x.narrow(0, rank * b, b), batch.y.narrow(0, rank * b, b)).backward();
    opt.step();
  }
  return net;
}

// P' in elements: odd_mlp's own parameters (read from a fresh model, not
// from the engine) padded as the bucket plan pads them (strategy/
// bucket_plan.hpp, checked by hand in tests/core). `unit_of_param`: ZeRO-3's
// unit of each parameter, as its wrap policy assigns them.
std::int64_t planned_elements(std::optional<accel::strategy::BucketCaps> caps, int shards,
                              const std::vector<int>& unit_of_param = {}) {
  std::vector<accel::strategy::ParameterSlot> slots;
  const auto params = odd_mlp()->parameters();
  for (std::size_t i = 0; i < params.size(); ++i)
    slots.push_back({.numel = params[i].numel(), .unit = unit_of_param.empty() ? 0 : unit_of_param[i]});
  std::int64_t elements = 0;
  for (const auto& bucket : accel::strategy::plan_buckets(slots, {.caps = caps, .pad_to_multiple = shards})) elements += bucket.padded;
  return elements;
}

// One Adam step of odd_mlp under `strategy` on `world` ranks; returns what
// the trainer holds then, and in `padded` the parameter count with each
// bucket padded to a multiple of `world` (DDP: unpadded).
template <class Strategy>
accel::ModelStateBytes bytes_after_one_step(Strategy strategy, int world, std::int64_t& padded) {
  accel::Trainer<Strategy> trainer(strategy);
  auto net = odd_mlp();
  torch::optim::Adam opt(net->parameters());
  trainer.prepare(net, opt);
  auto batch = odd_batch(0, 4);
  trainer.step([&] { return loss_of(net, batch.x, batch.y); });
  if constexpr (std::is_same_v<Strategy, accel::DDP>) padded = planned_elements(std::nullopt, 1);
  else if constexpr (std::is_same_v<Strategy, accel::ZeRO<3>>) padded = planned_elements(std::nullopt, world);  // NO_WRAP: one unit
  else padded = planned_elements(accel::strategy::BucketCaps{strategy.first_bucket_cap_mb, strategy.bucket_cap_mb}, world);
  return trainer.model_state_bytes();
}

}  // namespace

TEST_SUITE("zero") {
  TEST_CASE("equivalence: ZeRO-1 and ZeRO-2 with Adam on 2 and 3 ranks equal DDP and one process on the global "
            "batch (a model whose size divides by neither)") {
    spawn_each({2, 3}, [](int world, int rank) {
      const int steps = 4;
      const std::int64_t b = 3;
      auto single = reference(steps, b * world);
      auto ddp = train(accel::DDP{}, rank, world, steps, b);
      outside(max_param_diff(*alone(steps, b, world, rank), *single), rank, "a rank alone vs one process");
      for (double cap : {0.0002, 25.0}) {  // several buckets, and one
        auto z1 = train(accel::ZeRO<1>{.bucket_cap_mb = cap, .first_bucket_cap_mb = cap}, rank, world, steps, b);
        auto z2 = train(accel::ZeRO<2>{.bucket_cap_mb = cap, .first_bucket_cap_mb = cap}, rank, world, steps, b);
        for (auto* net : {&z1, &z2}) {
          within(max_param_diff(**net, *single), kFp32Bound, rank, "ZeRO-1/2 vs one process");
          within(max_param_diff(**net, *ddp), kFp32Bound, rank, "ZeRO-1/2 vs DDP");
        }
      }
    }, bounded(120s));
  }

  TEST_CASE("ZeRO-1 and ZeRO-2 with gradient accumulation and global-norm clipping equal one process") {
    accel::spawn(
        3,
        [](int rank) {
          const int steps = 3;
          const std::int64_t b = 2;
          auto check = [&](auto zero, const std::string& name) {
            auto accumulated = train(zero, rank, 3, steps, b, 2);
            within(max_param_diff(*accumulated, *reference(steps, b * 3 * 2)), kFp32Bound, rank, name + " accumulation");
            auto clipped = train(zero, rank, 3, steps, b, 1, 0.05);
            within(max_param_diff(*clipped, *reference(steps, b * 3, 0.05)), kFp32Bound, rank, name + " clipping");
            // The companion: clipping engaged, so the unclipped run is far outside the bound.
            const double unclipped = max_param_diff(*clipped, *reference(steps, b * 3));
            require(unclipped > 1e-3, name + ": clipping changed nothing (" + std::to_string(unclipped) + ")");
          };
          check(accel::ZeRO<1>{.bucket_cap_mb = 0.0002}, "ZeRO-1");
          check(accel::ZeRO<2>{.bucket_cap_mb = 0.0002}, "ZeRO-2");
        },
        bounded(120s));
  }

  TEST_CASE("memory: per-rank bytes follow the ZeRO paper's formulas (Adam, fp32)") {
    // P = padded parameter count (each bucket padded to a multiple of N). Per rank:
    //   DDP    params 4P, grads 4P,   Adam state 8P
    //   ZeRO-1 params 4P, grads 4P,   Adam state 8P/N
    //   ZeRO-2 params 4P, grads 4P/N, Adam state 8P/N
    spawn_each({2, 3}, [](int world, int) {
      auto measure = [&](auto strategy, std::int64_t& padded) { return bytes_after_one_step(strategy, world, padded); };
      std::int64_t P = 0;
      auto ddp = measure(accel::DDP{}, P);
      require(P == 356, "DDP: P is the parameter count");
      require(ddp.parameters == 4 * P && ddp.gradients == 4 * P && ddp.optimizer_state == 8 * P,
              "DDP bytes " + std::to_string(ddp.parameters) + " " + std::to_string(ddp.gradients) + " " +
                  std::to_string(ddp.optimizer_state));
      for (double cap : {0.0002, 25.0}) {
        auto z1 = measure(accel::ZeRO<1>{.bucket_cap_mb = cap, .first_bucket_cap_mb = cap}, P);
        require(P % world == 0 && P >= 356 && P < 356 + 4 * world, "padding is less than N per bucket");
        require(z1.parameters == 4 * P, "ZeRO-1 params " + std::to_string(z1.parameters));
        require(z1.gradients == 4 * P, "ZeRO-1 grads " + std::to_string(z1.gradients));
        require(z1.optimizer_state == 8 * P / world, "ZeRO-1 Adam state " + std::to_string(z1.optimizer_state));
        auto z2 = measure(accel::ZeRO<2>{.bucket_cap_mb = cap, .first_bucket_cap_mb = cap}, P);
        require(z2.parameters == 4 * P, "ZeRO-2 params");
        require(z2.gradients == 4 * P / world, "ZeRO-2 grads " + std::to_string(z2.gradients));
        require(z2.optimizer_state == 8 * P / world, "ZeRO-2 Adam state");
      }
    }, bounded(120s));
  }

  TEST_CASE("ZeRO-2 overlap: the first reduce-scatter starts before backward has finished") {
    accel::spawn(
        2,
        [](int rank) {
          accel::Trainer<accel::ZeRO<2>> trainer(accel::ZeRO<2>{.bucket_cap_mb = 0.0002, .first_bucket_cap_mb = 0.0002});
          auto net = odd_mlp();
          torch::optim::Adam opt(net->parameters());
          trainer.prepare(net, opt);
          auto& engine = trainer.strategy_engine();
          require(engine.bucket_count() >= 3, "several buckets");
          engine.record_events(true);
          auto batch = odd_batch(0, 4);
          trainer.backward(loss_of(net, batch.x.narrow(0, rank * 2, 2), batch.y.narrow(0, rank * 2, 2)));
          std::size_t first_launch = engine.events().size(), last_ready = 0;
          for (std::size_t i = 0; i < engine.events().size(); ++i) {
            if (engine.events()[i].kind == accel::strategy::DDPEvent::bucket_launched) first_launch = std::min(first_launch, i);
            else last_ready = i;
          }
          require(first_launch < last_ready, "a bucket was reduce-scattered while backward still ran");
          trainer.optimizer_step();
        },
        bounded(120s));
  }

  TEST_CASE("ZeRO refuses an optimizer that has already stepped") {
    accel::spawn(
        2,
        [](int) {
          accel::Trainer<accel::ZeRO<1>> trainer;
          auto net = odd_mlp();
          torch::optim::Adam opt(net->parameters());
          auto batch = odd_batch(0, 4);
          loss_of(net, batch.x, batch.y).backward();
          opt.step();
          try {
            trainer.prepare(net, opt);
          } catch (const std::logic_error& e) {
            require(std::string(e.what()).find("before its first step") != std::string::npos, e.what());
            return;
          }
          require(false, "prepare must refuse");
        },
        bounded(120s));
  }

  TEST_CASE("equivalence: ZeRO-3 with each auto-wrap policy, on 2 and 3 ranks, equals one process") {
    spawn_each({2, 3}, [](int world, int rank) {
      const int steps = 4;
      const std::int64_t b = 3;
      auto single = reference(steps, b * world);
      using accel::AutoWrapPolicy;
      for (auto z : {accel::ZeRO<3>{}, accel::ZeRO<3>{.auto_wrap_policy = AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 60},
                     accel::ZeRO<3>{.auto_wrap_policy = AutoWrapPolicy::TRANSFORMER_BASED_WRAP,
                                    .transformer_layer_cls_to_wrap = {"LinearImpl"}}}) {
        auto net = train(z, rank, world, steps, b);
        const double diff = max_param_diff(*net, *single);
        within(diff, kFp32Bound, rank, "ZeRO-3 vs one process");
        outside(max_param_diff(*net, *alone(steps, b, world, rank)), rank, "ZeRO-3 vs a rank alone");
      }
      auto accumulated = train(accel::ZeRO<3>{.auto_wrap_policy = AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 60},
                               rank, world, steps, b, 2, 0.05);
      within(max_param_diff(*accumulated, *reference(steps, b * world * 2, 0.05)), kFp32Bound, rank,
             "ZeRO-3 with accumulation and clipping");
    }, bounded(120s));
  }

  TEST_CASE("ZeRO-3 frees gathered parameters: outside a unit's forward and backward it holds only its shard") {
    accel::spawn(
        2,
        [](int rank) {
          accel::Trainer<accel::ZeRO<3>> trainer(
              accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP,
                             .transformer_layer_cls_to_wrap = {"torch::nn::LinearImpl"}});
          auto net = odd_mlp();
          torch::optim::Adam opt(net->parameters());
          trainer.prepare(net, opt);
          auto& engine = trainer.strategy_engine();
          require(engine.unit_count() == 4, "three Linear units and the (empty-handed) root, got " + std::to_string(engine.unit_count()));
          require(engine.gathered_bytes() == 0, "nothing gathered after prepare");
          std::int64_t peak = 0;
          std::vector<int> gathered_during;
          for (int step = 0; step < 2; ++step) {
            auto batch = odd_batch(step, 4);
            trainer.step([&] {
              auto h = net[0]->as<torch::nn::Linear>()->forward(batch.x.narrow(0, rank * 2, 2)).tanh();
              int count = 0;
              for (std::size_t u = 0; u < engine.unit_count(); ++u) count += engine.unit_gathered(u);
              gathered_during.push_back(count);
              peak = std::max(peak, engine.gathered_bytes());
              h = net[2]->as<torch::nn::Linear>()->forward(h).tanh();
              peak = std::max(peak, engine.gathered_bytes());
              return loss_of(net, batch.x.narrow(0, rank * 2, 2), batch.y.narrow(0, rank * 2, 2)) + 0 * h.sum();
            });
            require(engine.gathered_bytes() == 0, "after the step every unit is back to its shard");
            for (std::size_t u = 0; u < engine.unit_count(); ++u) require(!engine.unit_gathered(u), "unit freed");
          }
          require(gathered_during.front() == 1, "only the running unit is gathered in the forward");
          require(peak <= engine.largest_unit_bytes(), "at most the largest unit is gathered at a time");
          // Memory: everything / N (P padded per bucket), plus nothing gathered between steps.
          const std::int64_t P = planned_elements(std::nullopt, 2, {0, 0, 1, 1, 2, 2});  // a unit per Linear
          const auto bytes = trainer.model_state_bytes();
          require(bytes.parameters == 4 * P / 2, "ZeRO-3 params " + std::to_string(bytes.parameters));
          require(bytes.gradients == 4 * P / 2, "ZeRO-3 grads " + std::to_string(bytes.gradients));
          require(bytes.optimizer_state == 8 * P / 2, "ZeRO-3 Adam state " + std::to_string(bytes.optimizer_state));
        },
        bounded(120s));
  }

  TEST_CASE("at its end (unwrap_model, the Trainer's destructor) ZeRO-3 gathers the whole model into its idle step "
            "buffers' memory, not on top of it") {
    // One process: no Gloo thread holds a buffer, so the counter's figures are exact.
    accel::device::HostAllocationCounter counter;
    accel::Trainer<accel::ZeRO<3>> trainer(
        accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 1000});
    auto net = tiny_mlp(0, 32, 64, 10);
    torch::optim::Adam opt(net->parameters());
    trainer.prepare(net, opt);
    auto batch = global_batch(0, 8, 32, 10);
    for (int step = 0; step < 2; ++step) trainer.step([&] { return loss_of(net, batch.x, batch.y); });
    const std::int64_t idle = trainer.idle_buffer_bytes();
    REQUIRE(idle > 0);
    const std::int64_t before = counter.live_bytes();
    counter.reset_peak();
    trainer.unwrap_model();
    std::int64_t whole = 0;
    for (const auto& p : net->parameters()) whole += p.numel() * p.element_size();
    const std::int64_t above = counter.peak_bytes() - before;
    MESSAGE("idle step buffers " << idle << " B, whole model " << whole << " B, peak above before the gather " << above
                                 << " B");
    CHECK(trainer.idle_buffer_bytes() == 0);
    // Kept, the buffers would stay beside the whole model: the peak would be `whole` above.
    CHECK(above <= std::max<std::int64_t>(0, whole - idle));
  }

  TEST_CASE("ZeRO-3 reshard_after_forward = false (FSDP2): every unit stays gathered from its forward to its "
            "backward, is freed when its gradients leave, and the result is bitwise that of true") {
    accel::spawn(
        2,
        [](int rank) {
          // How many units hold their full parameters when the forward returns.
          auto gathered_after_forward = [&](bool reshard) {
            accel::Trainer<accel::ZeRO<3>> trainer(
                accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::TRANSFORMER_BASED_WRAP,
                               .transformer_layer_cls_to_wrap = {"torch::nn::LinearImpl"},
                               .reshard_after_forward = reshard});
            auto net = odd_mlp();
            torch::optim::Adam opt(net->parameters());
            trainer.prepare(net, opt);
            auto& engine = trainer.strategy_engine();
            int gathered = 0;
            std::int64_t bytes_after_forward = 0;
            auto batch = odd_batch(0, 4);
            trainer.step([&] {
              auto loss = loss_of(net, batch.x.narrow(0, rank * 2, 2), batch.y.narrow(0, rank * 2, 2));
              for (std::size_t u = 0; u < engine.unit_count(); ++u) gathered += engine.unit_gathered(u);
              bytes_after_forward = engine.gathered_bytes();
              return loss;
            });
            require(engine.gathered_bytes() == 0, "after the step every unit is back to its shard");
            if (!reshard) require(bytes_after_forward > engine.largest_unit_bytes(), "more than one unit held");
            return gathered;
          };
          const int kept = gathered_after_forward(false);
          const int freed = gathered_after_forward(true);
          require(kept == 3, "reshard_after_forward=false: the three Linear units held, got " + std::to_string(kept));
          require(freed == 1, "reshard_after_forward=true: only the last unit held, got " + std::to_string(freed));
          // Same arithmetic, only the memory schedule differs.
          const int steps = 3;
          const std::int64_t b = 3;
          auto wrap = [](bool reshard) {
            return accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 60,
                                  .reshard_after_forward = reshard};
          };
          auto kept_net = train(wrap(false), rank, 2, steps, b);
          auto freed_net = train(wrap(true), rank, 2, steps, b);
          require(max_param_diff(*kept_net, *freed_net) == 0, "reshard_after_forward false == true, bitwise");
          within(max_param_diff(*kept_net, *reference(steps, b * 2)), kFp32Bound, rank,
                 "reshard_after_forward=false vs one process");
        },
        bounded(120s));
  }

  TEST_CASE("reshard_after_forward = false under cpu_offload (2 ranks) and HybridShard (4 ranks, groups of 2) is "
            "bitwise reshard_after_forward = true, and one process") {
    auto zero3 = [](bool reshard, bool offload) {
      return accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 60,
                            .cpu_offload = offload, .reshard_after_forward = reshard};
    };
    const int steps = 3;
    const std::int64_t b = 2;
    accel::spawn(2, [&](int rank) {
      auto kept = train(zero3(false, true), rank, 2, steps, b);
      require(max_param_diff(*kept, *train(zero3(true, true), rank, 2, steps, b)) == 0,
              "offloaded: reshard_after_forward false == true, bitwise");
      within(max_param_diff(*kept, *reference(steps, b * 2)), kFp32Bound, rank, "offloaded, kept vs one process");
    }, bounded(120s));
    accel::spawn(4, [&](int rank) {
      auto hybrid = [&](bool reshard) { return accel::HybridShard{.zero = zero3(reshard, false), .shard_group_size = 2}; };
      auto kept = train(hybrid(false), rank, 4, steps, b);
      require(max_param_diff(*kept, *train(hybrid(true), rank, 4, steps, b)) == 0,
              "HybridShard: reshard_after_forward false == true, bitwise");
      within(max_param_diff(*kept, *reference(steps, b * 4)), kFp32Bound, rank, "HybridShard, kept vs one process");
    }, bounded(120s));
  }

  TEST_CASE("cpu_offload: ZeRO-1, ZeRO-2 and ZeRO-3 stepping host twins equal the same strategy without offload "
            "(bitwise) and one process; the optimizer state is held only by the twins") {
    // NOTE [CPU offload]. On this CPU device the twins are separate host
    // copies, so the copy-in / step / copy-out path runs as it does on CUDA.
    spawn_each({2, 3}, [](int world, int rank) {
      const int steps = 4;
      const std::int64_t b = 3;
      auto single = reference(steps, b * world);
      auto compare = [&](const char* name, auto plain_strategy, auto offloaded_strategy) {
        auto plain = train(plain_strategy, rank, world, steps, b);
        auto offloaded = train(offloaded_strategy, rank, world, steps, b);
        require(max_param_diff(*offloaded, *plain) == 0, std::string(name) + ": offloaded == not offloaded, bitwise");
        within(max_param_diff(*offloaded, *single), kFp32Bound, rank, std::string(name) + ": offloaded vs one process");
      };
      const double cap = 0.0002;  // several buckets
      compare("ZeRO-1", accel::ZeRO<1>{.bucket_cap_mb = cap, .first_bucket_cap_mb = cap},
              accel::ZeRO<1>{.bucket_cap_mb = cap, .first_bucket_cap_mb = cap, .cpu_offload = true});
      compare("ZeRO-2", accel::ZeRO<2>{.bucket_cap_mb = cap, .first_bucket_cap_mb = cap},
              accel::ZeRO<2>{.bucket_cap_mb = cap, .first_bucket_cap_mb = cap, .cpu_offload = true});
      using accel::AutoWrapPolicy;
      compare("ZeRO-3", accel::ZeRO<3>{.auto_wrap_policy = AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 60},
              accel::ZeRO<3>{.auto_wrap_policy = AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 60,
                             .cpu_offload = true});
      // Accumulation and global-norm clipping act on the twins' gradients.
      auto accumulated = train(accel::ZeRO<3>{.auto_wrap_policy = AutoWrapPolicy::SIZE_BASED_WRAP,
                                              .min_num_params = 60, .cpu_offload = true},
                               rank, world, steps, b, 2, 0.05);
      within(max_param_diff(*accumulated, *reference(steps, b * world * 2, 0.05)), kFp32Bound, rank,
             "offloaded ZeRO-3 with accumulation and clipping");
      auto clipped = train(accel::ZeRO<2>{.bucket_cap_mb = cap, .cpu_offload = true}, rank, world, steps, b, 1, 0.05);
      within(max_param_diff(*clipped, *reference(steps, b * world, 0.05)), kFp32Bound, rank, "offloaded ZeRO-2 with clipping");
      // The companion: clipping engaged, so the unclipped run is far outside the bound.
      require(max_param_diff(*clipped, *reference(steps, b * world)) > 1e-3, "offloaded ZeRO-2: clipping changed nothing");
    }, bounded(180s));
  }

  TEST_CASE("cpu_offload memory: the device keeps no optimizer state; the host holds the shard, its gradient and "
            "the Adam state (ZeRO formulas / N)") {
    spawn_each({2, 3}, [](int world, int) {
      auto measure = [&](auto strategy, std::int64_t& padded) { return bytes_after_one_step(strategy, world, padded); };
      std::int64_t P = 0;
      auto describe = [](const accel::ModelStateBytes& m) {
        return std::to_string(m.parameters) + " " + std::to_string(m.gradients) + " " +
               std::to_string(m.optimizer_state) + " | " + std::to_string(m.offloaded_parameters) + " " +
               std::to_string(m.offloaded_gradients) + " " + std::to_string(m.offloaded_optimizer_state);
      };
      auto host_side = [&](const accel::ModelStateBytes& m, const std::string& name) {
        require(m.optimizer_state == 0, name + ": no optimizer state on the device: " + describe(m));
        require(m.offloaded_parameters == 4 * P / world && m.offloaded_gradients == 4 * P / world &&
                    m.offloaded_optimizer_state == 8 * P / world,
                name + ": host holds shard, gradient shard, Adam state: " + describe(m));
      };
      auto z1 = measure(accel::ZeRO<1>{.bucket_cap_mb = 0.0002, .cpu_offload = true}, P);
      require(z1.parameters == 4 * P && z1.gradients == 4 * P, "ZeRO-1 device: " + describe(z1));
      host_side(z1, "ZeRO-1");
      auto z2 = measure(accel::ZeRO<2>{.bucket_cap_mb = 0.0002, .cpu_offload = true}, P);
      require(z2.parameters == 4 * P && z2.gradients == 4 * P / world, "ZeRO-2 device: " + describe(z2));
      host_side(z2, "ZeRO-2");
      auto z3 = measure(accel::ZeRO<3>{.cpu_offload = true}, P);
      require(z3.parameters == 4 * P / world && z3.gradients == 4 * P / world, "ZeRO-3 device: " + describe(z3));
      host_side(z3, "ZeRO-3");
      auto plain = measure(accel::ZeRO<3>{}, P);
      require(plain.offloaded_total() == 0 && plain.optimizer_state == 8 * P / world, "no offload: " + describe(plain));
    }, bounded(120s));
  }

  TEST_CASE("HybridShard with global-norm clipping, and with accumulation, on 4 ranks (2 groups of 2) equals one "
            "process") {
    accel::spawn(
        4,
        [](int rank) {
          const int steps = 3;
          const std::int64_t b = 2;
          auto clipped = train(accel::HybridShard{.zero = {.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP,
                                                           .min_num_params = 60},
                                                  .shard_group_size = 2},
                               rank, 4, steps, b, 1, 0.05);
          within(max_param_diff(*clipped, *reference(steps, b * 4, 0.05)), kFp32Bound, rank, "HybridShard clipping");
          const double unclipped = max_param_diff(*clipped, *reference(steps, b * 4));
          require(unclipped > 1e-3, "HybridShard: clipping changed nothing (" + std::to_string(unclipped) + ")");
          // Accumulation over 2 micro-batches: the replicas average what each shard group accumulated.
          auto accumulated = train(accel::HybridShard{.zero = {.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP,
                                                               .min_num_params = 60},
                                                      .shard_group_size = 2},
                                   rank, 4, steps, b, 2);
          within(max_param_diff(*accumulated, *reference(steps, b * 4 * 2)), kFp32Bound, rank, "HybridShard accumulation");
          require(max_param_diff(*accumulated, *reference(steps, b * 4)) > 1e-3, "accumulation changed the batch");
        },
        bounded(120s));
  }

  TEST_CASE("HybridShard (FSDP HYBRID_SHARD): 4 ranks in 2 shard groups of 2 equal one process, with and without "
            "cpu_offload; each rank holds half the model") {
    accel::spawn(
        4,
        [](int rank) {
          const int steps = 4;
          const std::int64_t b = 3;
          auto single = reference(steps, b * 4);
          for (bool offload : {false, true}) {
            accel::Trainer<accel::HybridShard> trainer(
                accel::HybridShard{.zero = {.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP,
                                            .min_num_params = 60,
                                            .cpu_offload = offload},
                                   .shard_group_size = 2});
            auto net = odd_mlp();
            torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
            trainer.prepare(net, opt);
            for (int step = 0; step < steps; ++step) {
              auto batch = odd_batch(step, b * 4);
              trainer.step([&] { return loss_of(net, batch.x.narrow(0, rank * b, b), batch.y.narrow(0, rank * b, b)); });
            }
            const std::int64_t P = planned_elements(std::nullopt, 2, {0, 0, 1, 1, 2, 2});  // each Linear >= 60
            const auto bytes = trainer.model_state_bytes();
            const auto state = offload ? bytes.offloaded_optimizer_state : bytes.optimizer_state;
            require(bytes.parameters == 4 * P / 2 && state == 8 * P / 2, "sharded over the group of 2");
            trainer.unwrap_model();
            const double diff = max_param_diff(*net, *single);
            within(diff, kFp32Bound, rank, std::string("HybridShard vs one process") + (offload ? " (offloaded)" : ""));
            // Against its shard group's batch alone (no replica all-reduce): far off.
            outside(max_param_diff(*net, *alone(steps, 2 * b, 2, rank / 2)), rank, "HybridShard vs its group alone");
          }
        },
        bounded(120s));
  }

  TEST_CASE("one sharded engine: every ZeRO stage and HybridShard is ShardedEngine, set by its stage's choices") {
    using accel::strategy::ShardedEngine;
    static_assert(std::is_same_v<accel::ZeRO<1>::engine, ShardedEngine> &&
                  std::is_same_v<accel::ZeRO<2>::engine, ShardedEngine> &&
                  std::is_same_v<accel::ZeRO<3>::engine, ShardedEngine> &&
                  std::is_same_v<accel::HybridShard::engine, ShardedEngine>);
    struct Expected {
      bool shard_gradients, free_parameters;
      std::size_t units;  // odd_mlp under SIZE_BASED_WRAP at 60: three Linear units and the root's
    };
    auto check = [](auto strategy, Expected expected, const char* name) {
      CAPTURE(name);
      accel::Trainer<decltype(strategy)> trainer(strategy);
      auto net = odd_mlp();
      torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
      trainer.prepare(net, opt);
      const auto& engine = trainer.strategy_engine();
      CHECK(engine.settings().shard_gradients == expected.shard_gradients);
      CHECK(engine.settings().free_parameters == expected.free_parameters);
      CHECK(std::string(engine.settings().strategy_name) == name);
      CHECK(engine.unit_count() == expected.units);
      auto batch = odd_batch(0, 4);
      trainer.step([&] { return loss_of(net, batch.x, batch.y); });
      // Freed parameters are gathered only while used; kept ones always are.
      CHECK(engine.gathered_bytes() == 0);
      for (std::size_t u = 0; u < engine.unit_count(); ++u) CHECK(!engine.unit_gathered(u));
      CHECK(engine.optimizer_parameters().size() == engine.device_shards().size());
    };
    const accel::ZeRO<3> units{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 60};
    check(accel::ZeRO<1>{}, {false, false, 0}, "ZeRO<1>");
    check(accel::ZeRO<2>{}, {true, false, 0}, "ZeRO<2>");
    check(units, {true, true, 4}, "ZeRO<3>");
    check(accel::HybridShard{.zero = units, .shard_group_size = 1}, {true, true, 4}, "HybridShard");
  }
  TEST_CASE("a parameter without gradient: the error names it and the setting, spelled for the user's tag") {
    struct TwoHeads : torch::nn::Module {  // the loss never reaches `unused`
      TwoHeads() {
        at::manual_seed(0);
        body = register_module("body", torch::nn::Linear(7, 8));
        used = register_module("used", torch::nn::Linear(8, 5));
        unused = register_module("unused", torch::nn::Linear(8, 5));
      }
      torch::nn::Linear body{nullptr}, used{nullptr}, unused{nullptr};
    };
    auto step = [](auto strategy) {
      auto model = std::make_shared<TwoHeads>();
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
      accel::Trainer<decltype(strategy)> trainer(strategy);
      trainer.prepare(model, opt);
      auto batch = odd_batch(0, 4);
      trainer.step([&] { return torch::nn::functional::cross_entropy(model->used(model->body(batch.x).tanh()), batch.y); });
    };
    auto refused = [&](auto strategy, const std::string& spelling) {
      CAPTURE(spelling);
      try {
        step(strategy);
        FAIL("a parameter without gradient must be an error");
      } catch (const std::runtime_error& e) {
        const std::string text = e.what();
        CAPTURE(text);
        CHECK(text.find("'unused.") != std::string::npos);
        CHECK(text.find("use " + spelling) != std::string::npos);
      }
    };
    refused(accel::ZeRO<1>{}, "ZeRO<1>{.find_unused_parameters = true}");
    refused(accel::ZeRO<2>{}, "ZeRO<2>{.find_unused_parameters = true}");
    refused(accel::ZeRO<3>{}, "ZeRO<3>{.find_unused_parameters = true}");
    refused(accel::HybridShard{.shard_group_size = 1}, "HybridShard{.zero = {.find_unused_parameters = true}}");
    // Spelled as the error says, each one steps.
    CHECK_NOTHROW(step(accel::ZeRO<1>{.find_unused_parameters = true}));
    CHECK_NOTHROW(step(accel::ZeRO<2>{.find_unused_parameters = true}));
    CHECK_NOTHROW(step(accel::ZeRO<3>{.find_unused_parameters = true}));
    CHECK_NOTHROW(step(accel::HybridShard{.zero = {.find_unused_parameters = true}, .shard_group_size = 1}));
  }
}
