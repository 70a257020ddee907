#pragma once
// DDP: every rank holds the whole model; gradients are averaged over ranks by
// bucketed all-reduces that start during backward.
//
// NOTE [DDP buckets]
// Parameters are assigned to buckets in reverse registration order (roughly
// the order backward produces their gradients), the first bucket capped at
// `first_bucket_cap_mb` so communication starts early, the rest at
// `bucket_cap_mb` (PyTorch's Reducer). Each bucket owns one flat buffer and
// every parameter's `.grad` is a view into it, so autograd accumulates
// straight into the buffer the all-reduce sends: no packing copy. A post-hook
// on each parameter's AccumulateGrad node marks it ready; when a bucket's last
// parameter is ready and every earlier bucket has been launched, its
// all-reduce is issued asynchronously (launch order is the bucket order on
// every rank, whatever order the hooks fire in). `synchronize_gradients`
// waits for them all before the optimizer step.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/policies.hpp"

namespace accel::strategy {

/// What the DDP engine did during a backward pass, in order (recorded only
/// when asked: tests use it to show that communication overlaps backward).
struct DDPEvent {
  enum Kind { gradient_ready, bucket_launched } kind;
  std::size_t index;  ///< parameter index or bucket index
};

namespace detail {

struct DDPBucket {
  at::Tensor flat;                   // (numel,) the gradients; every param's .grad is a view of it
  at::Tensor wire;                   // (numel,) fp16/bf16 copy sent under a comm hook, else undefined
  std::vector<std::size_t> params;   // indices into the engine's parameter list
  std::size_t pending = 0;           // parameters not yet ready in this backward
  comm::Pending work;
};

// State shared with the autograd hooks, which may outlive the engine.
struct DDPState {
  DDP settings;
  comm::Communicator* comm = nullptr;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> grad_views;  // params[i].grad() must alias this
  std::vector<std::size_t> bucket_of;
  std::vector<char> ready;
  std::vector<DDPBucket> buckets;
  std::size_t next_to_launch = 0;
  bool record = false;
  std::vector<DDPEvent> events;
  std::vector<char> unused;  // from the graph walk; reused every step under static_graph
  bool unused_known = false;
  bool sync = true;  // false on the non-final micro-steps of gradient accumulation (no_sync)

  // Autograd or the user may have replaced .grad (zero_grad(set_to_none), or
  // a fresh tensor stolen when .grad was undefined): put the values back into
  // the bucket and the view back on the parameter.
  void restore_grad_view(std::size_t i) {
    at::Tensor& grad = params[i].mutable_grad();
    if (grad.defined() && grad.is_same(grad_views[i])) return;
    if (grad.defined()) grad_views[i].copy_(grad);
    else grad_views[i].zero_();
    grad = grad_views[i];
  }

  void mark_ready(std::size_t i) {
    restore_grad_view(i);
    if (!sync) return;  // accumulate locally; the final micro-step communicates the sum
    if (ready[i])
      throw std::runtime_error("accel DDP: rank " + std::to_string(comm->rank()) + ": parameter '" + names[i] +
                               "' got its gradient twice in one backward (reentrant backward or activation "
                               "checkpointing needs DDP{.static_graph = true} semantics not supported here)");
    ready[i] = 1;
    if (record) events.push_back({DDPEvent::gradient_ready, i});
    auto& bucket = buckets[bucket_of[i]];
    if (--bucket.pending == 0) launch_ready();
  }

  void launch_ready() {
    while (next_to_launch < buckets.size() && buckets[next_to_launch].pending == 0) {
      auto& bucket = buckets[next_to_launch];
      if (comm->distributed()) {
        bucket.flat.div_(comm->size());  // pre-divide: Gloo has no AVG, and fp16 must not overflow
        at::Tensor& sent = bucket.wire.defined() ? bucket.wire.copy_(bucket.flat) : bucket.flat;
        bucket.work = comm->all_reduce_async(
            sent, "all-reduce of DDP gradient bucket " + std::to_string(next_to_launch) + " (" +
                      std::to_string(sent.numel() * sent.element_size()) + " bytes)");
      }
      if (record) events.push_back({DDPEvent::bucket_launched, next_to_launch});
      ++next_to_launch;
    }
  }
};

class ReadyHook final : public compat::PostHook {
 public:
  ReadyHook(std::weak_ptr<DDPState> state, std::size_t index) : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto state = state_.lock()) state->mark_ready(index_);
    return outputs;
  }

 private:
  std::weak_ptr<DDPState> state_;
  std::size_t index_;
};

}  // namespace detail

template <class Precision, class Device>
class DDPEngine {
 public:
  using settings_type = DDP;

