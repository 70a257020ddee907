#pragma once
// Gradient buckets filled during backward: the machinery DDP and ZeRO share.
//
// NOTE [Gradient buckets]
// Parameters are assigned to buckets in reverse registration order (roughly
// the order backward produces their gradients): a parameter joins the
// current bucket, which closes once it holds at least its cap (the first
// bucket's cap is small so communication starts early; PyTorch's Reducer
// rule). Each bucket owns one flat gradient buffer and every parameter's
// `.grad` is a view into it, so autograd accumulates straight into what is
// communicated. A post-hook on each parameter's AccumulateGrad node marks it
// ready; when a bucket's last parameter is ready and every earlier bucket has
// been launched, `launch(bucket)` runs (the strategy issues its collective
// there, asynchronously). Launch order is the bucket order on every rank,
// whatever order the hooks fire in.
// DDP and ZeRO-1 keep every bucket's buffer for good (their optimizer steps
// the full gradients). ZeRO-2 and ZeRO-3 step only a shard, so their buffers
// are lazy: a bucket's is allocated when its first gradient arrives (autograd
// leaves that gradient in a tensor of its own, copied in), and before that,
// and before each launch, the buckets already launched are retired: their
// reduce-scatter waited for and their full gradients dropped. A bucket's
// collective thus overlaps the backward up to the next bucket's first
// gradient, and the full gradients of one bucket (and one in flight) exist
// at a time, not the model's. ZeRO-3's come from the engine's BufferPool
// (NOTE [Buffers that live as long as the engine]).

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "accel/comm/collectives.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/device/buffer_pool.hpp"
#include "accel/strategy/autograd_graph.hpp"
#include "accel/strategy/bucket_plan.hpp"
#include "accel/strategy/engine.hpp"
#include "accel/strategy/module_tree.hpp"

namespace accel::strategy {

/// What a bucketed engine did during a backward pass, in order (recorded only
/// when asked: tests use it to show that communication overlaps backward).
struct DDPEvent {
  enum Kind { gradient_ready, bucket_launched } kind;
  std::size_t index;  ///< parameter index or bucket index
};

struct BucketSettings {
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  bool find_unused_parameters = false;
  bool static_graph = false;
  std::int64_t pad_to_multiple = 1;  ///< ZeRO pads each bucket so it splits evenly over the ranks
  const char* strategy_name = "DDP";
  /// How the user turns find_unused_parameters on, for the error that asks
  /// for it; null: "<strategy_name>{.find_unused_parameters = true}".
  const char* find_unused_parameters_spelling = nullptr;
  /// false: no size caps, a bucket per unit and group (ZeRO-3).
  bool size_capped = true;
  /// ZeRO-2/3: a bucket's full-size gradients exist only from its first
  /// gradient until its reduce-scatter has landed (NOTE [Gradient buckets]).
  bool lazy_gradients = false;
  /// ZeRO-3: the step's host buffers (full gradients, Gloo's receive
  /// buffers; and the engine's gathered units) come from the engine's pool
  /// and stay there between steps (NOTE [Buffers that live as long as the engine]).
  bool keep_step_buffers = false;
};

namespace detail {

struct Bucket {
  std::vector<std::size_t> params;  // indices into GradientBuckets::params
  std::vector<std::int64_t> offsets;  // of each parameter in the flat buffers
  std::int64_t numel = 0;           // real elements
  std::int64_t padded = 0;          // numel rounded up to pad_to_multiple
  at::Tensor grad;                  // (padded,) flat gradients; params' .grad are views of it
  std::size_t pending = 0;
  int group = 0;                    // optimizer parameter group of every member
  int unit = 0;                     // ZeRO-3's unit of every member
};

// State shared with the autograd hooks, which may outlive the engine.
class GradientBuckets {
 public:
  BucketSettings settings;
  comm::Communicator* comm = nullptr;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> grad_views;
  std::vector<std::size_t> bucket_of;
  std::vector<char> ready;
  std::vector<Bucket> buckets;
  device::BufferPool pool;  // settings.keep_step_buffers: the buffers each step takes and gives back
  device::BufferPool* step_buffers() { return settings.keep_step_buffers ? &pool : nullptr; }
  std::size_t next_to_launch = 0;
  bool sync = true;  // false on the non-final micro-steps of gradient accumulation (no_sync)
  bool record = false;
  std::vector<DDPEvent> events;
  std::vector<char> unused;
  bool unused_known = false;
  std::function<void(std::size_t)> launch;  // the strategy's collective for a ready bucket
  std::size_t retired = 0;                   // lazy buckets: launched ones whose collective landed, freed
  std::function<void()> before_allocating;   // lazy buckets: the engine retires the launched ones

