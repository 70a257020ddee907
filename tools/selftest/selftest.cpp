// accel-selftest: the program `accel test` launches on every rank, as
// `accelerate test` launches its test_script.py. It checks, on the job the
// launcher set up, what a training run relies on, and rank 0 prints one line
// per check and rank:
//   the rendezvous (every rank present once, consistent variables),
//   each collective on Gloo (and on NCCL where every local rank has a GPU),
//   RNG agreement after set_seed (and difference with device_specific),
//   data sharding (an epoch's samples each read once; gather_for_metrics),
//   a DDP step leaving every replica identical.
// Exit status 0 when everything passed, 1 otherwise.

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>
#include <unistd.h>

#include <accel/accel.hpp>
#include <accel/device/threads.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

// A check passes (nullopt) or says what went wrong on this rank.
using Outcome = std::optional<std::string>;

std::string host_name() {
  char host[256] = "";
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

Outcome expect(bool ok, const std::string& what) { return ok ? Outcome{} : Outcome{what}; }

// The collectives of one communicator, each against values every rank can work out.
std::vector<std::pair<std::string, std::function<Outcome()>>> collective_checks(accel::comm::Communicator& comm,
                                                                                at::Device device) {
  const int n = comm.size(), r = comm.rank();
  const auto on = [device](at::ScalarType dtype) { return at::TensorOptions().dtype(dtype).device(device); };
  return {
      {"all_reduce (sum: float, double, int64)",
       [&comm, n, r, on] {
         for (auto dtype : {at::kFloat, at::kDouble, at::kLong}) {
           at::Tensor t = at::full({5}, r + 1, on(dtype));
           comm.all_reduce(t, "accel test");
           if (!t.cpu().eq(n * (n + 1) / 2).all().item<bool>())
             return Outcome{std::string(c10::toString(dtype)) + " sum is " + std::to_string(t[0].item<double>()) +
                            ", expected " + std::to_string(n * (n + 1) / 2)};
         }
         return Outcome{};
       }},
      {"all_reduce (max)",
       [&comm, n, r, on] {
         at::Tensor t = at::full({3}, static_cast<float>(r), on(at::kFloat));
         comm.all_reduce_max(t, "accel test");
         return expect(t.cpu().eq(n - 1).all().item<bool>(), "max is " + std::to_string(t[0].item<float>()));
       }},
      {"broadcast (from the last rank)",
       [&comm, n, r, on] {
         at::Tensor t = at::full({4}, static_cast<float>(r), on(at::kFloat));
         comm.broadcast(t, n - 1, "accel test");
         return expect(t.cpu().eq(n - 1).all().item<bool>(), "received " + std::to_string(t[0].item<float>()));
       }},
      {"all_gather",
       [&comm, n, r, on] {
         auto parts = comm.all_gather(at::full({2}, static_cast<float>(r), on(at::kFloat)), "accel test");
         for (int k = 0; k < n; ++k)
           if (!parts[k].cpu().eq(k).all().item<bool>()) return Outcome{"part " + std::to_string(k) + " is wrong"};
         return Outcome{};
       }},
      {"reduce_scatter (flat, 7 elements: shards that do not divide)",
       [&comm, n, r, on] {
         at::Tensor input = at::arange(7, on(at::kFloat)) * (r + 1);
         at::Tensor shard = accel::comm::reduce_scatter(comm, input, "accel test").cpu();
         const auto range = accel::comm::shard_range(7, n, r);
         at::Tensor expected = at::arange(7, at::TensorOptions().dtype(at::kFloat)).narrow(0, range.offset, range.size) *
                               (n * (n + 1) / 2);
         return expect(shard.equal(expected), "shard differs from the sum");
       }},
      {"all_gather_flat (7 elements)",
       [&comm, n, r, on] {
         const auto range = accel::comm::shard_range(7, n, r);
         at::Tensor shard = at::arange(7, on(at::kFloat)).narrow(0, range.offset, range.size).contiguous();
         at::Tensor full = accel::comm::all_gather_flat(comm, shard, 7, "accel test").cpu();
         return expect(full.equal(at::arange(7, at::TensorOptions().dtype(at::kFloat))), "gathered tensor differs");
       }},
      {"send/recv (a ring)",
       [&comm, n, r, on] {
         if (n == 1) return Outcome{};
         at::Tensor out = at::full({3}, static_cast<float>(r), on(at::kFloat));
         at::Tensor in = at::zeros({3}, on(at::kFloat));
         auto sent = comm.send_async(out, (r + 1) % n, 0, "accel test");
         auto received = comm.recv_async(in, (r + n - 1) % n, 0, "accel test");
         received.wait();
         sent.wait();
         return expect(in.cpu().eq((r + n - 1) % n).all().item<bool>(), "received from the wrong rank");
       }},
      {"barrier", [&comm, n, r, on] { comm.barrier("accel test"); return Outcome{}; }},
  };
}

}  // namespace

