// Cells of the feature x strategy matrix (tests/README.md) that no
// strategy's own suite covers, each run under every strategy that offers the
// feature: the cross-rank toolbox over the data group, BF16 against one bf16
// process, FP16's overflow decision on gradient shards, and a dead rank named.
#include <ATen/autocast_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/sort.h>
#include <nlohmann/json.hpp>  // gather_object (accel declares it only when compiled once)
#include <torch/optim/sgd.h>

#include <csignal>
#include <limits>
#include <numeric>
#include <thread>
#include <type_traits>

#include "accel/device/allocation_counter.hpp"
#include "accel/nn/tensor_parallel.hpp"
#include "doctest_torch.hpp"

using namespace accel::testing;
using accel::comm::MeshDim;
using namespace std::chrono_literals;

namespace {

at::Tensor cross_entropy(const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); }

// Pipeline stages, and this rank's stage (1 and 0 outside Parallel<>).
template <class Trainer>
std::pair<int, int> pipeline_of(Trainer& trainer) {
  if constexpr (requires { trainer.strategy_engine().mesh(); }) {
    auto& mesh = trainer.strategy_engine().mesh();
    return {mesh.size(MeshDim::pipeline), mesh.coordinate(MeshDim::pipeline)};
  } else {
    return {1, 0};
  }
}

// The model a trainer of any strategy trains here: column / row parallel
// halves of full_layers({8x16, 16x4}) when it has a tensor group, else those
// layers whole (pipeline stages need more modules: a 3-hidden-layer MLP).
template <class Trainer>
torch::nn::Sequential model_for(Trainer& trainer) {
  auto& tp = trainer.tensor_group();
  auto full = full_layers({{8, 16}, {16, 4}});
  if (tp.size() > 1)
    return torch::nn::Sequential(accel::nn::ColumnParallelLinear(full[0], tp), torch::nn::Tanh(),
                                 accel::nn::RowParallelLinear(full[1], tp));
  if (pipeline_of(trainer).first > 1) return tiny_mlp(0, 8, 16, 4, 3);
  return torch::nn::Sequential(full[0], torch::nn::Tanh(), full[1]);
}

// What the cross-rank toolbox must give under any strategy: results over the
// data group (`data` ranks reading different samples; under Parallel<> the
// tensor and pipeline peers read the same ones and count once). An ordinary
// function of accel::TrainerBase: every Trainer<...> is one, and the toolbox
// is compiled once (trainer_base.hpp), not per Trainer type.
void toolbox_over_the_data_group(accel::TrainerBase& trainer, int data) {
  auto& group = trainer.data_group();
  require(group.size() == data, "the data group has " + std::to_string(group.size()) + " ranks, " +
                                    std::to_string(data) + " expected");
  const int d = group.rank();

  // gather_for_metrics: each sample of a dataset that does not divide, once.
  const std::int64_t n = 11;
  auto loader = trainer.prepare(accel::data::TensorDataset(at::arange(n).unsqueeze(1).to(at::kFloat), at::arange(n)),
                                {.batch_size = 2, .shuffle = true, .seed = 3});
  std::vector<at::Tensor> gathered;
  for (auto batch : loader) gathered.push_back(trainer.gather_for_metrics(batch.target));
  require(std::get<0>(at::cat(gathered).sort()).equal(at::arange(n)), "each of the 11 samples exactly once");

  // gather_object and pad_across_processes: one entry per data rank, in order.
  std::vector<int> places(static_cast<std::size_t>(data));
  std::iota(places.begin(), places.end(), 0);
  require(trainer.gather_object(d) == places, "gather_object: one object per data rank, in order");
  const at::Tensor padded = trainer.pad_across_processes(at::full({d + 1}, static_cast<float>(d)), 0, -1);
  require(padded.size(0) == data && padded.narrow(0, 0, d + 1).eq(d).all().item<bool>() &&
              padded.narrow(0, d + 1, data - d - 1).eq(-1).all().item<bool>(),
          "padded to the longest data rank's length, own rows first");
  require(trainer.gather(padded).size(0) == data * data, "gathered after padding");

  // reduce: a sum counts each data rank's value once.
  const float sum = static_cast<float>(data * (data - 1) / 2);
  const at::Tensor values = at::tensor({static_cast<float>(d), -static_cast<float>(d)});
  require(trainer.reduce(values, "max").equal(at::tensor({static_cast<float>(data - 1), 0.0f})), "reduce(max)");
  require(trainer.reduce(values, "sum").equal(at::tensor({sum, -sum})), "reduce(sum)");
  require(trainer.reduce(values, "mean").equal(at::tensor({sum / data, -sum / data})), "reduce(mean)");
}