  std::string where() const { return "accel " + std::string(settings.strategy_name) + ": rank " + std::to_string(comm->rank()); }

  // Autograd or the user may have replaced .grad (zero_grad(set_to_none), or
  // a fresh tensor stolen when .grad was undefined): put the values back into
  // the bucket and the view back on the parameter.
  void restore_grad_view(std::size_t i) {
    if (!grad_views[i].defined()) attach_grad_views(bucket_of[i]);  // a lazy bucket's first gradient
    at::Tensor& grad = params[i].mutable_grad();
    if (grad.defined() && grad.is_same(grad_views[i])) return;
    if (grad.defined()) grad_views[i].copy_(grad);
    else grad_views[i].zero_();
    grad = grad_views[i];
  }

  void mark_ready(std::size_t i);

  void launch_ready() {
    while (next_to_launch < buckets.size() && buckets[next_to_launch].pending == 0) {
      launch(next_to_launch);
      if (record) events.push_back({DDPEvent::bucket_launched, next_to_launch});
      ++next_to_launch;
    }
  }

  /// Every parameter must have been marked ready this step.
  void check_all_ready();

  void reset() {
    std::fill(ready.begin(), ready.end(), 0);
    for (auto& bucket : buckets) bucket.pending = bucket.params.size();
    next_to_launch = 0;
    retired = 0;
  }

  /// Points every parameter's .grad at its view of the bucket buffers that exist.
  void attach_grad_views() {
    for (std::size_t b = 0; b < buckets.size(); ++b)
      if (buckets[b].grad.defined()) attach_grad_views(b);
  }

  /// Bucket b's buffer (zeros, allocated if it has none) and its parameters'
  /// .grad as views of it, holding the values .grad had.
  void attach_grad_views(std::size_t b);

  /// Drops bucket b's buffer and its parameters' views of it.
  void release_gradients(std::size_t b);
};

// The root's parameters and buffers on every rank of `group` (a model's state
// starts equal everywhere): tensors of one dtype and device broadcast together,
// flattened into chunks of at most `chunk_bytes`, and a larger tensor alone, in
// place. One flat copy of the whole model doubled it at prepare, which on 3
// ranks was a ZeRO-3 rank's peak (DDP broadcasts in buckets of 250 MB too).
inline constexpr std::int64_t kBroadcastChunkBytes = std::int64_t{16} << 20;
void broadcast_module_state(torch::nn::Module& model, comm::Communicator& group, const std::string& what,
                            std::int64_t chunk_bytes = kBroadcastChunkBytes);

class ReadyHook final : public compat::PostHook {
 public:
  ReadyHook(std::weak_ptr<GradientBuckets> state, std::size_t index) : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto state = state_.lock()) state->mark_ready(index_);
    return outputs;
  }

 private:
  std::weak_ptr<GradientBuckets> state_;
  std::size_t index_;
};

}  // namespace detail