int main() {
  accel::device::limit_cpu_threads(1);
  // This program's Trainer is DDP in fp32; the precision and FSDP settings a
  // config asks for are for the user's programs, and would make it refuse.
  namespace variables = accel::launch::variables;
  for (const char* name : {variables::mixed_precision, variables::mixed_precision_origin,
                           variables::fsdp_sharding_strategy, variables::fsdp_offload_params,
                           variables::fsdp_auto_wrap_policy, variables::fsdp_min_num_params,
                           variables::fsdp_transformer_cls_to_wrap})
    ::unsetenv(name);
  std::optional<accel::Trainer<accel::DDP>> trainer;
  try {
    trainer.emplace(accel::DDP{}, accel::TrainerOptions{.timeout = std::chrono::seconds(60)});
  } catch (const std::exception& e) {
    std::cerr << "accel test: FAIL rendezvous: " << e.what() << "\n";
    return 1;
  }
  auto& comm = trainer->data_group();
  const int n = comm.size(), rank = comm.rank();

  std::vector<std::pair<std::string, Outcome>> results;
  auto run = [&](const std::string& name, const std::function<Outcome()>& check) {
    Outcome outcome;
    try {
      outcome = check();
    } catch (const std::exception& e) {
      outcome = std::string("threw: ") + e.what();
    }
    results.emplace_back(name, outcome);
  };

  run("rendezvous", [&] {
    const std::vector<std::string> mine{std::to_string(rank), std::to_string(trainer->num_processes()),
                                        std::to_string(trainer->local_process_index()), host_name()};
    const auto all = trainer->gather_object(mine);  // a list per rank, concatenated (Accelerate's gather_object)
    if (all.size() != mine.size() * static_cast<std::size_t>(n))
      return Outcome{"gather_object gave " + std::to_string(all.size()) + " items for " + std::to_string(n) + " ranks"};
    for (int r = 0; r < n; ++r)
      if (all[4 * r] != std::to_string(r) || all[4 * r + 1] != std::to_string(n))
        return Outcome{"rank " + std::to_string(r) + " says it is rank " + all[4 * r] + " of " + all[4 * r + 1]};
    return Outcome{};
  });
  for (auto& [name, check] : collective_checks(comm, at::Device(at::kCPU))) run("gloo " + name, check);

  run("RNG agreement after set_seed", [&] {
    trainer->set_seed(1234);
    const auto draws = trainer->gather(at::randn({1, 4}));
    for (int r = 1; r < n; ++r)
      if (!draws[r].equal(draws[0])) return Outcome{"rank " + std::to_string(r) + " drew other numbers than rank 0"};
    trainer->set_seed(1234, /*device_specific=*/true);
    const auto own = trainer->gather(at::randn({1, 4}));
    for (int r = 1; r < n; ++r)
      if (own[r].equal(own[0])) return Outcome{"device_specific seeds drew the same numbers on ranks 0 and " + std::to_string(r)};
    return Outcome{};
  });
  run("data sharding (13 samples, shuffled, batches of 2)", [&] {
    auto loader = trainer->prepare(accel::data::TensorDataset(at::arange(13).unsqueeze(1).to(at::kFloat), at::arange(13)),
                                   {.batch_size = 2, .shuffle = true, .seed = 3});
    std::vector<at::Tensor> seen;
    for (auto batch : loader) seen.push_back(trainer->gather_for_metrics(batch.target));
    const auto all = std::get<0>(at::cat(seen).sort());
    return expect(all.equal(at::arange(13)), "the epoch did not read every sample exactly once");
  });
  run("a DDP step keeps the replicas identical", [&] {
    torch::nn::Linear model(4, 2);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    trainer->prepare(model, optimizer);
    trainer->step([&] { return model(at::full({3, 4}, static_cast<float>(rank))).pow(2).mean(); });
    const auto weights = trainer->gather(model->weight.detach().unsqueeze(0));
    for (int r = 1; r < n; ++r)
      if (!weights[r].equal(weights[0])) return Outcome{"rank " + std::to_string(r) + "'s weights differ from rank 0's"};
    return Outcome{};
  });

  // NCCL: where every local rank has a GPU, on a second group (the next port).
  const bool gpus = at::hasCUDA() && at::detail::getCUDAHooks().getNumGPUs() >= trainer->num_processes();
  if (gpus) {
    try {
      auto world = accel::comm::world_from_environment();
      world.master_port += 1;
      auto nccl = accel::comm::Communicator::connect(world, accel::comm::BackendKind::nccl, std::chrono::seconds(60));
      const at::Device gpu(at::kCUDA, static_cast<c10::DeviceIndex>(trainer->local_process_index()));
      for (auto& [name, check] : collective_checks(nccl, gpu)) run("nccl " + name, check);
    } catch (const std::exception& e) {
      results.emplace_back("nccl", std::string("threw: ") + e.what());
    }
  }

  // Every rank's outcomes to rank 0, which prints them.
  std::vector<std::string> failures;
  for (auto& [name, outcome] : results) failures.push_back(outcome ? name + ": " + *outcome : "");
  // One list per rank: wrapped, since gather_object concatenates the ranks' lists (Accelerate's rule).
  const auto everyone = trainer->gather_object(std::vector<std::vector<std::string>>{failures});
  if (!trainer->is_main_process()) return std::any_of(failures.begin(), failures.end(), [](auto& f) { return !f.empty(); });
  std::cout << "accel test: " << n << " process" << (n == 1 ? "" : "es") << ", LibTorch " << TORCH_VERSION << "\n";
  bool all_passed = true;
  for (std::size_t i = 0; i < results.size(); ++i) {
    std::vector<std::string> failed;
    for (int r = 0; r < n; ++r)
      if (i < everyone[r].size() && !everyone[r][i].empty()) failed.push_back("rank " + std::to_string(r) + ": " + everyone[r][i]);
    std::cout << (failed.empty() ? "  PASS " : "  FAIL ") << results[i].first << "\n";
    for (const auto& f : failed) std::cout << "       " << f << "\n";
    all_passed = all_passed && failed.empty();
  }
  if (!gpus) std::cout << "  SKIP nccl: not every local rank has a GPU\n";
  std::cout << (all_passed ? "Test is a success! You are ready for your distributed training!\n"
                           : "accel test: some checks failed (above)\n");
  return all_passed ? 0 : 1;
}
