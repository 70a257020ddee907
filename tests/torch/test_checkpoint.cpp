// save_state / load_state: exact resume, resharding to other world sizes,
// atomic commit under SIGKILL, and clear rejection of bad checkpoints.
#include <ATen/ops/arange.h>
#include <ATen/ops/randn_like.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/optim/schedulers/step_lr.h>

#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <thread>
#include <type_traits>

#include "accel/checkpoint/sharded.hpp"
#include "accel/device/allocation_counter.hpp"
#include "accel/nn/tensor_parallel.hpp"
#include "doctest_torch.hpp"

using namespace accel::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

accel::data::TensorDataset dataset(std::int64_t n) {
  auto batch = global_batch(12345, n);
  return {batch.x, batch.y};
}

// Trains until `stop` optimizer steps (or the end of `epochs`), starting
// wherever the loader is (after load_state: mid-epoch). Random noise on the
// inputs makes the result depend on the RNG state too.
template <class Trainer, class Loader>
void train_until(Trainer& trainer, torch::nn::Sequential& net, Loader& loader, std::int64_t stop, int epochs = 3) {
  for (auto epoch = loader.epoch(); epoch < epochs; ++epoch) {
    loader.set_epoch(epoch);
    for (auto batch : loader) {
      trainer.step([&] { return loss_of(net, batch.data + 0.01 * at::randn_like(batch.data), batch.target); });
      if (trainer.completed_steps() == stop) return;
    }
  }
}

// Parameters and Adam state bitwise equal (the state of whatever the
// optimizer steps: the parameters, or under ZeRO this rank's shards).
void require_identical(torch::nn::Sequential& a, torch::optim::Adam& oa, torch::nn::Sequential& b,
                       torch::optim::Adam& ob) {
  auto pa = a->parameters(), pb = b->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) require(pa[i].equal(pb[i]), "parameter " + std::to_string(i) + " bitwise equal");
  for (std::size_t g = 0; g < oa.param_groups().size(); ++g) {
    const auto& qa = oa.param_groups()[g].params();
    const auto& qb = ob.param_groups()[g].params();
    require(qa.size() == qb.size() && !qa.empty(), "same optimizer layout");
    for (std::size_t j = 0; j < qa.size(); ++j) {
      auto ia = oa.state().find(accel::compat::optimizer_state_key(oa, qa[j]));
      auto ib = ob.state().find(accel::compat::optimizer_state_key(ob, qb[j]));
      require((ia == oa.state().end()) == (ib == ob.state().end()), "Adam state for the same parameters");
      if (ia == oa.state().end()) continue;  // never stepped here (another pipeline stage's)
      auto& sa = static_cast<torch::optim::AdamParamState&>(*ia->second);
      auto& sb = static_cast<torch::optim::AdamParamState&>(*ib->second);
      require(sa.step() == sb.step(), "Adam step count");
      require(sa.exp_avg().equal(sb.exp_avg()) && sa.exp_avg_sq().equal(sb.exp_avg_sq()), "Adam moments bitwise equal");
    }
  }
}

// The same run, interrupted after `k` steps and resumed from its checkpoint,
// against one uninterrupted run to `n` steps.
template <class Strategy>
void interrupted_equals_uninterrupted(const fs::path& dir, std::int64_t k, std::int64_t n, Strategy strategy = {}) {
  auto run = [&](std::int64_t stop, bool resume) {
    accel::Trainer<Strategy> trainer(strategy);
    trainer.set_seed(1);
    auto net = tiny_mlp(0);
    auto opt = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2));
    trainer.prepare(net, *opt);
    auto loader = trainer.prepare(dataset(50), {.batch_size = 4, .shuffle = true, .seed = 9});
    if (resume) trainer.load_state(dir);
    train_until(trainer, net, loader, stop);
    if (!resume) trainer.save_state(dir);
    return std::make_pair(net, opt);
  };
  run(k, false);  // stops after step k and saves
  auto [resumed, resumed_opt] = run(n, true);
  auto [straight, straight_opt] = run(n, false);
  require_identical(resumed, *resumed_opt, straight, *straight_opt);
}

// ZeRO-3 with units of at least 50 parameters (tiny_mlp: three) whose
// checkpoints hold the model as `type` says.
accel::ZeRO<3> zero3_saving(accel::StateDictType type) {
  return {.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 50, .state_dict_type = type};
}
constexpr auto sharded_state = accel::StateDictType::SHARDED_STATE_DICT;
constexpr auto full_state = accel::StateDictType::FULL_STATE_DICT;