/// The part of an engine that owns the buckets and the hooks. `group_of(i)`
/// gives parameter i's optimizer group (parameters of different groups never
/// share a bucket); the default puts every parameter in group 0.
class BucketedEngineBase : public EngineDefaults {
 public:
  explicit BucketedEngineBase(const BucketSettings& settings, comm::Communicator& comm)
      : state_(std::make_shared<detail::GradientBuckets>()) {
    state_->settings = settings;
    state_->comm = &comm;
    if (settings.bucket_cap_mb <= 0 || settings.first_bucket_cap_mb <= 0)
      throw std::invalid_argument(std::string("accel ") + settings.strategy_name +
                                  ": bucket_cap_mb and first_bucket_cap_mb must be positive");
  }
  BucketedEngineBase(const BucketedEngineBase&) = delete;
  BucketedEngineBase& operator=(const BucketedEngineBase&) = delete;
  ~BucketedEngineBase() {
    for (std::size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  }

  /// Gradient accumulation: with `false`, backward accumulates into the
  /// buckets without communicating (DDP's no_sync).
  void set_gradient_sync(bool sync) { state_->sync = sync; }

  std::int64_t idle_buffer_bytes() const { return state_->pool.idle_bytes(); }

  /// Waits for every bucket's collective in bucket order, running
  /// `after(b)` once bucket b's has landed, then readies the next backward.
  template <class AfterWait>
  void wait_for_buckets(std::vector<comm::Pending>& work, AfterWait&& after) {
    auto& s = *state_;
    s.check_all_ready();
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {
      work[b].wait();
      after(b);
    }
    s.reset();
  }

  /// Divides a bucket's gradients by the group size before they are summed
  /// over it, so that the sum is the mean: Gloo has no AVG, and fp16 on the
  /// wire must not overflow.
  void pre_divide(at::Tensor& grad) const {
    if (state_->comm->distributed()) grad.div_(state_->comm->size());
  }

  /// After gradients were accumulated without sync (a pipeline's micro-
  /// batches): mark every parameter ready, which launches every bucket.
  void launch_all_buckets() {
    auto& s = *state_;
    s.sync = true;
    for (std::size_t i = 0; i < s.params.size(); ++i) s.mark_ready(i);
  }

  // ------------------------------------------------------------ introspection
  std::size_t bucket_count() const { return state_->buckets.size(); }
  /// Parameter names of bucket `b`, in the order they were assigned.
  std::vector<std::string> bucket_parameters(std::size_t b) const;
  /// Per bucket, this rank's (padded/shards,) slice of a 0/1 mask that is 1
  /// on the elements of the parameters `counted` accepts (padding: 0).
  std::vector<at::Tensor> shard_masks(const std::function<bool(const at::Tensor&)>& counted, int shards,
                                      int rank) const {
    std::vector<at::Tensor> out;
    for (const auto& bucket : state_->buckets) {
      auto mask = at::zeros({bucket.padded}, at::TensorOptions().dtype(at::kFloat));
      for (std::size_t k = 0; k < bucket.params.size(); ++k) {
        const auto& p = state_->params[bucket.params[k]];
        if (counted(p)) mask.narrow(0, bucket.offsets[k], p.numel()).fill_(1);
      }
      const std::int64_t shard = bucket.padded / shards;
      out.push_back(mask.narrow(0, rank * shard, shard).clone());  // not the whole bucket's mask
    }
    return out;
  }
  void record_events(bool on) {
    state_->record = on;
    state_->events.clear();
  }
  const std::vector<DDPEvent>& events() const { return state_->events; }

 protected:
  /// The buckets' plan by parameter name, for a sharded checkpoint's index.
  std::vector<FlatBucket> flat_buckets() const;

  /// Collects the model's trainable parameters, checks that every rank has
  /// the same model, broadcasts rank 0's weights, plans the buckets.
  void collect_and_plan(torch::nn::Module& model, const std::function<int(const at::Tensor&)>& group_of) {
    collect(model);
    plan_buckets(group_of);
  }

  /// `broadcast`: rank 0's weights to every rank (not for a model built on
  /// meta, whose values do not exist yet: strategy/deferred_init.hpp).
  void collect(torch::nn::Module& model, bool broadcast = true);

  /// Moves bucket `b`'s parameters into one flat (padded,) buffer, each
  /// parameter becoming a view of it; the tail is padding (NOTE [ZeRO shards]).
  at::Tensor flatten_parameters(std::size_t b);

  /// Starts the reduce-scatter of bucket `b`'s (already averaged) gradients
  /// into `shard` (comm/collectives.hpp: NCCL natively; Gloo by an all-to-all
  /// among the other ranks into `received`, (n-1)/n of the bucket, with the
  /// bucket as scratch: it is dropped after the step); finish_reduce_scatter
  /// completes it after the wait.
  ///
  /// NOTE [Several backward passes before a step]
  /// Once a synchronising backward has reduced into the shards
  /// (shards_hold_reduced), a second one before the step (a GAN's
  /// discriminator: backward on the real batch, backward on the fake one)
  /// reduce-scatters into a fresh tensor beside the shard, and
  /// finish_reduce_scatter adds it: the shard holds the sum of the averaged
  /// passes, as DDP's gradients do, instead of the last pass alone.
  comm::Pending reduce_scatter_bucket(std::size_t b, at::Tensor& shard, at::Tensor& received, std::string what) {
    auto& grad = state_->buckets[b].grad;
    if (landing_.size() < state_->buckets.size()) landing_.resize(state_->buckets.size());
    landing_[b] = shards_hold_reduced_ ? at::zeros_like(shard) : shard;
    return comm::reduce_scatter_rows_async(*state_->comm, landing_[b], grad, received, grad, std::move(what),
                                           state_->step_buffers());
  }

  /// Idempotent: the retire and wait paths may both reach a bucket, and a
  /// bucket that launched nothing this step has nothing landed.
  void finish_reduce_scatter(std::size_t b, at::Tensor& shard, at::Tensor& received) {
    if (b >= landing_.size() || !landing_[b].defined()) return;
    at::Tensor& landed = landing_[b];
    comm::finish_reduce_scatter_rows(*state_->comm, landed, received);
    if (!landed.is_same(shard)) shard.add_(landed);
    landed = at::Tensor();
  }

  /// The shards hold this step's reduced gradients (synchronize_gradients
  /// sets it, zero_grad clears it): see NOTE [Several backward passes before a step].
  void set_shards_hold_reduced(bool held) { shards_hold_reduced_ = held; }

  /// Drops the full-size gradient buffers (and the parameters' views of
  /// them): between steps a sharding strategy keeps only the shards.
  void release_full_gradients() {
    for (std::size_t b = 0; b < state_->buckets.size(); ++b) state_->release_gradients(b);
  }

  /// Lazy buckets (BucketSettings::lazy_gradients): waits for every bucket
  /// launched and not yet retired, runs `after` on it and drops its full
  /// gradients (NOTE [Gradient buckets]).
  template <class AfterWait>
  void retire_launched_buckets(std::vector<comm::Pending>& work, AfterWait&& after) {
    auto& s = *state_;
    for (; s.retired < s.next_to_launch; ++s.retired) {
      work[s.retired].wait();
      after(s.retired);
      s.release_gradients(s.retired);
    }
  }

  /// Points the optimizer's groups at one tensor per bucket (a shard, or its
  /// host twin), each in the group its bucket was planned for.
  void point_optimizer_at(std::vector<torch::optim::OptimizerParamGroup>& groups,
                          const std::vector<at::Tensor>& per_bucket) const {
    const auto& buckets = state_->buckets;
    for (auto& group : groups) group.params().clear();
    for (std::size_t b = 0; b < buckets.size(); ++b)
      if (buckets[b].group >= 0) groups[buckets[b].group].params().push_back(per_bucket[b]);
  }

  void allocate_gradients() {
    for (std::size_t b = 0; b < state_->buckets.size(); ++b) state_->attach_grad_views(b);
  }

  void register_hooks();

  /// Under find_unused_parameters: parameters unreachable from the loss get
  /// zero gradients and are marked ready before backward starts.
  void mark_unused_ready(const at::Tensor& loss);

  std::shared_ptr<detail::GradientBuckets> state_;

 private:
  // Different models on different ranks would make the broadcast below
  // corrupt memory or hang; compare a cheap signature first.
  void check_same_model_everywhere(torch::nn::Module& model);

 protected:
  /// The plan of bucket_plan.hpp over the collected parameters: `group_of`
  /// their optimizer group, `unit_of` (ZeRO-3) their unit.
  void plan_buckets(const std::function<int(const at::Tensor&)>& group_of,
                    const std::function<int(std::size_t)>& unit_of = nullptr);

 private:

  // Parameters whose AccumulateGrad node is not reachable from the loss.
  std::vector<char> find_unused(const at::Tensor& loss) const;

  std::vector<compat::NodeHandle> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
  std::vector<at::Tensor> landing_;   // per bucket: where its reduce-scatter lands (the shard, or beside it)
  bool shards_hold_reduced_ = false;  // NOTE [Several backward passes before a step]
};

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE auto BucketedEngineBase::bucket_parameters(std::size_t b) const -> std::vector<std::string> {
  std::vector<std::string> out;
  for (auto i : state_->buckets.at(b).params) out.push_back(state_->names[i]);
  return out;
}

ACCEL_COMPILED_ONCE auto BucketedEngineBase::flat_buckets() const -> std::vector<FlatBucket> {
  const auto& s = *state_;
  std::vector<FlatBucket> out;
  for (const auto& bucket : s.buckets) {
    FlatBucket flat{bucket.numel, bucket.padded, {}};
    for (std::size_t k = 0; k < bucket.params.size(); ++k) {
      const auto i = bucket.params[k];
      flat.parameters.push_back({s.names[i], s.params[i].sizes().vec(), bucket.offsets[k]});
    }
    out.push_back(std::move(flat));
  }
  return out;
}

ACCEL_COMPILED_ONCE void BucketedEngineBase::collect(torch::nn::Module& model, bool broadcast) {
  auto& s = *state_;
  if (!s.params.empty())
    throw std::logic_error(std::string("accel ") + s.settings.strategy_name + ": prepare() takes one model per Trainer");
  for (auto& item : model.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    s.names.push_back(item.key());
    s.params.push_back(item.value());
  }
  check_same_model_everywhere(model);
  if (broadcast) detail::broadcast_module_state(model, *s.comm, "broadcast of rank 0's parameters at prepare");
}

ACCEL_COMPILED_ONCE auto BucketedEngineBase::flatten_parameters(std::size_t b) -> at::Tensor {
  auto& s = *state_;
  const auto& bucket = s.buckets[b];
  c10::NoGradGuard no_grad;
  at::Tensor flat = at::zeros({bucket.padded}, s.params[bucket.params.front()].options().requires_grad(false));
  for (std::size_t k = 0; k < bucket.params.size(); ++k) {
    auto& p = s.params[bucket.params[k]];
    auto view = flat.narrow(0, bucket.offsets[k], p.numel());
    view.copy_(p.reshape({-1}));
    p.set_data(view.view(p.sizes()));
  }
  return flat;
}

ACCEL_COMPILED_ONCE void BucketedEngineBase::register_hooks() {
  auto& s = *state_;
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    // Keep the AccumulateGrad node alive: the variable holds it weakly, and
    // a new one (without our hook) would be made each step otherwise.
    auto accumulator = torch::autograd::impl::grad_accumulator(s.params[i]);
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<detail::ReadyHook>(state_, i)));
    accumulators_.push_back(std::move(accumulator));
  }
}

