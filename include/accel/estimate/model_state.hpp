#pragma once
// NOTE [Memory estimate]
// The model state each rank holds under each strategy, predicted from the
// model's shapes alone, equal to the byte to what Trainer::model_state_bytes
// measures in a real run (tests/torch/test_estimate.cpp): the estimate runs
// the engines' own plans (bucket_plan.hpp, unit_plan.hpp), so the padding of
// each bucket to the shard count and ZeRO-3's units are counted as they are
// allocated. With P' the padded buckets' bytes, N the shard count, k the
// optimizer's tensors per parameter (Adam 2):
//   single, DDP  params P,  grads P,    optimizer kP         (unpadded)
//   ZeRO-1       params P', grads P',   optimizer kP'/N
//   ZeRO-2       params P', grads P'/N, optimizer kP'/N      (between steps; see below)
//   ZeRO-3       params P'/N, grads P'/N, optimizer kP'/N    (P' padded per unit)
//   HybridShard  ZeRO-3's with N = shard_group_size
//   cpu_offload  the optimizer state moves to host memory, beside host
//                twins of the shard and its gradient (P'/N each)
// Mixed precision changes none of it: BF16/FP16 autocast keeps fp32 master
// weights, gradients and optimizer state. What lives only within a step is
// not model state: ZeRO-2's full-size gradient buckets during backward,
// ZeRO-3's gathered units, the optimizer's temporaries; ZeRO-3 keeps its
// step's buffers between steps all the same (step_buffers below). Torch-free.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "accel/core/model_state.hpp"
#include "accel/core/policies.hpp"
#include "accel/strategy/bucket_plan.hpp"
#include "accel/strategy/unit_plan.hpp"

namespace accel::estimate {

/// What the estimate needs of a model: its trained parameters in
/// registration order (elements, element size, kind, optimizer group) and
/// its module tree, which places ZeRO-3's units.
struct ModelShape {
  std::vector<strategy::ParameterSlot> params{};
  strategy::ModuleNode tree{};

  std::int64_t numel() const {
    std::int64_t n = 0;
    for (const auto& p : params) n += p.numel;
    return n;
  }
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const auto& p : params) n += p.numel * p.element_size;
    return n;
  }
};

/// How many tensors shaped like its parameter an optimizer keeps: Adam and
/// AdamW 2 (3 with amsgrad), SGD with momentum and RMSprop 1, plain SGD 0.
struct OptimizerShape {
  int states_per_parameter = 2;
};