// The largest element-wise distance between two lists of tensors.
double max_distance(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

// `net`, saved after step k on `saved` ranks and resumed to step n on
// `world` (b samples per rank), against one process on the same global
// batches; the companion: the resumed steps moved it far beyond the bound.
void require_matches_one_process(torch::nn::Sequential& net, int saved, int world, std::int64_t b, std::int64_t k,
                                 std::int64_t n) {
  auto reference = tiny_mlp(0);
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<at::Tensor> at_k;  // the reference when the checkpoint was saved
  for (std::int64_t step = 0; step < n; ++step) {
    if (step == k)
      for (const auto& p : reference->parameters()) at_k.push_back(p.detach().clone());
    auto batch = global_batch(step, b * (step < k ? saved : world));
    ref_opt.zero_grad();
    loss_of(reference, batch.x, batch.y).backward();
    ref_opt.step();
  }
  const double moved = max_distance(net->parameters(), at_k);
  require(moved > 1e-3, "the resumed steps moved the model " + sci(moved) + ": the bound could not fail");
  const double diff = max_param_diff(*net, *reference);
  // measured (1.13, Adam): 3.0e-8 to 4.5e-8
  require(diff < 3e-7, "resumed on " + std::to_string(world) + " ranks: " + sci(diff));
}

// Rank `rank` of `world` trains steps [0, k) of b samples each under
// Trainer<Strategy>(settings) and saves to `dir`; then `after` runs.
template <class Strategy>
void train_and_save(const fs::path& dir, const Strategy& settings, int rank, int world, std::int64_t b, std::int64_t k,
                    const std::type_identity_t<std::function<void(accel::Trainer<Strategy>&, torch::nn::Sequential&)>>&
                        after = {}) {
  accel::Trainer<Strategy> trainer(settings);
  auto net = tiny_mlp(0);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  trainer.prepare(net, opt);
  for (std::int64_t step = 0; step < k; ++step) {
    auto batch = global_batch(step, b * world);
    trainer.step([&] { return loss_of(net, batch.x.narrow(0, rank * b, b), batch.y.narrow(0, rank * b, b)); });
  }
  trainer.save_state(dir);
  if (after) after(trainer, net);
}

// Rank `rank` of `world` resumes under ZeRO-3 (`settings`) a checkpoint saved
// after step k by `saved` ranks (b samples each), trains to step n, and must
// match one process on the same global batches; the companion: the resumed
// steps moved the model far beyond the bound.
void zero3_resume_matches_one_process(const fs::path& dir, const accel::ZeRO<3>& settings, int rank, int world,
                                      int saved, std::int64_t b, std::int64_t k, std::int64_t n) {
  accel::Trainer<accel::ZeRO<3>> trainer(settings);
  auto net = tiny_mlp(0);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  trainer.prepare(net, opt);
  trainer.load_state(dir);
  for (std::int64_t step = k; step < n; ++step) {
    auto batch = global_batch(step, b * world);
    trainer.step([&] { return loss_of(net, batch.x.narrow(0, rank * b, b), batch.y.narrow(0, rank * b, b)); });
  }
  trainer.unwrap_model();
  require_matches_one_process(net, saved, world, b, k, n);
}

// A data-parallel strategy with small buckets (several per model), with
// cpu_offload when `Offload`: the resharding test's cases.
template <class Strategy, bool Offload = false>
struct Resharded {
  using strategy = Strategy;
  static Strategy make() {
    Strategy s{.bucket_cap_mb = 0.0002, .first_bucket_cap_mb = 0.0002};
    if constexpr (Offload) s.cpu_offload = true;
    return s;
  }
};

// A model cut by tensor parallelism (and, with a pipeline, into 2 stages of 3
// modules each): column / row parallel pairs around Tanh, from full layers
// seeded alike on every rank.
const std::vector<std::pair<int, int>> mlp_shapes{{8, 16}, {16, 8}, {8, 16}, {16, 4}};

torch::nn::Sequential tensor_parallel_mlp(accel::comm::Communicator& tp) {
  auto full = full_layers(mlp_shapes);
  return torch::nn::Sequential(accel::nn::ColumnParallelLinear(full[0], tp), torch::nn::Tanh(),
                               accel::nn::RowParallelLinear(full[1], tp), accel::nn::ColumnParallelLinear(full[2], tp),
                               torch::nn::Tanh(), accel::nn::RowParallelLinear(full[3], tp));
}

at::Tensor cross_entropy(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

// interrupted_equals_uninterrupted for Parallel<Data>: the batch form of
// step (which runs the pipeline's schedule when there is one).
template <class Data>
void parallel_interrupted_equals_uninterrupted(const fs::path& dir, accel::Parallel<Data> settings, std::int64_t k,
                                               std::int64_t n) {
  auto run = [&](std::int64_t stop, bool resume) {
    accel::Trainer<accel::Parallel<Data>> trainer(settings);
    trainer.set_seed(1);
    auto net = tensor_parallel_mlp(trainer.tensor_group());
    auto opt = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2));
    trainer.prepare(net, *opt);
    auto loader = trainer.prepare(dataset(48), {.batch_size = 4, .shuffle = true, .seed = 9});
    if (resume) trainer.load_state(dir);
    for (auto epoch = loader.epoch(); epoch < 3 && trainer.completed_steps() < stop; ++epoch) {
      loader.set_epoch(epoch);
      for (auto batch : loader) {
        trainer.step(batch.data + 0.01 * at::randn_like(batch.data), batch.target, cross_entropy);
        if (trainer.completed_steps() == stop) break;
      }
    }
    if (!resume) trainer.save_state(dir);
    trainer.unwrap_model();  // ZeRO-3's parameters whole again
    if (settings.tensor > 1) {
      // The tensor ranks' slices differ: a checkpoint that gave every rank
      // rank 0's part would fail the comparison below.
      auto slices = trainer.tensor_group().all_gather(net->parameters()[0].detach().contiguous(), "test gather");
      require(!slices[0].equal(slices[1]), "tensor ranks hold different slices");
    }
    return std::make_pair(net, opt);
  };
  run(k, false);
  auto [resumed, resumed_opt] = run(n, true);
  auto [straight, straight_opt] = run(n, false);
  require_identical(resumed, *resumed_opt, straight, *straight_opt);
}

// On `world` ranks, a Trainer<Settings> with the tensor-parallel MLP must
// refuse to load `dir`, saying `expected`.
template <class Settings>
void load_refused(int world, const fs::path& dir, Settings settings, const std::string& expected) {
  accel::spawn(
      world,
      [&](int) {
        accel::Trainer<Settings> trainer(settings);
        auto net = tensor_parallel_mlp(trainer.tensor_group());
        torch::optim::Adam opt(net->parameters());
        trainer.prepare(net, opt);
        try {
          trainer.load_state(dir);
        } catch (const accel::checkpoint::CheckpointError& e) {
          require(std::string(e.what()).find(expected) != std::string::npos, e.what());
          return;
        }
        require(false, "must refuse: " + expected);
      },
      bounded(120s));
}

}  // namespace