ACCEL_COMPILED_ONCE void BucketedEngineBase::mark_unused_ready(const at::Tensor& loss) {
  auto& s = *state_;
  if (!s.sync || !s.settings.find_unused_parameters) return;
  if (!s.unused_known || !s.settings.static_graph) {
    s.unused = find_unused(loss);
    s.unused_known = true;
  }
  for (std::size_t i = 0; i < s.params.size(); ++i)
    if (s.unused[i]) {
      s.restore_grad_view(i);
      s.grad_views[i].zero_();
      s.mark_ready(i);
    }
}

ACCEL_COMPILED_ONCE void BucketedEngineBase::check_same_model_everywhere(torch::nn::Module& model) {
  auto& s = *state_;
  if (!s.comm->distributed()) return;
  std::int64_t count = 0, numel = 0, shape_hash = 0, on_meta = 0;
  for (auto& p : model.parameters()) {
    ++count;
    numel += p.numel();
    on_meta += p.is_meta();
    for (auto d : p.sizes()) shape_hash = (shape_hash * 1000003 + d) % 2147483647;
  }
  auto mine = at::tensor({count, numel, shape_hash, static_cast<std::int64_t>(model.buffers().size()), on_meta});
  auto all = s.comm->all_gather(mine, "model signature check at prepare");
  for (int r = 0; r < s.comm->size(); ++r)
    if ((all[r][4].item<std::int64_t>() > 0) != (all[0][4].item<std::int64_t>() > 0))
      throw std::runtime_error("accel " + std::string(s.settings.strategy_name) + ": rank " + std::to_string(r) +
                               "'s model is " + (all[r][4].item<std::int64_t>() > 0 ? "" : "not ") +
                               "built on the meta device, rank 0's is " +
                               (all[0][4].item<std::int64_t>() > 0 ? "" : "not") +
                               ": every rank must build the model the same way (build_on_meta on all of them)");
    else if (!all[r].equal(all[0]))
      throw std::runtime_error("accel " + std::string(s.settings.strategy_name) + ": rank " + std::to_string(r) +
                               "'s model (" + std::to_string(all[r][0].item<std::int64_t>()) + " parameters, " +
                               std::to_string(all[r][1].item<std::int64_t>()) + " elements) differs from rank 0's (" +
                               std::to_string(all[0][0].item<std::int64_t>()) + " parameters, " +
                               std::to_string(all[0][1].item<std::int64_t>()) +
                               " elements): every rank must build the same model");
}