  DDPEngine(const DDP& settings, comm::Communicator& comm) : state_(std::make_shared<detail::DDPState>()) {
    state_->settings = settings;
    state_->comm = &comm;
    if (settings.bucket_cap_mb <= 0 || settings.first_bucket_cap_mb <= 0)
      throw std::invalid_argument("accel DDP: bucket_cap_mb and first_bucket_cap_mb must be positive");
  }
  DDPEngine(const DDPEngine&) = delete;
  DDPEngine& operator=(const DDPEngine&) = delete;
  ~DDPEngine() {
    for (std::size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  }

  void prepare_model(torch::nn::Module& model) {
    if (!state_->params.empty()) throw std::logic_error("accel DDP: prepare() takes one model per Trainer");
    auto& s = *state_;
    for (auto& item : model.named_parameters()) {
      if (!item.value().requires_grad()) continue;
      s.names.push_back(item.key());
      s.params.push_back(item.value());
    }
    check_same_model_everywhere(model);
    broadcast_from_rank0(model);
    build_buckets();
    check_comm_hook_supported();
    register_hooks();
  }

  void before_backward(const at::Tensor& loss) {
    auto& s = *state_;
    if (!s.sync || !s.settings.find_unused_parameters) return;
    if (!s.unused_known || !s.settings.static_graph) {
      s.unused = find_unused(loss);
      s.unused_known = true;
    }
    for (std::size_t i = 0; i < s.params.size(); ++i)
      if (s.unused[i]) {
        s.grad_views[i].zero_();
        s.mark_ready(i);
      }
  }

  void synchronize_gradients() {
    auto& s = *state_;
    for (std::size_t i = 0; i < s.params.size(); ++i)
      if (!s.ready[i]) {
        reset();
        throw std::runtime_error("accel DDP: rank " + std::to_string(s.comm->rank()) + ": parameter '" + s.names[i] +
                                 "' received no gradient in this step; if some parameters are unused in a step, "
                                 "use DDP{.find_unused_parameters = true}");
      }
    for (auto& bucket : s.buckets) {
      bucket.work.wait();
      if (bucket.wire.defined() && s.comm->distributed()) bucket.flat.copy_(bucket.wire);
    }
    reset();
  }

  /// Gradient accumulation: with `false`, backward accumulates into the
  /// buckets without communicating (DDP's no_sync).
  void set_gradient_sync(bool sync) { state_->sync = sync; }

  void zero_grad(torch::optim::Optimizer&) {
    auto& s = *state_;
    for (auto& bucket : s.buckets) bucket.flat.zero_();
    for (std::size_t i = 0; i < s.params.size(); ++i) {
      at::Tensor& grad = s.params[i].mutable_grad();
      if (!grad.defined() || !grad.is_same(s.grad_views[i])) grad = s.grad_views[i];
    }
  }

  // ------------------------------------------------------------ introspection
  std::size_t bucket_count() const { return state_->buckets.size(); }
  /// Parameter names of bucket `b`, in the order they were assigned.
  std::vector<std::string> bucket_parameters(std::size_t b) const {
    std::vector<std::string> out;
    for (auto i : state_->buckets.at(b).params) out.push_back(state_->names[i]);
    return out;
  }
  void record_events(bool on) { state_->record = on; state_->events.clear(); }
  const std::vector<DDPEvent>& events() const { return state_->events; }

 private:
  void reset() {
    auto& s = *state_;
    std::fill(s.ready.begin(), s.ready.end(), 0);
    for (auto& bucket : s.buckets) bucket.pending = bucket.params.size();
    s.next_to_launch = 0;
  }

  // Different models on different ranks would make the broadcast below
  // corrupt memory or hang; compare a cheap signature first.
  void check_same_model_everywhere(torch::nn::Module& model) {
    auto& s = *state_;
    if (!s.comm->distributed()) return;
    std::int64_t count = 0, numel = 0, shape_hash = 0;
    for (auto& p : model.parameters()) {
      ++count;
      numel += p.numel();
      for (auto d : p.sizes()) shape_hash = (shape_hash * 1000003 + d) % 2147483647;
    }
    auto mine = at::tensor({count, numel, shape_hash, static_cast<std::int64_t>(model.buffers().size())});
    auto all = s.comm->all_gather(mine, "model signature check at prepare");
    for (int r = 0; r < s.comm->size(); ++r)
      if (!all[r].equal(all[0]))
        throw std::runtime_error("accel DDP: rank " + std::to_string(r) + "'s model (" +
                                 std::to_string(all[r][0].item<std::int64_t>()) + " parameters, " +
                                 std::to_string(all[r][1].item<std::int64_t>()) + " elements) differs from rank 0's (" +
                                 std::to_string(all[0][0].item<std::int64_t>()) + " parameters, " +
                                 std::to_string(all[0][1].item<std::int64_t>()) +
                                 " elements): every rank must build the same model");
  }

  // Gloo in LibTorch 1.13 cannot reduce bf16 (newer ones and NCCL can): ask
  // the backend once, at prepare, rather than fail in the middle of backward.
  void check_comm_hook_supported() {
    auto& s = *state_;
    if (s.settings.comm_hook != CommHook::bf16 || !s.comm->distributed()) return;
    auto probe = at::zeros({1}, s.params.front().options().dtype(at::kBFloat16).requires_grad(false));
    try {
      s.comm->all_reduce(probe, "bf16 support probe");
    } catch (const comm::CollectiveError& e) {
      throw std::runtime_error(std::string("accel DDP: comm_hook = CommHook::bf16, but this backend cannot all-reduce "
                                           "bf16 tensors (Gloo before LibTorch 2.x): use CommHook::fp16 or "
                                           "CommHook::none. Backend said: ") + e.what());
    }
  }

  // Rank 0's parameters and buffers everywhere, one broadcast per dtype.
  void broadcast_from_rank0(torch::nn::Module& model) {
    auto& s = *state_;
    if (!s.comm->distributed()) return;
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
    for (auto& group : by_dtype) {
      std::vector<at::Tensor> flat_parts;
      for (auto& t : group) flat_parts.push_back(t.reshape({-1}));
      auto flat = at::cat(flat_parts);
      s.comm->broadcast(flat, 0, "broadcast of rank 0's parameters at prepare");
      std::int64_t offset = 0;
      for (auto& t : group) {
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }

  void build_buckets() {
    auto& s = *state_;
    const std::size_t n = s.params.size();
    s.bucket_of.assign(n, 0);
    s.ready.assign(n, 0);
    s.grad_views.resize(n);
    constexpr double mib = 1024.0 * 1024.0;
    std::vector<std::vector<std::size_t>> groups;
    std::size_t bytes = 0;
    for (std::size_t k = n; k-- > 0;) {  // reverse registration order
      const auto& p = s.params[k];
      const double cap = (groups.size() <= 1 ? s.settings.first_bucket_cap_mb : s.settings.bucket_cap_mb) * mib;
      const std::size_t size = p.numel() * p.element_size();
      const bool other_kind = !groups.empty() && (s.params[groups.back().front()].scalar_type() != p.scalar_type() ||
                                                   s.params[groups.back().front()].device() != p.device());
      if (groups.empty() || other_kind || (bytes > 0 && static_cast<double>(bytes + size) > cap)) {
        groups.emplace_back();
        bytes = 0;
      }
      groups.back().push_back(k);
      bytes += size;
    }
    for (auto& members : groups) {
      std::int64_t numel = 0;
      for (auto i : members) numel += s.params[i].numel();
      detail::DDPBucket bucket;
      bucket.flat = at::zeros({numel}, s.params[members.front()].options().requires_grad(false));
      std::int64_t offset = 0;
      for (auto i : members) {
        auto& p = s.params[i];
        auto view = bucket.flat.narrow(0, offset, p.numel()).view(p.sizes());
        if (p.grad().defined()) view.copy_(p.grad());
        p.mutable_grad() = view;
        s.grad_views[i] = view;
        s.bucket_of[i] = s.buckets.size();
        offset += p.numel();
      }
      if (s.settings.comm_hook != CommHook::none)
        bucket.wire = at::empty({numel}, bucket.flat.options().dtype(
                                             s.settings.comm_hook == CommHook::fp16 ? at::kHalf : at::kBFloat16));
      bucket.params = members;
      bucket.pending = members.size();
      s.buckets.push_back(std::move(bucket));
    }
  }

  void register_hooks() {
    auto& s = *state_;
    for (std::size_t i = 0; i < s.params.size(); ++i) {
      // Keep the AccumulateGrad node alive: the variable holds it weakly, and
      // a new one (without our hook) would be made each step otherwise.
      auto accumulator = torch::autograd::impl::grad_accumulator(s.params[i]);
      hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<detail::ReadyHook>(state_, i)));
      accumulators_.push_back(std::move(accumulator));
    }
  }

  // Parameters whose AccumulateGrad node is not reachable from the loss.
  std::vector<char> find_unused(const at::Tensor& loss) const {
    auto& s = *state_;
    std::unordered_set<const torch::autograd::Node*> seen;
    std::vector<torch::autograd::Node*> stack;
    if (auto root = loss.grad_fn()) stack.push_back(root.get());
    while (!stack.empty()) {
      auto* node = stack.back();
      stack.pop_back();
      if (!seen.insert(node).second) continue;
      for (const auto& edge : node->next_edges())
        if (edge.function) stack.push_back(edge.function.get());
    }
    std::vector<char> unused(s.params.size(), 0);
    for (std::size_t i = 0; i < s.params.size(); ++i) unused[i] = !seen.count(accumulators_[i].get());
    return unused;
  }

  std::shared_ptr<detail::DDPState> state_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
};

}  // namespace accel::strategy