// Runs `fn(trainer)` on `world` ranks, each with a Trainer<decltype(strategy)>.
template <class Strategy, class Fn>
void on_ranks(int world, Strategy strategy, Fn fn, std::chrono::seconds timeout = 120s) {
  accel::spawn(world, [&](int) {
    accel::Trainer<Strategy> trainer(strategy);
    fn(trainer);
  }, bounded(timeout));
}

// One process with CPU autocast in bf16 set directly (not through the
// Trainer under test), SGD(0.1) on rows [first, first + count) of the global
// batches of `global` rows.
void train_bf16_alone(torch::nn::Sequential& net, int steps, std::int64_t global, std::int64_t first,
                      std::int64_t count) {
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < steps; ++step) {
    auto batch = global_batch(step, global);
    accel::compat::set_autocast_dtype(c10::DeviceType::CPU, at::kBFloat16);
    accel::compat::set_autocast_enabled(c10::DeviceType::CPU, true);
    auto loss = cross_entropy(net->forward(batch.x.narrow(0, first, count)), batch.y.narrow(0, first, count));
    accel::compat::set_autocast_enabled(c10::DeviceType::CPU, false);
    at::autocast::clear_cache();  // as leaving PyTorch's autocast does: no stale bf16 weights next step
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
}

// This rank's parameters, whole: tensor-parallel slices joined (column
// weights and biases along 0, row weights along 1), a pipeline stage's
// parameters in place of the model's.
template <class Trainer>
std::vector<at::Tensor> whole_parameters(Trainer& trainer, torch::nn::Sequential& net) {
  trainer.unwrap_model();  // ZeRO-3: the parameters whole again
  std::vector<at::Tensor> whole;
  if constexpr (requires { trainer.strategy_engine().pipeline(); })
    if (pipeline_of(trainer).first > 1) {
      for (const auto& p : trainer.strategy_engine().pipeline().parameters()) whole.push_back(p.detach());
      return whole;
    }
  auto& tp = trainer.tensor_group();
  for (const auto& item : net->named_parameters()) {
    const auto& name = item.key();
    at::Tensor p = item.value().detach();
    if (tp.size() > 1 && name != "2.bias") {
      const std::int64_t dim = name == "2.weight" ? 1 : 0;
      p = at::cat(tp.all_gather(p.contiguous(), "test gather"), dim);
    }
    whole.push_back(p);
  }
  return whole;
}

// The parameters of `reference` this rank holds: a pipeline stage's are the
// first or last ones.
template <class Trainer>
double max_diff_to(Trainer& trainer, const std::vector<at::Tensor>& mine, torch::nn::Sequential& reference) {
  auto all = reference->parameters();
  std::size_t offset = 0;
  if (pipeline_of(trainer).second > 0) offset = all.size() - mine.size();
  double worst = 0;
  for (std::size_t i = 0; i < mine.size(); ++i) worst = std::max(worst, (mine[i] - all[offset + i]).abs().max().item<double>());
  return worst;
}