ACCEL_COMPILED_ONCE void BucketedEngineBase::plan_buckets(const std::function<int(const at::Tensor&)>& group_of, const std::function<int(std::size_t)>& unit_of) {
  auto& s = *state_;
  const std::size_t n = s.params.size();
  s.bucket_of.assign(n, 0);
  s.ready.assign(n, 0);
  s.grad_views.resize(n);
  const auto slots = parameter_slots(s.params, group_of, unit_of);
  PlanSettings plan{.caps = std::nullopt, .pad_to_multiple = s.settings.pad_to_multiple};
  if (s.settings.size_capped) plan.caps = BucketCaps{s.settings.first_bucket_cap_mb, s.settings.bucket_cap_mb};
  std::vector<detail::Bucket> planned;
  for (auto& bucket : strategy::plan_buckets(slots, plan)) {
    planned.push_back({});
    auto& b = planned.back();
    b.params = std::move(bucket.params);
    b.offsets = std::move(bucket.offsets);
    b.numel = bucket.numel;
    b.padded = bucket.padded;
    b.group = bucket.group;
    b.unit = bucket.unit;
    b.pending = b.params.size();
    for (auto i : b.params) s.bucket_of[i] = planned.size() - 1;
  }
  s.buckets = std::move(planned);
}

ACCEL_COMPILED_ONCE auto BucketedEngineBase::find_unused(const at::Tensor& loss) const -> std::vector<char> {
  auto& s = *state_;
  const auto seen = reachable_nodes(loss);
  std::vector<char> unused(s.params.size(), 0);
  for (std::size_t i = 0; i < s.params.size(); ++i) unused[i] = !seen.count(accumulators_[i].get());
  return unused;
}