namespace detail {

// Bytes of the flat buffers the plan allocates: each bucket padded to a
// multiple of the shard count.
inline std::int64_t planned_bytes(const std::vector<strategy::ParameterSlot>& slots, const strategy::PlanSettings& plan) {
  std::int64_t bytes = 0;
  for (const auto& bucket : strategy::plan_buckets(slots, plan)) bytes += bucket.padded * slots[bucket.params.front()].element_size;
  return bytes;
}

// ZeRO-3's plan: one bucket per (kind, group, unit) run, padded to
// `shards`; the bytes of each bucket, in the order of the parameters, and
// of each unit (the root unit, what no wrapped module took, last).
struct Zero3Plan {
  std::vector<std::int64_t> bucket_bytes, unit_bytes;
};
inline Zero3Plan zero3_plan(const ModelShape& shape, const ZeRO<3>& settings, int shards) {
  std::vector<std::int64_t> numels;
  for (const auto& p : shape.params) numels.push_back(p.numel);
  std::vector<std::string> unit_names;
  const auto units = strategy::assign_units(shape.tree, numels, settings.auto_wrap_policy, settings.min_num_params,
                                            settings.transformer_layer_cls_to_wrap, unit_names);
  auto slots = shape.params;
  for (std::size_t i = 0; i < slots.size(); ++i) slots[i].unit = static_cast<int>(units[i]);
  Zero3Plan plan{{}, std::vector<std::int64_t>(unit_names.size(), 0)};
  for (const auto& bucket : strategy::plan_buckets(slots, {.caps = std::nullopt, .pad_to_multiple = shards})) {
    const auto& first = slots[bucket.params.front()];
    plan.bucket_bytes.push_back(bucket.padded * first.element_size);
    plan.unit_bytes[static_cast<std::size_t>(first.unit)] += plan.bucket_bytes.back();
  }
  return plan;
}

inline std::int64_t planned_total(const Zero3Plan& plan) {
  std::int64_t total = 0;
  for (auto b : plan.bucket_bytes) total += b;
  return total;
}

inline void check_world(int world, const char* who) {
  if (world < 1) throw std::invalid_argument(std::string("accel estimate: ") + who + ": the number of processes must be at least 1");
}

/// HybridShard's shard group: a divisor of the world (0, one machine, is unknown here).
inline void check_shard_group(const HybridShard& settings, int world) {
  check_world(world, "HybridShard");
  const int shards = settings.shard_group_size;
  if (shards < 1 || world % shards != 0)
    throw std::invalid_argument("accel estimate: HybridShard needs shard_group_size (the ranks of one machine), a divisor of " +
                                std::to_string(world) + " processes; got " + std::to_string(shards));
}

// The sharded strategies' state from the padded total, the shard count and
// whether parameters and gradients are sharded too.
inline ModelStateBytes sharded(std::int64_t padded, int shards, bool shard_parameters, bool shard_gradients,
                               bool cpu_offload, const OptimizerShape& optimizer) {
  const std::int64_t shard = padded / shards;
  ModelStateBytes m;
  m.parameters = shard_parameters ? shard : padded;
  m.gradients = shard_gradients ? shard : padded;
  const std::int64_t state = optimizer.states_per_parameter * shard;
  if (cpu_offload) {
    m.offloaded_parameters = shard;
    m.offloaded_gradients = shard;
    m.offloaded_optimizer_state = state;
  } else {
    m.optimizer_state = state;
  }
  return m;
}

// ZeRO-3's state (HybridShard's within its group) from the plan of its units over `shards` ranks.
inline ModelStateBytes zero3_state(const Zero3Plan& plan, const ZeRO<3>& settings, int shards,
                                   const OptimizerShape& optimizer) {
  return sharded(planned_total(plan), shards, true, true, settings.cpu_offload, optimizer);
}

}  // namespace detail

/// One process, or DDP on any number: every rank holds everything, unpadded.
inline ModelStateBytes model_state(const ModelShape& shape, const SingleProcess&, int world, OptimizerShape optimizer = {}) {
  detail::check_world(world, "SingleProcess");
  const std::int64_t p = shape.bytes();
  return {.parameters = p, .gradients = p, .optimizer_state = optimizer.states_per_parameter * p};
}
inline ModelStateBytes model_state(const ModelShape& shape, const DDP&, int world, OptimizerShape optimizer = {}) {
  return model_state(shape, SingleProcess{}, world, optimizer);
}

template <int Stage>
ModelStateBytes model_state(const ModelShape& shape, const ZeRO<Stage>& settings, int world, OptimizerShape optimizer = {}) {
  detail::check_world(world, "ZeRO");
  if constexpr (Stage == 3) {
    return detail::zero3_state(detail::zero3_plan(shape, settings, world), settings, world, optimizer);
  } else {
    const auto padded = detail::planned_bytes(
        shape.params, {.caps = strategy::BucketCaps{settings.first_bucket_cap_mb, settings.bucket_cap_mb},
                       .pad_to_multiple = world});
    return detail::sharded(padded, world, false, Stage == 2, settings.cpu_offload, optimizer);
  }
}

/// HybridShard needs its shard group size (0, one machine, is unknown here).
inline ModelStateBytes model_state(const ModelShape& shape, const HybridShard& settings, int world,
                                   OptimizerShape optimizer = {}) {
  detail::check_shard_group(settings, world);
  const int shards = settings.shard_group_size;
  return detail::zero3_state(detail::zero3_plan(shape, settings.zero, shards), settings.zero, shards, optimizer);
}