// Strategy + BF16 on per-data-rank batches of 4 against one bf16 process on
// the global batch. `bound` is set from the measured distance; the companion
// shows it fails what the strategy could get wrong: with more than one data
// rank, one rank's batch alone (no gradient communication); with one, a run
// a step short (so the bound is tighter than one step's movement).
template <class Strategy>
void bf16_matches_one_bf16_process(Strategy strategy, const std::string& name, double bound) {
  const int steps = 5;
  const std::int64_t b = 4;
  accel::Trainer<Strategy, accel::BF16> trainer(strategy);
  const int data = trainer.data_group().size(), d = trainer.data_group().rank();
  auto net = model_for(trainer);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  trainer.prepare(net, opt);
  at::ScalarType inside = at::kFloat;
  auto loss_fn = [&](const at::Tensor& out, const at::Tensor& y) {
    inside = out.scalar_type();
    return cross_entropy(out, y);
  };
  for (int step = 0; step < steps; ++step) {
    auto batch = global_batch(step, b * data);
    trainer.step(batch.x.narrow(0, d * b, b), batch.y.narrow(0, d * b, b), loss_fn);
  }
  // The last pipeline stage computes the loss: it saw the bf16 output.
  const auto [stages, stage] = pipeline_of(trainer);
  const bool last_stage = stage == stages - 1;
  require(!last_stage || inside == at::kBFloat16, name + ": the forward ran in bf16");
  const auto mine = whole_parameters(trainer, net);
  auto reference = [&](int ref_steps, std::int64_t first, std::int64_t count) {
    auto full = full_layers({{8, 16}, {16, 4}});
    torch::nn::Sequential ref = net->size() == 3 ? torch::nn::Sequential(full[0], torch::nn::Tanh(), full[1])
                                                 : tiny_mlp(0, 8, 16, 4, 3);
    train_bf16_alone(ref, ref_steps, b * data, first, count);
    return ref;
  };
  auto global = reference(steps, 0, b * data);
  const double diff = max_diff_to(trainer, mine, global);
  auto companion = data > 1 ? reference(steps, d * b, b) : reference(steps - 1, 0, b);
  const double off = max_diff_to(trainer, mine, companion);
  if (trainer.is_main_process())
    std::printf("%s + BF16: vs one bf16 process %s, companion (%s) %s\n", name.c_str(), sci(diff).c_str(),
                data > 1 ? "one data rank alone" : "a step short", sci(off).c_str());
  require(diff < bound, name + " + BF16 vs one bf16 process: " + sci(diff));
  require(off > bound, name + ": the companion is within the bound too (" + sci(off) + ")");
}

// The sequence Trainer<Strategy, FP16, CUDA>::optimizer_step runs (FP16
// autocast needs CUDA; the scaler does not), on the engine's own gradients:
// under ZeRO-2/3 and HybridShard this rank's shards (on the host twins with
// cpu_offload), under Parallel<> its slices. An inf planted in the last
// rank's gradients after communication, which only that rank sees, must
// skip the step on every rank.
template <class Strategy>
void overflow_on_one_rank_skips_everywhere(Strategy strategy, const std::string& name) {
  accel::Trainer<Strategy> trainer(strategy);
  const int data = trainer.data_group().size(), d = trainer.data_group().rank();
  auto net = model_for(trainer);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  trainer.prepare(net, opt);
  auto& engine = trainer.strategy_engine();
  accel::precision::GradScaler scaler(accel::FP16{.init_scale = 1024, .growth_interval = 2});
  const bool planter = trainer.process_index() == trainer.num_processes() - 1;
  auto snapshot = [&] {
    std::vector<at::Tensor> copy;
    for (const auto& p : engine.optimizer_parameters()) copy.push_back(p.detach().clone());
    return copy;
  };
  auto unchanged = [&](const std::vector<at::Tensor>& before) {
    const auto& now = engine.optimizer_parameters();
    for (std::size_t i = 0; i < now.size(); ++i)
      if (!now[i].equal(before[i])) return false;
    return true;
  };
  auto step = [&](std::int64_t i, bool plant_inf) {
    auto batch = global_batch(i, 4 * data);
    // backward returns with the gradients reduced (Trainer::backward).
    trainer.backward(scaler.scale_loss(cross_entropy(net->forward(batch.x.narrow(0, d * 4, 4)), batch.y.narrow(0, d * 4, 4))));
    if (plant_inf && planter) {
      bool planted = false;
      for (const auto& p : engine.optimizer_parameters())
        if (!planted && p.grad().defined() && p.grad().numel() > 0) {
          p.grad().view(-1)[0].fill_(std::numeric_limits<float>::infinity());
          planted = true;
        }
      require(planted, name + ": a gradient to plant the inf in");
    }
    const bool skipped = scaler.unscale(engine.optimizer_parameters(), trainer.communicator());
    if (!skipped) {
      opt.step();
      engine.after_optimizer_step();
    }
    scaler.update();
    engine.zero_grad(opt);
    return skipped;
  };
  const std::string where = name + ", rank " + std::to_string(trainer.process_index()) + ": ";
  require(!step(0, false), where + "a clean step is taken");
  auto before = snapshot();
  require(step(1, true), where + "the step with an inf on the last rank is skipped here too");
  require(unchanged(before), where + "nothing stepped");
  require(scaler.scale() == 512, where + "backed off to 512, got " + std::to_string(scaler.scale()));
  require(!step(2, false) && !step(3, false), where + "clean steps are taken");
  require(!unchanged(before), where + "the clean steps moved the parameters");
  require(scaler.scale() == 1024, where + "grew back after growth_interval = 2 clean steps");
}