ACCEL_COMPILED_ONCE void detail::GradientBuckets::mark_ready(std::size_t i) {
  restore_grad_view(i);
  if (!sync) return;  // accumulate locally; the final micro-step communicates the sum
  if (ready[i])
    throw std::runtime_error(where() + ": parameter '" + names[i] +
                             "' got its gradient twice in one backward (a second backward through the same graph before the "
                             "step is not supported; accel::nn::checkpoint, which recomputes reentrantly, is)");
  ready[i] = 1;
  if (record) events.push_back({DDPEvent::gradient_ready, i});
  if (--buckets[bucket_of[i]].pending == 0) launch_ready();
}

ACCEL_COMPILED_ONCE void detail::GradientBuckets::check_all_ready() {
  for (std::size_t i = 0; i < params.size(); ++i)
    if (!ready[i]) {
      reset();
      throw std::runtime_error(where() + ": parameter '" + names[i] +
                               "' received no gradient in this step; if some parameters are unused in a step, "
                               "use " + (settings.find_unused_parameters_spelling
                                             ? std::string(settings.find_unused_parameters_spelling)
                                             : std::string(settings.strategy_name) + "{.find_unused_parameters = true}"));
    }
}

ACCEL_COMPILED_ONCE void detail::GradientBuckets::attach_grad_views(std::size_t b) {
  auto& bucket = buckets[b];
  if (!bucket.grad.defined()) {
    if (settings.lazy_gradients && before_allocating) before_allocating();
    const auto options = params[bucket.params.front()].options().requires_grad(false);
    auto* kept = step_buffers();
    bucket.grad = kept != nullptr ? kept->empty(bucket.padded, options).zero_() : at::zeros({bucket.padded}, options);
  }
  for (std::size_t k = 0; k < bucket.params.size(); ++k) {
    const auto i = bucket.params[k];
    auto& p = params[i];
    grad_views[i] = bucket.grad.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes());
    at::Tensor& grad = p.mutable_grad();
    if (grad.defined() && !grad.is_same(grad_views[i])) grad_views[i].copy_(grad);
    grad = grad_views[i];
  }
}