/// NOTE [Step buffers in the estimate]
/// What ZeRO-3 and HybridShard keep beside the model state between steps:
/// the step's buffers, which the engine's pool holds for its life (NOTE
/// [Buffers that live as long as the engine] in device/buffer_pool.hpp), as
/// many as the step has in flight at once (strategy/zero3.hpp):
/// - gathered units: the root unit (what no wrapped module took, often the
///   embeddings and the head) stays gathered through the forward and, once
///   backward reaches it, until its last bucket is reduced; beside it the
///   unit that computes and the one prefetched. So the root and the two
///   largest other units; with reshard_after_forward = false every unit,
///   from its forward to its backward;
/// - full gradient buckets: the one filling and the one reduce-scattering,
///   neighbours in the parameters' order: the largest two adjacent buckets.
/// `gathered` is the part the pool must keep: those units are gathered at
/// once (the root, the unit in backward and the one it prefetches), each in
/// a block of its own, where the two largest other units are neighbours in
/// the forward (equal blocks, as a transformer's; else it counts a pair that
/// may never meet). The gradient buckets come and go between them, and a
/// pool block serves any request of at least half its size: a bucket may
/// take a block a unit gave back, or find none that fits and allocate, as
/// the threads' timing goes (the GPT case of test_estimate, on 2 ranks,
/// keeps 11% to 24% more than `bytes`; the tests hold it between `gathered`
/// and `most`). Units of very different sizes each keep blocks of their own:
/// up to one gathered and one gradient block per unit (`most`). On Gloo the
/// reduce-scatter's all-to-all also receives into buffers of its own, one
/// launched bucket at a time, also in `most` (NCCL's receives in place).
/// The pool keeps host memory; on CUDA the caching allocator keeps the same
/// blocks reserved for the next step (torch.cuda.memory_reserved), so the
/// figure is counted on every device. Every other strategy keeps none.
struct StepBuffers {
  std::int64_t gathered = 0;  ///< the units gathered at once: the least the pool keeps
  std::int64_t bytes = 0;     ///< those and the gradient buckets in flight: what it typically keeps
  std::int64_t most = 0;      ///< what the pool can keep: a block per unit and kind, and Gloo's receive buffers
};

namespace detail {
inline StepBuffers step_buffers(const Zero3Plan& plan, const ZeRO<3>& settings) {
  std::int64_t all = 0;
  for (auto b : plan.unit_bytes) all += b;
  std::vector<std::int64_t> others(plan.unit_bytes.begin(), plan.unit_bytes.end() - 1);  // the root is last
  std::sort(others.begin(), others.end(), std::greater<>{});
  std::int64_t gathered = plan.unit_bytes.back();
  for (std::size_t i = 0; i < others.size() && i < 2; ++i) gathered += others[i];
  if (!settings.reshard_after_forward) gathered = all;
  std::int64_t gradients = plan.bucket_bytes.empty() ? 0 : plan.bucket_bytes.front();
  for (std::size_t b = 1; b < plan.bucket_bytes.size(); ++b)
    gradients = std::max(gradients, plan.bucket_bytes[b - 1] + plan.bucket_bytes[b]);
  const std::int64_t bytes = gathered + gradients;
  return {gathered, bytes, std::max(bytes, 2 * all) + gradients};
}
}  // namespace detail

inline StepBuffers step_buffers(const ModelShape& shape, const ZeRO<3>& settings, int shards) {
  detail::check_world(shards, "ZeRO-3");
  return detail::step_buffers(detail::zero3_plan(shape, settings, shards), settings);
}
inline StepBuffers step_buffers(const ModelShape& shape, const HybridShard& settings, int world) {
  detail::check_shard_group(settings, world);
  return step_buffers(shape, settings.zero, settings.shard_group_size);
}

/// ZeRO-3's or HybridShard's model state and step buffers from one plan of
/// its units (the plan walks the module tree; a report row needs both).
struct ShardedEstimate {
  ModelStateBytes state;
  StepBuffers buffers;
};
inline ShardedEstimate sharded_estimate(const ModelShape& shape, const ZeRO<3>& settings, int world,
                                        OptimizerShape optimizer = {}) {
  detail::check_world(world, "ZeRO");
  const auto plan = detail::zero3_plan(shape, settings, world);
  return {detail::zero3_state(plan, settings, world, optimizer), detail::step_buffers(plan, settings)};
}
inline ShardedEstimate sharded_estimate(const ModelShape& shape, const HybridShard& settings, int world,
                                        OptimizerShape optimizer = {}) {
  detail::check_shard_group(settings, world);
  const int shards = settings.shard_group_size;
  const auto plan = detail::zero3_plan(shape, settings.zero, shards);
  return {detail::zero3_state(plan, settings.zero, shards, optimizer), detail::step_buffers(plan, settings.zero)};
}

}  // namespace accel::estimate