// `world` ranks step under `strategy`; the last is SIGKILLed once the others
// are inside the step's collectives. Returns how each rank's step ended
// (report_collective_failure's text; the victim's is empty).
template <class Strategy>
std::vector<std::string> kill_the_last_rank(Strategy strategy, int world) {
  const std::string result = temp_path("killed");
  auto options = bounded(60s);
  options.stop_on_failure = false;  // watch the survivors fail by themselves
  try {
    accel::spawn(world, [&](int rank) {
      accel::Trainer<Strategy> trainer(strategy, accel::TrainerOptions{.timeout = 5s});
      auto net = model_for(trainer);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
      trainer.prepare(net, opt);
      trainer.wait_for_everyone();
      if (rank == world - 1) {
        std::this_thread::sleep_for(300ms);  // the others are inside the step by now
        ::raise(SIGKILL);
      }
      report_collective_failure(result + "_" + std::to_string(rank), [&] {
        auto batch = global_batch(0, 4);
        trainer.step(batch.x, batch.y, cross_entropy);
      });
    }, options);
  } catch (const accel::SpawnError&) {
    // The victim's death fails the spawn; what matters is what the survivors said.
  }
  std::vector<std::string> texts;
  for (int rank = 0; rank < world; ++rank) texts.push_back(take_file(result + "_" + std::to_string(rank)));
  return texts;
}

// Under Parallel<>, what a rank holds between steps (counted at the
// allocator from before the model exists, the batch left out) and what
// model_state_bytes says, after two SGD-with-momentum steps.
struct HeldBetweenSteps {
  accel::ModelStateBytes state;
  std::int64_t buffers = 0;  // the engine's idle step buffers (NOTE [Buffers that live as long as the engine])
  std::int64_t live = 0;
};

template <class Data>
HeldBetweenSteps held_between_steps(accel::Parallel<Data> settings) {
  accel::device::HostAllocationCounter counter;
  accel::Trainer<accel::Parallel<Data>> trainer(settings);
  auto& tp = trainer.tensor_group();
  torch::nn::Sequential net;
  if (settings.tensor > 1) {
    auto full = full_layers({{64, 512}, {512, 10}});
    net = torch::nn::Sequential(accel::nn::ColumnParallelLinear(full[0], tp), torch::nn::Tanh(),
                                accel::nn::RowParallelLinear(full[1], tp));
  } else {
    net = torch::nn::Sequential(torch::nn::Linear(64, 512), torch::nn::Tanh(), torch::nn::Linear(512, 512),
                                torch::nn::Tanh(), torch::nn::Linear(512, 10));
  }
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  trainer.prepare(net, opt);
  auto batch = global_batch(0, 8, 64, 10);
  // The batch's bytes from its own storages: counting them as the difference
  // around global_batch() once took in a buffer Gloo's worker released in
  // that window (prepare's broadcast, freed just after wait() returned), and
  // the rank then seemed to hold those bytes for good.
  const auto batch_bytes = static_cast<std::int64_t>(batch.x.storage().nbytes() + batch.y.storage().nbytes());
  for (int step = 0; step < 2; ++step) trainer.step(batch.x, batch.y, cross_entropy);
  std::this_thread::sleep_for(100ms);  // the same release after the last step's collectives
  return {trainer.model_state_bytes(), trainer.idle_buffer_bytes(), counter.live_bytes() - batch_bytes};
}

}  // namespace