ACCEL_COMPILED_ONCE void detail::GradientBuckets::release_gradients(std::size_t b) {
  auto& bucket = buckets[b];
  bucket.grad = at::Tensor();
  for (auto i : bucket.params) {
    params[i].mutable_grad() = at::Tensor();
    grad_views[i] = at::Tensor();
  }
}

ACCEL_COMPILED_ONCE void detail::broadcast_module_state(torch::nn::Module& model, comm::Communicator& group,
                                                       const std::string& what, std::int64_t chunk_bytes) {
  if (!group.distributed()) return;
  std::vector<at::Tensor> tensors = model.parameters();
  for (auto& b : model.buffers()) tensors.push_back(b);
  c10::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> by_dtype;
  for (auto& t : tensors) {
    auto it = std::find_if(by_dtype.begin(), by_dtype.end(), [&](auto& g) {
      return g.front().scalar_type() == t.scalar_type() && g.front().device() == t.device();
    });
    if (it == by_dtype.end()) by_dtype.push_back({t});
    else it->push_back(t);
  }
  const auto bytes_of = [](const at::Tensor& t) { return t.numel() * static_cast<std::int64_t>(t.element_size()); };
  for (auto& same_kind : by_dtype)
    for (std::size_t first = 0, last = 0; first < same_kind.size(); first = last) {
      std::int64_t bytes = bytes_of(same_kind[first]);
      for (last = first + 1; last < same_kind.size() && bytes + bytes_of(same_kind[last]) <= chunk_bytes; ++last)
        bytes += bytes_of(same_kind[last]);
      if (bytes == 0) continue;  // empty tensors only: nothing to send (every rank skips the same chunk)
      if (last == first + 1 && same_kind[first].is_contiguous()) {
        group.broadcast(same_kind[first], 0, what);
        continue;
      }
      std::vector<at::Tensor> flat_parts;
      for (std::size_t i = first; i < last; ++i) flat_parts.push_back(same_kind[i].reshape({-1}));
      auto flat = at::cat(flat_parts);
      group.broadcast(flat, 0, what);
      std::int64_t offset = 0;
      for (std::size_t i = first; i < last; ++i) {
        auto& t = same_kind[i];
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
}

#endif

}  // namespace accel::strategy