TEST_SUITE("checkpoint") {
  TEST_CASE("exact resume, one process: interrupted after step k, resumed to n, bitwise equal to an "
            "uninterrupted run (model, Adam state, data order, RNG)") {
    const auto dir = fresh_dir("single");
    RemoveOnExit cleanup{dir};
    accel::spawn(1, [&](int) { interrupted_equals_uninterrupted<accel::SingleProcess>(dir, 5, 20); }, bounded(120s));
  }

  TEST_CASE("exact resume, 2-rank DDP: bitwise equal to an uninterrupted run") {
    const auto dir = fresh_dir("ddp");
    RemoveOnExit cleanup{dir};
    accel::spawn(2, [&](int) { interrupted_equals_uninterrupted<accel::DDP>(dir, 5, 12); }, bounded(120s));
  }

  TEST_CASE("exact resume, 2-rank ZeRO-2 and ZeRO-3 (sharded state): bitwise equal to an uninterrupted run") {
    const auto dir = fresh_dir("zero");
    RemoveOnExit cleanup{dir};
    accel::spawn(2, [&](int) { interrupted_equals_uninterrupted<accel::ZeRO<2>>(dir, 5, 12); }, bounded(120s));
    fs::remove_all(dir);
    accel::spawn(2, [&](int) { interrupted_equals_uninterrupted<accel::ZeRO<3>>(dir, 5, 12); }, bounded(120s));
  }

  TEST_CASE("exact resume under cpu_offload, 2-rank ZeRO-1 and ZeRO-3: the host twins take over the loaded "
            "parameters; bitwise equal to an uninterrupted run") {
    const auto dir = fresh_dir("offload");
    RemoveOnExit cleanup{dir};
    accel::spawn(2, [&](int) { interrupted_equals_uninterrupted(dir, 5, 12, accel::ZeRO<1>{.cpu_offload = true}); },
                 bounded(120s));
    fs::remove_all(dir);
    accel::spawn(2, [&](int) { interrupted_equals_uninterrupted(dir, 5, 12, accel::ZeRO<3>{.cpu_offload = true}); },
                 bounded(120s));
  }

  TEST_CASE_TEMPLATE("a checkpoint saved on 2 ranks resumes on 1 and on 3 ranks and matches the reference", Case,
                     Resharded<accel::DDP>, Resharded<accel::ZeRO<1>>, Resharded<accel::ZeRO<2>>,
                     Resharded<accel::ZeRO<3>>, Resharded<accel::ZeRO<3>, true>) {
    using Strategy = typename Case::strategy;
    // Per-rank batch b; steps 0..k-1 on 2 ranks, then k..n-1 on M ranks. The
    // reference is one process on the same sequence of global batches. Under
    // ZeRO the Adam state is resharded from 2 shards to M.
    const std::int64_t b = 4, k = 3, n = 6;
    const auto dir = fresh_dir("reshard");
    RemoveOnExit cleanup{dir};
    auto train = [&](int rank, int world, std::int64_t from, std::int64_t to, bool load, bool save) {
      accel::Trainer<Strategy> trainer(Case::make());
      auto net = tiny_mlp(0);
      torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
      trainer.prepare(net, opt);
      if (load) trainer.load_state(dir);
      for (auto step = from; step < to; ++step) {
        auto batch = global_batch(step, b * world);
        trainer.step([&] { return loss_of(net, batch.x.narrow(0, rank * b, b), batch.y.narrow(0, rank * b, b)); });
      }
      if (save) trainer.save_state(dir);
      return net;
    };
    accel::spawn(2, [&](int rank) { train(rank, 2, 0, k, false, true); }, bounded(120s));
    for (int world : {1, 3}) {
      CAPTURE(world);
      accel::spawn(
          world,
          [&](int rank) {
            auto net = train(rank, world, k, n, true, false);
            require_matches_one_process(net, 2, world, b, k, n);
          },
          bounded(120s));
    }
  }

  TEST_CASE("a checkpoint saved mid-epoch on 2 ranks resumes its loader on 1 and on 3 ranks: every sample of the "
            "epoch is read once, before or after") {
    // 24 numbered samples, batch 2 per rank, shuffled: 2 ranks read 3 batches
    // each (12 samples) and save; the loader resumes after the 12 samples the
    // job had read, however many ranks read on.
    const auto dir = fresh_dir("reshard_loader");
    RemoveOnExit cleanup{dir};
    const std::int64_t n = 24;
    auto numbered = [&] { return accel::data::TensorDataset(at::arange(n).unsqueeze(1).to(at::kFloat), at::arange(n)); };
    const std::string before_file = temp_path("reshard_loader_before");
    auto run = [&](int world, bool resume, const std::string& record) {
      accel::spawn(
          world,
          [&](int) {
            accel::Trainer<accel::DDP> trainer;
            auto net = torch::nn::Sequential(torch::nn::Linear(1, 1));
            torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
            trainer.prepare(net, opt);
            auto loader = trainer.prepare(numbered(), {.batch_size = 2, .shuffle = true, .seed = 5});
            if (resume) trainer.load_state(dir);
            std::vector<std::int64_t> read;
            int batches = 0;
            for (auto batch : loader) {
              for (std::int64_t i = 0; i < batch.target.size(0); ++i) read.push_back(batch.target[i].item<std::int64_t>());
              trainer.step([&] { return (net->forward(batch.data).squeeze(1) - batch.target.to(at::kFloat)).pow(2).mean(); });
              if (!resume && ++batches == 3) break;
            }
            if (!resume) trainer.save_state(dir);
            const std::vector<std::int64_t> all = trainer.gather_object(read);  // the ranks' lists, concatenated
            if (trainer.is_main_process()) {
              std::ofstream out(record);
              for (auto i : all) out << i << "\n";
            }
          },
          bounded(120s));
    };
    auto samples = [](const std::string& file) {
      std::vector<std::int64_t> out;
      std::ifstream in(file);
      for (std::int64_t i; in >> i;) out.push_back(i);
      return out;
    };
    run(2, false, before_file);
    const auto before = samples(before_file);
    REQUIRE(before.size() == 12);
    for (int world : {1, 3}) {
      CAPTURE(world);
      const std::string after_file = temp_path("reshard_loader_after");
      run(world, true, after_file);
      auto all = samples(after_file);
      CHECK(all.size() == 12);
      all.insert(all.end(), before.begin(), before.end());
      std::sort(all.begin(), all.end());
      std::vector<std::int64_t> expected(n);
      std::iota(expected.begin(), expected.end(), 0);
      CHECK(all == expected);  // none skipped, none read twice
      std::filesystem::remove(after_file);
    }
    std::filesystem::remove(before_file);
  }

  TEST_CASE("a HybridShard checkpoint from 4 ranks (2 groups of 2) resumes under ZeRO-3 on 2 and on 3 ranks") {
    const std::int64_t b = 2, k = 3, n = 5;
    const auto dir = fresh_dir("hybrid");
    RemoveOnExit cleanup{dir};
    accel::spawn(4, [&](int rank) { train_and_save(dir, accel::HybridShard{.shard_group_size = 2}, rank, 4, b, k); },
                 bounded(120s));
    for (int world : {2, 3}) {
      CAPTURE(world);
      accel::spawn(world, [&](int rank) { zero3_resume_matches_one_process(dir, {}, rank, world, 4, b, k, n); },
                   bounded(120s));
    }
  }

  TEST_CASE("a save killed midway leaves the previous checkpoint loadable and the broken one rejected; also when "
            "it was overwriting that checkpoint") {
    for (const bool overwrite : {false, true}) {
      // Overwriting: the second save targets the first's directory, and writes into <dir>.staging.
      CAPTURE(overwrite);
      const auto first = fresh_dir("good"), marker = fresh_dir("marker");
      const auto second = overwrite ? first : fresh_dir("killed");
      const auto written = overwrite ? fs::path(first.string() + ".staging") : second;  // where the killed save writes
      RemoveOnExit cleanup{first, second, marker, written};
      auto make_big = [] {
        at::manual_seed(3);
        return torch::nn::Sequential(torch::nn::Linear(2048, 2048), torch::nn::Linear(2048, 2048),
                                     torch::nn::Linear(2048, 2048));
      };
      // What the first save holds: make_big after one Adam step on x (drawn after the initialisation).
      auto first_step = [](accel::Trainer<>& trainer, torch::nn::Sequential& net, torch::optim::Adam& opt) {
        trainer.prepare(net, opt);
        auto x = at::randn({2, 2048});
        trainer.step([&] { return net->forward(x).sum(); });
        return x;
      };
      std::fflush(nullptr);
      const pid_t child = ::fork();
      REQUIRE(child >= 0);
      if (child == 0) {
        accel::launch::become_supervised_child();
        accel::Trainer<> trainer;
        auto net = make_big();
        torch::optim::Adam opt(net->parameters());
        auto x = first_step(trainer, net, opt);
        trainer.save_state(first);
        std::ofstream(marker) << "first saved";
        trainer.step([&] { return net->forward(x).sum(); });
        trainer.save_state(second);  // killed while writing this
        ::_exit(0);
      }
      // Kill the child as soon as the second save has started writing (the
      // optimizer's 100 MB of state come first, written in place; the model
      // file appears only whole, renamed from model_0.safetensors.partial).
      bool killed = false;
      for (int i = 0; i < 6000 && !killed; ++i) {
        if (fs::exists(marker) && fs::exists(written / "optimizer.pt")) {
          ::kill(child, SIGKILL);
          killed = true;
        } else {
          std::this_thread::sleep_for(5ms);
        }
      }
      if (!killed) ::kill(child, SIGKILL);
      int status = 0;
      ::waitpid(child, &status, 0);
      REQUIRE(killed);
      REQUIRE_MESSAGE(!fs::exists(written / "manifest.json"), "the save finished before the kill: the test proved nothing");

      accel::Trainer<> trainer;
      auto net = make_big();
      torch::optim::Adam opt(net->parameters());
      trainer.prepare(net, opt);
      CHECK_THROWS_WITH_AS(trainer.load_state(written), doctest::Contains("is incomplete: it has no manifest.json"),
                           accel::checkpoint::CheckpointError);
      CHECK_NOTHROW(trainer.load_state(first));
      // What came back is the first save's model, recomputed here.
      accel::Trainer<> replay;
      auto expected = make_big();
      torch::optim::Adam expected_opt(expected->parameters());
      first_step(replay, expected, expected_opt);
      CHECK(max_param_diff(*net, *expected) == 0.0);
    }
  }

  TEST_CASE("a ZeRO-3 checkpoint from 2 ranks exports as model.safetensors, or one LibTorch file, that a plain model "
            "loads; a checkpoint an older accel wrote (model_0.pt) loads and exports too") {
    const auto dir = fresh_dir("export"), out = fresh_dir("exported"), out_archive = fresh_dir("export.pt");
    const auto expected = fresh_dir("expected.pt");
    RemoveOnExit cleanup{dir, out, out_archive, expected};
    accel::spawn(
        2,
        [&](int rank) {
          accel::Trainer<accel::ZeRO<3>> trainer(accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP,
                                                                 .min_num_params = 50});
          auto net = tiny_mlp(0);
          torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
          trainer.prepare(net, opt);
          for (int step = 0; step < 3; ++step) {
            auto batch = global_batch(step, 8);
            trainer.step([&] { return loss_of(net, batch.x.narrow(0, rank * 4, 4), batch.y.narrow(0, rank * 4, 4)); });
          }
          trainer.save_state(dir);
          trainer.unwrap_model();  // the whole model on every rank: the expected export
          if (rank == 0) torch::save(net, expected.string());
        },
        bounded(120s));
    CHECK(fs::exists(dir / "model_0.safetensors"));
    accel::checkpoint::export_model(dir, out);  // a copy: the checkpoint holds safetensors
    auto plain = tiny_mlp(7), reference = tiny_mlp(8), archived = tiny_mlp(6);
    accel::load_safetensors(*plain, out / "model.safetensors");
    torch::load(reference, expected.string());
    CHECK(max_param_diff(*plain, *reference) == 0.0);
    accel::checkpoint::consolidate_model(dir, out_archive, 0, /*safe_serialization=*/false);  // converted
    torch::load(archived, out_archive.string());
    CHECK(max_param_diff(*archived, *reference) == 0.0);
    CHECK_THROWS_WITH(accel::checkpoint::export_model(dir, out_archive, 0, false),
                      doctest::Contains("holds model_0.safetensors; writing it as a LibTorch archive converts it"));
    // Independent of the code under test: one process, a plain LibTorch loop
    // on the global batches. Measured 3e-8 apart (the ZeRO bound, 3e-7); the
    // model moved 1e-2 from where it started, so a stale export would fail.
    auto single = tiny_mlp(0), untrained = tiny_mlp(0);
    torch::optim::Adam single_opt(single->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      auto batch = global_batch(step, 8);
      single_opt.zero_grad();
      loss_of(single, batch.x, batch.y).backward();
      single_opt.step();
    }
    CHECK(max_param_diff(*plain, *single) < 3e-7);
    CHECK(max_param_diff(*plain, *untrained) > 1e-3);
    CHECK_THROWS_WITH(accel::checkpoint::export_model(dir, out, 3), doctest::Contains("there is no model 3"));

    // As an accel before safetensors wrote it: model_0.pt, the manifest without the model's structure.
    fs::remove(dir / "model_0.safetensors");
    torch::save(reference, (dir / "model_0.pt").string());
    auto manifest = nlohmann::json::parse(read_file((dir / "manifest.json").string()));
    manifest["files"].erase("model_0.safetensors");
    manifest["files"]["model_0.pt"] = fs::file_size(dir / "model_0.pt");
    manifest.erase("model_structure");
    std::ofstream(dir / "manifest.json") << manifest.dump();
    accel::spawn(
        2,
        [&](int) {
          accel::Trainer<accel::ZeRO<3>> trainer(accel::ZeRO<3>{
              .auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 50});
          auto net = tiny_mlp(5);
          torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
          trainer.prepare(net, opt);
          trainer.load_state(dir);
          trainer.unwrap_model();
          require(max_param_diff(*net, *reference) == 0.0, "the older checkpoint's model loaded");
        },
        bounded(120s));
    fs::remove_all(out);
    accel::checkpoint::consolidate_model(dir, out);  // converted from the archive
    auto converted = tiny_mlp(4);
    accel::load_safetensors(*converted, out);
    CHECK(max_param_diff(*converted, *reference) == 0.0);
    CHECK_THROWS_WITH(accel::checkpoint::export_model(dir, out), doctest::Contains("holds model_0.pt; writing it as "
                                                                                   "safetensors converts it"));
  }

  TEST_CASE("bad checkpoints are rejected with what is wrong") {
    const auto dir = fresh_dir("bad");
    RemoveOnExit cleanup{dir};
    {
      accel::Trainer<> trainer;
      auto net = tiny_mlp(0);
      torch::optim::Adam opt(net->parameters());
      trainer.prepare(net, opt);
      trainer.save_state(dir);
    }
    SUBCASE("a model of another shape names the parameter") {
      accel::Trainer<> trainer;
      auto net = tiny_mlp(0, 8, 32);
      torch::optim::Adam opt(net->parameters());
      trainer.prepare(net, opt);
      CHECK_THROWS_WITH(trainer.load_state(dir), doctest::Contains("parameter '0.weight' has shape [16,8]"));
    }
    SUBCASE("a truncated file is reported as corrupt") {
      fs::resize_file(dir / "optimizer.pt", 10);
      accel::Trainer<> trainer;
      auto net = tiny_mlp(0);
      torch::optim::Adam opt(net->parameters());
      trainer.prepare(net, opt);
      CHECK_THROWS_WITH(trainer.load_state(dir), doctest::Contains("is corrupt: optimizer.pt has 10 bytes"));
    }
    SUBCASE("DDP state cannot be loaded into a sharded strategy") {
      accel::spawn(
          1,
          [&](int) {
            accel::Trainer<accel::ZeRO<1>> trainer;
            auto net = tiny_mlp(0);
            torch::optim::Adam opt(net->parameters());
            trainer.prepare(net, opt);
            try {
              trainer.load_state(dir);
            } catch (const accel::checkpoint::CheckpointError& e) {
              require(std::string(e.what()).find("unsharded (DDP) optimizer state") != std::string::npos, e.what());
              return;
            }
            require(false, "must refuse");
          },
          bounded(120s));
    }
    SUBCASE("a directory that is not there") {
      accel::Trainer<> trainer;
      CHECK_THROWS_WITH(trainer.load_state(dir / "nope"), doctest::Contains("does not exist"));
    }
  }

  TEST_CASE("save_state() names checkpoints and keeps the newest total_limit; registered objects come back") {
    const auto project = fresh_dir("project");
    RemoveOnExit cleanup{project};
    accel::Trainer<> trainer(accel::TrainerOptions{.project_dir = project, .total_limit = 2});
    auto net = tiny_mlp(0);
    torch::optim::Adam opt(net->parameters());
    torch::optim::StepLR scheduler(opt, 1, 0.5);
    auto extra = torch::nn::Linear(3, 3);
    trainer.prepare(net, opt, scheduler);
    trainer.register_for_checkpointing(*extra);
    const auto saved_weight = extra->weight.detach().clone();
    fs::path last;
    for (int i = 0; i < 3; ++i) {
      auto batch = global_batch(i, 4);
      trainer.step([&] { return loss_of(net, batch.x, batch.y); });
      last = trainer.save_state();
    }
    CHECK(last.filename() == "checkpoint_2");
    CHECK_FALSE(fs::exists(project / "checkpoints" / "checkpoint_0"));
    CHECK(fs::exists(project / "checkpoints" / "checkpoint_1" / "manifest.json"));
    {
      c10::NoGradGuard no_grad;
      extra->weight.zero_();
    }
    // A fresh trainer: the scheduler's 3 steps and the registered module return.
    accel::Trainer<> resumed;
    auto net2 = tiny_mlp(5);
    torch::optim::Adam opt2(net2->parameters());
    torch::optim::StepLR scheduler2(opt2, 1, 0.5);
    resumed.prepare(net2, opt2, scheduler2);
    resumed.register_for_checkpointing(*extra);
    resumed.load_state(last);
    CHECK(extra->weight.equal(saved_weight));
    CHECK(resumed.completed_steps() == 3);
    CHECK(opt2.param_groups()[0].options().get_lr() == opt.param_groups()[0].options().get_lr());
    CHECK(opt2.param_groups()[0].options().get_lr() < 1e-3);  // the schedule did decay
    CHECK(max_param_diff(*net, *net2) == 0.0);
  }

  TEST_CASE("exact resume, 4-rank HybridShard (2 groups of 2) resumed as HybridShard: bitwise equal") {
    const auto dir = fresh_dir("hybrid_resume");
    RemoveOnExit cleanup{dir};
    accel::spawn(4, [&](int) { interrupted_equals_uninterrupted(dir, 5, 9, accel::HybridShard{.shard_group_size = 2}); },
                 bounded(180s));
  }

  TEST_CASE("exact resume under Parallel<>: tensor 2 and pipeline 2 on 2 ranks, bitwise equal; each rank's part "
            "comes back") {
    const auto dir = fresh_dir("parallel");
    RemoveOnExit cleanup{dir};
    accel::spawn(2, [&](int) { parallel_interrupted_equals_uninterrupted<accel::DDP>(dir, {.tensor = 2}, 4, 9); },
                 bounded(120s));
    CHECK(fs::exists(dir / "model_0_part_1.safetensors"));
    CHECK_THROWS_WITH(accel::checkpoint::export_model(dir, dir / "whole.pt"),
                      doctest::Contains("holds the model cut into 2 parts (tensor 2 x pipeline 1)"));
    fs::remove_all(dir);
    accel::spawn(
        2,
        [&](int) {
          parallel_interrupted_equals_uninterrupted<accel::DDP>(dir, {.pipeline = 2, .micro_batches = 2}, 4, 9);
        },
        bounded(120s));
  }

  TEST_CASE("load_latest_state: nothing on a fresh start; then the newest complete checkpoint, an interrupted save "
            "passed over, the same on every rank") {
    const auto dir = fresh_dir("latest");
    RemoveOnExit cleanup{dir};
    accel::spawn(
        2,
        [&](int rank) {
          auto train = [&](accel::Trainer<accel::DDP>& trainer, torch::nn::Sequential& net, int steps) {
            for (int step = 0; step < steps; ++step) {
              auto batch = global_batch(step, 8);
              trainer.step([&] { return loss_of(net, batch.x.narrow(0, rank * 4, 4), batch.y.narrow(0, rank * 4, 4)); });
              trainer.save_state();  // checkpoint_<step>, after step + 1 steps
            }
          };
          {
            accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.project_dir = dir});
            auto net = tiny_mlp(0);
            torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
            trainer.prepare(net, opt);
            require(!trainer.load_latest_state(), "a fresh start resumes from nothing");
            require(trainer.completed_steps() == 0, "and loads nothing");
            train(trainer, net, 3);
            trainer.wait_for_everyone();
            if (rank == 0) fs::remove(dir / "checkpoints" / "checkpoint_2" / "manifest.json");  // killed mid-save
            trainer.wait_for_everyone();
          }
          accel::Trainer<accel::DDP> trainer(accel::TrainerOptions{.project_dir = dir});
          auto net = tiny_mlp(1);  // other weights: the checkpoint's must replace them
          torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
          trainer.prepare(net, opt);
          const auto resumed = trainer.load_latest_state();
          require(resumed && *resumed == dir / "checkpoints" / "checkpoint_1", "resumed from checkpoint_1");
          require(trainer.completed_steps() == 2, "after 2 steps");
          auto saved = tiny_mlp(1);
          accel::load_safetensors(*saved, dir / "checkpoints" / "checkpoint_1" / "model_0.safetensors");
          require(max_param_diff(*net, *saved) == 0, "the checkpoint's weights");
        },
        bounded());
  }

  TEST_CASE("debug mode (ACCELERATE_DEBUG_MODE=true) raises no false mismatch and changes nothing: exact resume "
            "under DDP, ZeRO-1/2/3, offloaded ZeRO-3, HybridShard, Parallel<> tensor 2, pipeline 2 and data 2 x "
            "tensor 2, every collective checked") {
    ScopedEnv env;
    env.set("ACCELERATE_DEBUG_MODE", "true");  // the forked ranks inherit it
    const auto dir = fresh_dir("debug_mode");
    RemoveOnExit cleanup{dir};
    auto checked = [](auto&& run) {
      return [run](int) {
        using accel::comm::Collective;
        const auto before = accel::comm::process_traffic();
        run();
        const auto sent = accel::comm::process_traffic() - before;
        // On in every rank (the Trainer reads it as the faults suite tests), and
        // sent: at least one check per step (3 + 3 + 6 steps), save and load.
        require(accel::launch::debug_mode(std::nullopt), "ACCELERATE_DEBUG_MODE reached the rank");
        require(sent.calls_of(Collective::all_gather) >= 12, "the checks were sent");
      };
    };
    accel::spawn(2, checked([&] { interrupted_equals_uninterrupted<accel::DDP>(dir, 3, 6); }), bounded(120s));
    fs::remove_all(dir);
    accel::spawn(2, checked([&] { interrupted_equals_uninterrupted<accel::ZeRO<2>>(dir, 3, 6); }), bounded(120s));
    fs::remove_all(dir);
    accel::spawn(2, checked([&] { interrupted_equals_uninterrupted<accel::ZeRO<3>>(dir, 3, 6); }), bounded(120s));
    fs::remove_all(dir);
    accel::spawn(2, checked([&] { interrupted_equals_uninterrupted<accel::ZeRO<1>>(dir, 3, 6); }), bounded(120s));
    fs::remove_all(dir);
    accel::spawn(2, checked([&] {
                   interrupted_equals_uninterrupted(dir, 3, 6, accel::ZeRO<3>{.cpu_offload = true});
                 }),
                 bounded(120s));
    fs::remove_all(dir);
    accel::spawn(4, checked([&] {
                   interrupted_equals_uninterrupted(dir, 3, 6, accel::HybridShard{.shard_group_size = 2});
                 }),
                 bounded(180s));
    fs::remove_all(dir);
    accel::spawn(4, checked([&] { parallel_interrupted_equals_uninterrupted<accel::ZeRO<2>>(dir, {.tensor = 2}, 3, 6); }),
                 bounded(180s));
    fs::remove_all(dir);
    accel::spawn(2, checked([&] { parallel_interrupted_equals_uninterrupted<accel::DDP>(dir, {.tensor = 2}, 3, 6); }),
                 bounded(120s));
    fs::remove_all(dir);
    accel::spawn(2, checked([&] {
                   parallel_interrupted_equals_uninterrupted<accel::DDP>(dir, {.pipeline = 2, .micro_batches = 2}, 3, 6);
                 }),
                 bounded(120s));
  }

  TEST_CASE_TEMPLATE("exact resume under Parallel<Data>, data 2 x tensor 2 on 4 ranks: bitwise equal", Data, accel::DDP,
                     accel::ZeRO<1>, accel::ZeRO<2>, accel::ZeRO<3>) {
    const auto dir = fresh_dir("parallel_data");
    RemoveOnExit cleanup{dir};
    accel::spawn(4, [&](int) { parallel_interrupted_equals_uninterrupted<Data>(dir, {.tensor = 2}, 3, 7); },
                 bounded(240s));
  }

  TEST_CASE("exact resume under Parallel<ZeRO<3>> with a pipeline: data 2 x pipeline 2 on 4 ranks, bitwise equal, "
            "saving whole and sharded") {
    const auto dir = fresh_dir("parallel_zero3_pipeline");
    RemoveOnExit cleanup{dir};
    for (const auto type : {full_state, sharded_state}) {
      fs::remove_all(dir);
      accel::spawn(4, [&](int) {
        parallel_interrupted_equals_uninterrupted<accel::ZeRO<3>>(
            dir, {.data = {.state_dict_type = type}, .pipeline = 2, .micro_batches = 2}, 3, 7);
      }, bounded(240s));
    }
    CHECK(fs::exists(dir / "model_0_part_1_shard_1.safetensors"));
    // A stage's shards are named within the stage: a trainer that would read
    // them into its whole model is refused rather than misplace them.
    load_refused(4, dir, accel::Parallel<accel::ZeRO<3>>{.pipeline = 2, .micro_batches = 2},
                 "holds each model part's shards (SHARDED_STATE_DICT)");
  }

  TEST_CASE("a Parallel<ZeRO<1>> checkpoint from data 2 x tensor 2 resumes on data 1 x tensor 2 (the optimizer "
            "state resharded) and matches one process") {
    const std::int64_t b = 4, k = 3, n = 6;  // per-data-rank batch b on 2 data ranks, then 2b on 1
    const auto dir = fresh_dir("parallel_reshard");
    RemoveOnExit cleanup{dir};
    auto train = [&](int world, std::int64_t from, std::int64_t to, bool load) {
      accel::Trainer<accel::Parallel<accel::ZeRO<1>>> trainer({.tensor = 2});
      const int data = world / 2, d = trainer.strategy_engine().mesh().coordinate(accel::comm::MeshDim::data);
      const std::int64_t per_rank = b * 2 / data;
      auto net = tensor_parallel_mlp(trainer.tensor_group());
      torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
      trainer.prepare(net, opt);
      if (load) trainer.load_state(dir);
      for (auto step = from; step < to; ++step) {
        auto batch = global_batch(step, b * 2);
        trainer.step(batch.x.narrow(0, d * per_rank, per_rank), batch.y.narrow(0, d * per_rank, per_rank), cross_entropy);
      }
      if (!load) trainer.save_state(dir);
      // (tensor-parallel weights, whole): column slices along dim 0, row slices along dim 1
      std::vector<at::Tensor> whole;
      auto params = net->named_parameters();
      for (const auto& name : {"0.weight", "2.weight", "3.weight", "5.weight"}) {
        const std::int64_t dim = name[0] == '0' || name[0] == '3' ? 0 : 1;
        whole.push_back(at::cat(trainer.tensor_group().all_gather(params[name].detach().contiguous(), "test"), dim));
      }
      return whole;
    };
    accel::spawn(4, [&](int) { train(4, 0, k, false); }, bounded(120s));
    accel::spawn(
        2,
        [&](int) {
          auto whole = train(2, k, n, true);
          auto full = full_layers(mlp_shapes);
          torch::nn::Sequential reference(full[0], torch::nn::Tanh(), full[1], full[2], torch::nn::Tanh(), full[3]);
          torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
          for (std::int64_t step = 0; step < n; ++step) {
            auto batch = global_batch(step, b * 2);
            ref_opt.zero_grad();
            cross_entropy(reference->forward(batch.x), batch.y).backward();
            ref_opt.step();
          }
          double diff = 0;
          for (int i = 0; i < 4; ++i) diff = std::max(diff, (whole[i] - full[i]->weight).abs().max().item<double>());
          // measured: 6.0e-8 (Adam, fp32, 6 steps)
          require(diff < 5e-7, "resumed on data 1 x tensor 2: " + sci(diff));
        },
        bounded(120s));
  }

  TEST_CASE("a checkpoint of a model cut one way is refused by a trainer that cuts it another, naming both") {
    const auto dir = fresh_dir("cut");
    RemoveOnExit cleanup{dir};
    accel::spawn(2, [&](int) { parallel_interrupted_equals_uninterrupted<accel::DDP>(dir, {.tensor = 2}, 1, 1); },
                 bounded(120s));
    load_refused(2, dir, accel::Parallel<>{.pipeline = 2, .micro_batches = 2},
            "holds the model cut as tensor 2 x pipeline 1 (2 part(s)), but this trainer cuts it as tensor 1 x "
            "pipeline 2 (2 part(s))");
    load_refused(2, dir, accel::DDP{}, "but this trainer cuts it as whole (1 part(s))");
  }

  TEST_CASE("SHARDED_STATE_DICT under ZeRO-3, cpu_offload, HybridShard 2x2 and data 2 x tensor 2: each rank writes "
            "its shard and the index, no whole model file; exact resume bitwise equal") {
    const auto dir = fresh_dir("sharded");
    RemoveOnExit cleanup{dir};
    auto files_are = [&](int shards, const std::string& stem) {
      for (int s = 0; s < shards; ++s) CHECK(fs::exists(dir / (stem + "_shard_" + std::to_string(s) + ".safetensors")));
      CHECK_FALSE(fs::exists(dir / (stem + "_shard_" + std::to_string(shards) + ".safetensors")));
      CHECK(fs::exists(dir / (stem + "_index.json")));
      CHECK_FALSE(fs::exists(dir / (stem + ".safetensors")));
    };
    accel::spawn(2, [&](int) { interrupted_equals_uninterrupted(dir, 5, 12, zero3_saving(sharded_state)); },
                 bounded(120s));
    files_are(2, "model_0");
    fs::remove_all(dir);
    auto offloaded = zero3_saving(sharded_state);
    offloaded.cpu_offload = true;
    accel::spawn(2, [&](int) { interrupted_equals_uninterrupted(dir, 5, 12, offloaded); }, bounded(120s));
    files_are(2, "model_0");
    fs::remove_all(dir);
    // The first group's two ranks write the shards; the replicas read them.
    accel::spawn(4, [&](int) {
      interrupted_equals_uninterrupted(dir, 5, 9, accel::HybridShard{.zero = zero3_saving(sharded_state), .shard_group_size = 2});
    }, bounded(180s));
    files_are(2, "model_0");
    fs::remove_all(dir);
    accel::spawn(4, [&](int) {
      parallel_interrupted_equals_uninterrupted<accel::ZeRO<3>>(dir, {.data = {.state_dict_type = sharded_state}, .tensor = 2}, 3, 7);
    }, bounded(240s));
    files_are(2, "model_0_part_0");
    files_are(2, "model_0_part_1");
  }

  TEST_CASE("a sharded ZeRO-3 checkpoint from 2 ranks resumes on 1 rank and on 3 (one saving whole, so the shards are "
            "read into the gathered model), by parameter name; merge-weights joins it into the model the ranks "
            "held") {
    const std::int64_t b = 4, k = 3, n = 6;
    const auto dir = fresh_dir("sharded_reshard"), out = fresh_dir("merged.pt"), expected = fresh_dir("held.pt");
    RemoveOnExit cleanup{dir, out, expected};
    accel::spawn(
        2,
        [&](int rank) {
          train_and_save(dir, zero3_saving(sharded_state), rank, 2, b, k, [&](auto& trainer, auto& net) {
            trainer.unwrap_model();  // the model whole on every rank: what the merge must give
            if (rank == 0) torch::save(net, expected.string());
          });
        },
        bounded(120s));
    // Offline, in this process: bitwise the model the ranks held, loadable by a plain model.
    accel::checkpoint::consolidate_model(dir, out, 0, /*safe_serialization=*/false);
    auto merged = tiny_mlp(7), held = tiny_mlp(8), untrained = tiny_mlp(0), merged_safe = tiny_mlp(6);
    torch::load(merged, out.string());
    torch::load(held, expected.string());
    CHECK(max_param_diff(*merged, *held) == 0.0);
    CHECK(max_param_diff(*merged, *untrained) > 1e-3);  // trained: a merge of stale shards would fail
    accel::checkpoint::consolidate_model(dir, out.string() + ".dir");  // safetensors, Accelerate's default
    accel::load_safetensors(*merged_safe, out.string() + ".dir/model.safetensors");
    CHECK(max_param_diff(*merged_safe, *held) == 0.0);
    fs::remove_all(out.string() + ".dir");
    // The library's export copies a whole model's file; a sharded one is pointed to the merge.
    CHECK_THROWS_WITH(accel::checkpoint::export_model(dir, out.string() + ".copied"),
                      doctest::Contains("holds its model as shards (SHARDED_STATE_DICT): join them with "
                                        "accel::checkpoint::consolidate_model"));
    if (const char* cli = std::getenv("ACCEL_CLI")) {  // the command line, as a user runs it
      for (const std::string command : {"merge-weights", "export"})
        for (const bool safe : {true, false}) {
          const std::string file = out.string() + "." + command;
          const int status = std::system((std::string(cli) + " " + command + " " + dir.string() + " " + file +
                                          (safe ? "" : " --unsafe_serialization") + " > /dev/null")
                                             .c_str());
          CHECK_MESSAGE(status == 0, "accel " << command << " exited with " << status);
          auto again = tiny_mlp(9);
          if (safe) accel::load_safetensors(*again, file);
          else torch::load(again, file);
          CHECK(max_param_diff(*again, *held) == 0.0);
          fs::remove_all(file);
        }
    } else {
      MESSAGE("ACCEL_CLI is not set (meson test sets it): accel merge-weights itself not run");
    }
    // As an accel before safetensors wrote it: the shards and the tensors kept
    // whole as LibTorch archives (.pt). They merge alike, and the resumes below read them.
    auto manifest = nlohmann::json::parse(read_file((dir / "manifest.json").string()));
    std::vector<fs::path> converted;
    for (const auto& item : fs::directory_iterator(dir))
      if (item.path().extension() == ".safetensors") converted.push_back(item.path());
    REQUIRE(converted.size() == 3);  // two shards and the whole tensors
    for (const auto& path : converted) {
      torch::serialize::OutputArchive archive;
      for (const auto& [key, tensor] : accel::safetensors::load_file(path)) archive.write(key, tensor.clone());
      const auto old = fs::path(path).replace_extension(".pt");
      archive.save_to(old.string());
      fs::remove(path);
      manifest["files"].erase(path.filename().string());
      manifest["files"][old.filename().string()] = fs::file_size(old);
    }
    std::ofstream(dir / "manifest.json") << manifest.dump();
    accel::checkpoint::consolidate_model(dir, out.string() + ".old");
    accel::load_safetensors(*merged_safe, out.string() + ".old/model.safetensors");
    CHECK(max_param_diff(*merged_safe, *held) == 0.0);
    fs::remove_all(out.string() + ".old");
    for (const auto& resume : {std::pair{1, sharded_state}, std::pair{3, full_state}}) {
      const int world = resume.first;
      const auto type = resume.second;
      CAPTURE(world);
      accel::spawn(world, [&](int rank) { zero3_resume_matches_one_process(dir, zero3_saving(type), rank, world, 2, b, k, n); },
                   bounded(120s));
    }
    fs::remove(dir / "model_0_shard_1.pt");  // converted above
    CHECK_THROWS_WITH(accel::checkpoint::consolidate_model(dir, out), doctest::Contains("model_0_shard_1.pt is missing"));
  }

  TEST_CASE("SHARDED_STATE_DICT never holds the whole model: save_state and load_state peak at under 3/4 of the "
            "model's bytes at the allocator on 2 ranks, where FULL_STATE_DICT gathers it whole") {
    const auto sharded_dir = fresh_dir("peak_sharded"), full_dir = fresh_dir("peak_full");
    RemoveOnExit cleanup{sharded_dir, full_dir};
    // Linear(64, 512), Tanh, Linear(512, 512), Tanh, Linear(512, 10): 301,066 parameters.
    const std::int64_t model_bytes = 4 * (64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10);
    accel::spawn(
        2,
        [&](int rank) {
          for (const auto type : {sharded_state, full_state}) {
            const auto& dir = type == sharded_state ? sharded_dir : full_dir;
            accel::device::HostAllocationCounter counter;
            accel::Trainer<accel::ZeRO<3>> trainer(accel::ZeRO<3>{.state_dict_type = type});
            torch::nn::Sequential net(torch::nn::Linear(64, 512), torch::nn::Tanh(), torch::nn::Linear(512, 512),
                                      torch::nn::Tanh(), torch::nn::Linear(512, 10));
            torch::optim::SGD opt(net->parameters(), 0.1);
            trainer.prepare(net, opt);
            auto batch = global_batch(0, 8, 64, 10);
            trainer.step([&] { return loss_of(net, batch.x.narrow(0, rank * 4, 4), batch.y.narrow(0, rank * 4, 4)); });
            auto peak_of = [&](auto&& run) {
              std::this_thread::sleep_for(50ms);  // the step's collectives' buffers released
              counter.reset_peak();
              const auto before = counter.live_bytes();
              run();
              return counter.peak_bytes() - before;
            };
            // The step's buffers, once Gloo's threads have let go of the last ones.
            for (int i = 0; i < 40 && trainer.idle_buffer_bytes() == 0; ++i) std::this_thread::sleep_for(50ms);
            const auto buffers = trainer.idle_buffer_bytes();
            const auto saving = peak_of([&] { trainer.save_state(dir); });
            const auto loading = peak_of([&] { trainer.load_state(dir); });
            const std::string name = type == sharded_state ? "SHARDED_STATE_DICT" : "FULL_STATE_DICT";
            // A checkpoint's whole-model gather has memory of its own, freed after it: the
            // step buffers the engine keeps do not grow to the model (NOTE [Buffers that live as long as the engine]).
            require(buffers > 0 && trainer.idle_buffer_bytes() == buffers,
                    name + ": idle step buffers " + std::to_string(buffers) + " before save_state and load_state, " +
                        std::to_string(trainer.idle_buffer_bytes()) + " after");
            if (rank == 0)
              std::printf("%-18s peak above the step's: save %lld, load %lld bytes (model %lld)\n", name.c_str(),
                          static_cast<long long>(saving), static_cast<long long>(loading),
                          static_cast<long long>(model_bytes));
            if (type == sharded_state) {
              require(4 * saving < 3 * model_bytes, name + ": save_state peaked at " + std::to_string(saving) + " bytes");
              require(4 * loading < 3 * model_bytes, name + ": load_state peaked at " + std::to_string(loading) + " bytes");
            } else {  // the companion: the whole model, gathered
              require(saving >= model_bytes && loading >= model_bytes,
                      name + ": " + std::to_string(saving) + " / " + std::to_string(loading) + " bytes");
            }
          }
        },
        bounded(120s));
  }
}
