// Host blocks kept for reuse (NOTE [Host blocks kept for reuse],
// device/host_block_cache.hpp): the cache LibTorch's CPU allocations go
// through while a CPU Trainer lives. The cache is process-wide, so each case
// reads differences of its statistics; the first case runs before any
// Trainer of its process when the suite runs alone (as meson runs it).
#include <ATen/ops/empty.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <vector>

#include <accel/device/allocation_counter.hpp>
#include <accel/device/host_block_cache.hpp>

#include "doctest_torch.hpp"

using accel::device::HostBlockCache;
using accel::device::HostBlockCacheUse;

namespace {

constexpr std::int64_t kMiB = 1 << 20;

at::Tensor host_bytes(std::int64_t bytes) { return at::empty({bytes}, at::TensorOptions().dtype(at::kByte)); }

}  // namespace

TEST_SUITE("host_memory") {
  TEST_CASE("installed under a counter that was there first, the counter still counts what tensors hold, not the "
            "blocks the cache keeps") {
    if (HostBlockCache::installed() != nullptr) {
      WARN_MESSAGE(false, "skipped: the cache was installed before this case (run the host_memory suite alone)");
      return;
    }
    accel::device::HostAllocationCounter counter;
    HostBlockCacheUse use(true);
    REQUIRE_MESSAGE(use.get() != nullptr, "the cache goes under the counter, over LibTorch's own allocator");
    const auto live = counter.live_bytes();
    const auto before = use.get()->stats();
    {
      auto t = host_bytes(4 * kMiB);
      CHECK(counter.live_bytes() == live + 4 * kMiB);
      CHECK(use.get()->stats().in_use == before.in_use + 4 * kMiB);
    }
    CHECK(counter.live_bytes() == live);  // freed, as the counter sees it ...
    CHECK(use.get()->stats().idle == before.idle + 4 * kMiB);  // ... and kept by the cache under it
  }

  TEST_CASE("a freed block serves the next request it holds: split, the rest idle, joined again when freed") {
    HostBlockCacheUse use(true);
    REQUIRE(use.get() != nullptr);
    auto& cache = *use.get();
    const char* first = nullptr;
    { first = static_cast<const char*>(host_bytes(8 * kMiB).data_ptr()); }  // mapped (or an idle range), freed
    const auto mapped = cache.stats().mapped;
    {
      auto same = host_bytes(8 * kMiB);
      CHECK(same.data_ptr() == first);
    }
    {
      auto front = host_bytes(5 * kMiB);  // the front of the idle 8 MiB ...
      CHECK(front.data_ptr() == first);
      auto rest = host_bytes(3 * kMiB);  // ... and the 3 MiB after it, kept idle on its own
      CHECK(rest.data_ptr() == first + 5 * kMiB);
    }  // both freed: joined again
    {
      auto whole = host_bytes(8 * kMiB);
      CHECK(whole.data_ptr() == first);
    }
    CHECK(cache.stats().mapped == mapped);  // every request above came from the first block
    {  // a remainder under the smallest block size stays with the block
      const auto in_use = cache.stats().in_use;
      auto nearly = host_bytes(8 * kMiB - 64 * 1024);
      CHECK(nearly.data_ptr() == first);
      CHECK(cache.stats().in_use == in_use + 8 * kMiB);
    }
    {  // below the smallest block size: malloc's, not the cache's
      const auto in_use = cache.stats().in_use;
      auto small = host_bytes(static_cast<std::int64_t>(HostBlockCache::kSmallestBlock) - 1);
      CHECK(cache.stats().in_use == in_use);
    }
  }

  TEST_CASE("sizes that keep changing cannot grow the cache past twice the most that was ever in use at once") {
    HostBlockCacheUse use(true);
    REQUIRE(use.get() != nullptr);
    auto& cache = *use.get();
    // Growing sizes, each freed before the next, each with a 1 MiB block taken after it and kept, which
    // mostly keeps the idle ranges apart: without the bound, most of 440 MiB would be idle at the end.
    std::vector<at::Tensor> kept;
    for (std::int64_t mib = 20; mib <= 60; mib += 4) {
      {
        auto t = host_bytes(mib * kMiB);
        kept.push_back(host_bytes(kMiB));
      }
      const auto now = cache.stats();
      CHECK(now.in_use + now.idle <= 2 * now.most_in_use);
    }
    const auto after = cache.stats();
    CHECK(after.in_use + after.idle <= 2 * after.most_in_use);
    // The most ever held: at least the most in use, and within the same bound.
    CHECK(after.most_held >= after.most_in_use);
    CHECK(after.most_held >= after.in_use + after.idle);
    CHECK(after.most_held <= 2 * after.most_in_use);
  }

  TEST_CASE("after an optimizer's first step the Trainer gives the cache's idle ranges back, once per optimizer") {
    accel::Trainer<accel::SingleProcess> trainer;
    torch::nn::Linear model(512, 1024), critic(512, 1024);  // 2 MiB weights: the cache's blocks
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD critic_sgd(critic->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    trainer.prepare(model, sgd);
    trainer.prepare(critic, critic_sgd);
    const auto* cache = HostBlockCache::installed();
    REQUIRE(cache != nullptr);
    const auto x = at::randn({4, 512});
    // A step of one optimizer, with `idle` bytes freed into the cache before it; the cache's statistics after
    // optimizer_step() (before anything later frees a block).
    auto step = [&](torch::nn::Linear& net, torch::optim::Optimizer& optimizer, std::int64_t idle) {
      host_bytes(idle);  // freed at once: an idle range of the cache
      REQUIRE(cache->stats().idle >= idle);
      trainer.backward(net->forward(x).square().mean());
      trainer.optimizer_step(optimizer);
      const auto stats = cache->stats();
      trainer.zero_grad();
      return stats;
    };
    const auto first = step(model, sgd, 8 * kMiB);
    CHECK(first.idle == 0);  // the momentum buffers exist now; what prepare and the step left idle is gone
    const auto second = step(model, sgd, 8 * kMiB);
    CHECK(second.idle >= 4 * kMiB);  // later steps keep their blocks (the 8 MiB, less the new gradient)
    CHECK(second.unmapped == first.unmapped);
    const auto critic_first = step(critic, critic_sgd, 8 * kMiB);  // the second optimizer's first step
    CHECK(critic_first.idle == 0);
    CHECK(step(critic, critic_sgd, 8 * kMiB).idle >= 4 * kMiB);
  }

  TEST_CASE("a CPU Trainer is a user of the cache while it lives, unless cache_host_memory is off or "
            "return_host_memory is on; the last user's release gives the idle blocks back") {
    const auto users = [] { return HostBlockCache::installed() ? HostBlockCache::installed()->stats().users : 0; };
    const int before = users();
    {
      accel::Trainer<accel::SingleProcess> trainer;
      CHECK(users() == before + 1);
      torch::nn::Linear model(512, 1024);  // a 2 MiB weight: one of the cache's blocks
      CHECK(HostBlockCache::installed()->stats().in_use >= 2 * kMiB);
    }
    CHECK(users() == before);
    {
      accel::Trainer<accel::SingleProcess> trainer(accel::TrainerOptions{.cache_host_memory = false});
      CHECK(users() == before);
    }
    {
      accel::Trainer<accel::SingleProcess> trainer(accel::TrainerOptions{.return_host_memory = true});
      CHECK(users() == before);
    }
    if (before == 0) {
      const auto* cache = HostBlockCache::installed();
      CHECK(cache->stats().idle == 0);
      {  // with no user left, LibTorch's own allocator serves large blocks again
        const auto idle_stats = cache->stats();
        auto t = host_bytes(4 * kMiB);
        CHECK(cache->stats().mapped == idle_stats.mapped);
        CHECK(cache->stats().in_use == idle_stats.in_use);
      }
      CHECK(cache->stats().idle == 0);
    }
  }
}