TEST_SUITE("matrix") {
  TEST_CASE("gather_for_metrics, gather_object, pad_across_processes and reduce act over the data group under every "
            "strategy: each sample once, each data rank once") {
    {
      accel::Trainer<accel::SingleProcess> trainer;
      toolbox_over_the_data_group(trainer, 1);
    }
    auto toolbox = [](int data) { return [data](auto& trainer) { toolbox_over_the_data_group(trainer, data); }; };
    on_ranks(2, accel::DDP{}, toolbox(2));
    on_ranks(3, accel::ZeRO<1>{}, toolbox(3));
    on_ranks(2, accel::ZeRO<2>{}, toolbox(2));
    on_ranks(3, accel::ZeRO<3>{}, toolbox(3));
    on_ranks(2, accel::ZeRO<3>{.cpu_offload = true}, toolbox(2));
    on_ranks(4, accel::HybridShard{.shard_group_size = 2}, toolbox(4));
    on_ranks(2, accel::Parallel<>{.tensor = 2}, toolbox(1));
    on_ranks(4, accel::Parallel<>{.pipeline = 2, .micro_batches = 2}, toolbox(2));
    on_ranks(4, accel::Parallel<accel::ZeRO<3>>{.tensor = 2}, toolbox(2));
  }

  TEST_CASE("BF16 under HybridShard, tensor 2, pipeline 2 and data 2 x tensor 2 runs the forward in bf16 and matches "
            "one bf16 process; the bound fails its companion") {
    // Measured (1.13; 2.15): 1.4e-4, 9.8e-5, 6.7e-5 and 1.6e-4 (8.5e-5, 9.8e-5, 7.6e-5, 1.3e-4) from one bf16 process (each sums the batch in other
    // groupings, rounding to 8 mantissa bits); companions 5.5e-2 (a data rank alone) and 2.5e-2, 6.8e-3 (a
    // step short). Before the pipeline sent its dtype, stage 1 read bf16 activations as fp32: 1.3e-2.
    accel::spawn(4, [](int) {
      bf16_matches_one_bf16_process(accel::HybridShard{.shard_group_size = 2}, "HybridShard 2x2", 1e-3);
    }, bounded(120s));
    accel::spawn(2, [](int) { bf16_matches_one_bf16_process(accel::Parallel<>{.tensor = 2}, "tensor 2", 1e-3); },
                 bounded(120s));
    accel::spawn(2, [](int) {
      bf16_matches_one_bf16_process(accel::Parallel<>{.pipeline = 2, .micro_batches = 2}, "pipeline 2", 7e-4);
    }, bounded(120s));
    accel::spawn(4, [](int) {
      bf16_matches_one_bf16_process(accel::Parallel<accel::ZeRO<2>>{.tensor = 2}, "data 2 x tensor 2 (ZeRO-2)", 1e-3);
    }, bounded(120s));
  }

  TEST_CASE("FP16's overflow decision on each engine's gradients: an inf that only the last rank's shard or slice "
            "holds skips the step on every rank under ZeRO-1, ZeRO-2, ZeRO-3, cpu_offload, HybridShard and Parallel<>") {
    accel::spawn(2, [](int) { overflow_on_one_rank_skips_everywhere(accel::ZeRO<1>{}, "ZeRO-1"); }, bounded());
    accel::spawn(2, [](int) { overflow_on_one_rank_skips_everywhere(accel::ZeRO<2>{}, "ZeRO-2"); }, bounded());
    accel::spawn(3, [](int) { overflow_on_one_rank_skips_everywhere(accel::ZeRO<3>{}, "ZeRO-3"); }, bounded());
    accel::spawn(2, [](int) {
      overflow_on_one_rank_skips_everywhere(accel::ZeRO<2>{.cpu_offload = true}, "ZeRO-2 offload");
    }, bounded());
    accel::spawn(4, [](int) {
      overflow_on_one_rank_skips_everywhere(accel::HybridShard{.shard_group_size = 2}, "HybridShard 2x2");
    }, bounded());
    accel::spawn(2, [](int) { overflow_on_one_rank_skips_everywhere(accel::Parallel<>{.tensor = 2}, "tensor 2"); },
                 bounded());
    accel::spawn(4, [](int) {
      overflow_on_one_rank_skips_everywhere(accel::Parallel<accel::ZeRO<3>>{.tensor = 2}, "data 2 x tensor 2 (ZeRO-3)");
    }, bounded());
  }

  TEST_CASE("a rank killed mid-step is named by every survivor within the timeout, under ZeRO-3, cpu_offload, "
            "HybridShard, tensor 2, pipeline 2 and data 2 x tensor 2") {
    auto survivors_name_it = [](const std::string& name, const std::vector<std::string>& texts) {
      const int victim = static_cast<int>(texts.size()) - 1;
      for (int rank = 0; rank < victim; ++rank) {
        INFO(name, ", survivor ", rank, ": ", texts[rank]);
        REQUIRE(reports_failure(texts[rank]));
        CHECK(texts[rank].find("rank " + std::to_string(victim) + " is gone") != std::string::npos);
        CHECK(failure_seconds(texts[rank]) < 10.0);  // the 5 s timeout, and the roll call
      }
    };
    survivors_name_it("ZeRO-3", kill_the_last_rank(accel::ZeRO<3>{}, 2));
    survivors_name_it("ZeRO-2 offload", kill_the_last_rank(accel::ZeRO<2>{.cpu_offload = true}, 2));
    survivors_name_it("HybridShard 2x2", kill_the_last_rank(accel::HybridShard{.shard_group_size = 2}, 4));
    survivors_name_it("tensor 2", kill_the_last_rank(accel::Parallel<>{.tensor = 2}, 2));
    survivors_name_it("pipeline 2", kill_the_last_rank(accel::Parallel<>{.pipeline = 2, .micro_batches = 2}, 2));
    survivors_name_it("data 2 x tensor 2 (ZeRO-1)", kill_the_last_rank(accel::Parallel<accel::ZeRO<1>>{.tensor = 2}, 4));
  }

  TEST_CASE("memory under Parallel<>: model_state_bytes follows the slice's formula, and between steps a rank holds "
            "exactly that at the allocator (tensor 2, data 2 x tensor 2 with ZeRO-1 and ZeRO-3, pipeline 2)") {
    // By hand: ColumnParallelLinear(64 -> 512) keeps a 256 x 64 weight and 256 biases per tensor rank,
    // RowParallelLinear(512 -> 10) a 10 x 256 weight and the 10 biases whole: P_t = 19,210 elements.
    const std::int64_t Pt = 256 * 64 + 256 + 10 * 256 + 10;
    auto check = [](int world, auto settings, const std::string& name, auto expected_of) {
      accel::spawn(world, [&](int rank) {
        const auto held = held_between_steps(settings);
        const accel::ModelStateBytes expected = expected_of(rank);
        auto text = [](const accel::ModelStateBytes& m) {
          return std::to_string(m.parameters) + " + " + std::to_string(m.gradients) + " + " + std::to_string(m.optimizer_state);
        };
        if (rank == 0)
          std::printf("memory %-26s model_state_bytes %s, formula %s, held between steps %lld\n", name.c_str(),
                      text(held.state).c_str(), text(expected).c_str(), static_cast<long long>(held.live));
        require(held.state == expected, name + ", rank " + std::to_string(rank) + ": model_state_bytes " + text(held.state) +
                                            ", formula " + text(expected));
        const std::int64_t kept = held.state.total() + held.buffers;
        require(held.live >= kept && held.live - kept <= 4096,
                name + ": " + std::to_string(held.live) + " bytes held between steps, model state " +
                    std::to_string(held.state.total()) + ", idle step buffers " + std::to_string(held.buffers));
      }, bounded(120s));
    };
    auto bytes = [](std::int64_t params, std::int64_t grads, std::int64_t state) {
      return [=](int) {
        accel::ModelStateBytes m;
        m.parameters = 4 * params;
        m.gradients = 4 * grads;
        m.optimizer_state = 4 * state;
        return m;
      };
    };
    check(2, accel::Parallel<>{.tensor = 2}, "tensor 2", bytes(Pt, Pt, Pt));
    // ZeRO over the data group of 2: the momentum (ZeRO-1), or everything (ZeRO-3), halved.
    check(4, accel::Parallel<accel::ZeRO<1>>{.tensor = 2}, "data 2 x tensor 2 (ZeRO-1)", bytes(Pt, Pt, Pt / 2));
    check(4, accel::Parallel<accel::ZeRO<3>>{.tensor = 2}, "data 2 x tensor 2 (ZeRO-3)", bytes(Pt / 2, Pt / 2, Pt / 2));
    // Pipeline 2 over Linear(64, 512), Tanh, Linear(512, 512), Tanh, Linear(512, 10): each stage's
    // gradients and momentum; the parameters of the model the rank built, both stages'.
    // Stage 0 is layers [0, 2), stage 1 layers [2, 5).
    const std::int64_t first = 64 * 512 + 512, second = 512 * 512 + 512 + 512 * 10 + 10;
    check(2, accel::Parallel<>{.pipeline = 2, .micro_batches = 2}, "pipeline 2", [&](int rank) {
      return bytes(first + second, rank == 0 ? first : second, rank == 0 ? first : second)(rank);
    });
  }
}
