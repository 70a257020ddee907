#pragma once
// accel::Trainer<Strategy, Precision, Device>: the Accelerator of
// HuggingFace Accelerate, with the strategy, precision and device chosen as
// compile-time policies. The trainer owns the process group and the strategy
// engine; the user keeps their model, optimizer and loop.
//
//   accel::Trainer<accel::DDP> trainer;            // was: Trainer<> (one process)
//   trainer.prepare(model, optimizer);
//   auto loader = trainer.prepare(dataset, {.batch_size = 64, .shuffle = true});
//   for (auto batch : loader)
//     trainer.step([&] { return loss_fn(model(batch.data), batch.target); });

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <torch/serialize.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <concepts>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "accel/checkpoint/files.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/comm/environment.hpp"
#include "accel/core/concepts.hpp"
#include "accel/core/policies.hpp"
#include "accel/core/rules.hpp"
#include "accel/data/loader.hpp"
#include "accel/device/device.hpp"
#include "accel/precision/autocast.hpp"
#include "accel/precision/loss_scaling.hpp"
#include "accel/strategy/ddp.hpp"
#include "accel/strategy/single_process.hpp"
#include "accel/strategy/zero.hpp"
#include "accel/strategy/zero3.hpp"
#include "accel/strategy/parallel.hpp"
#include "accel/strategy/hybrid_shard.hpp"

namespace accel {

using data::LoaderOptions;
using data::Sharding;

/// Settings of the run rather than of a policy.
struct TrainerOptions {
  /// Every collective (and the rendezvous) fails after this long instead of
  /// hanging; c10d's own default is 30 minutes.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// Micro-batches per optimizer step. Unset: ACCELERATE_GRADIENT_ACCUMULATION_STEPS
  /// (what `accel launch --gradient_accumulation_steps` sets), else 1.
  std::optional<int> gradient_accumulation_steps{};
  /// Where `save_state()` without a directory writes: project_dir/checkpoints/checkpoint_<n>.
  std::filesystem::path project_dir = ".";
  /// Keep at most this many automatically named checkpoints (0: keep all).
  int total_limit = 0;
};

/// Bytes of model state this rank holds (the ZeRO paper's accounting):
/// parameter storage, gradient storage, and the optimizer's per-element state
/// (scalar counters such as Adam's step are not counted).
struct ModelStateBytes {
  // Held on the training device (for a CPU device: all of it, except what
  // the offload fields below count).
  std::int64_t parameters = 0;
  std::int64_t gradients = 0;
  std::int64_t optimizer_state = 0;
  // Held in host memory by cpu_offload (NOTE [CPU offload]): the shards'
  // host twins the optimizer steps, their gradients, and the optimizer state.
  std::int64_t offloaded_parameters = 0;
  std::int64_t offloaded_gradients = 0;
  std::int64_t offloaded_optimizer_state = 0;
  std::int64_t total() const { return parameters + gradients + optimizer_state; }
  std::int64_t offloaded_total() const { return offloaded_parameters + offloaded_gradients + offloaded_optimizer_state; }
};

/// Thrown when the launcher's settings contradict the compiled policies.
class ConfigurationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <class T>
concept module_holder = requires(T& m) {
  { m.ptr() } -> std::convertible_to<std::shared_ptr<torch::nn::Module>>;
};

template <class T>
concept optimizer = std::derived_from<T, torch::optim::Optimizer>;

template <class T>
concept lr_scheduler = std::derived_from<T, torch::optim::LRScheduler>;

// The optimizer state tensors shaped like their parameter: read through the
// state's own serialisation, so any torch::optim optimizer is covered.
inline std::vector<at::Tensor> per_element_state(const torch::optim::OptimizerParamState& state,
                                                 const at::Tensor& param) {
  torch::serialize::OutputArchive out;
  state.serialize(out);
  std::stringstream buffer;
  out.save_to(buffer);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  std::vector<at::Tensor> tensors;
  for (const auto& key : in.keys()) {
    at::Tensor t;
    if (!in.try_read(key, t) || !t.defined()) continue;
    if (t.sizes() == param.sizes()) tensors.push_back(t);
  }
  return tensors;
}

inline int accumulation_steps(const std::optional<int>& configured) {
  auto from_env = comm::process_environment("ACCELERATE_GRADIENT_ACCUMULATION_STEPS");
  int steps = 1;
  if (configured) {
    steps = *configured;
  } else if (from_env) {
    try {
      steps = std::stoi(*from_env);
    } catch (const std::exception&) {
      throw ConfigurationError("accel: ACCELERATE_GRADIENT_ACCUMULATION_STEPS='" + *from_env + "' is not an integer");
    }
  }
  if (steps < 1)
    throw ConfigurationError("accel: gradient_accumulation_steps must be at least 1, got " + std::to_string(steps));
  return steps;
}

// Where an ACCELERATE_* variable set by `accel launch` disagrees with the
// compiled policy, say so instead of silently training in another precision.
template <class Precision>
void check_launcher_precision() {
  auto requested = comm::process_environment("ACCELERATE_MIXED_PRECISION");
  if (requested && *requested != Precision::name)
    throw ConfigurationError(std::string("accel: the launcher asked for mixed_precision=") + *requested +
                             " but this program's Trainer is compiled with mixed_precision=" + Precision::name +
                             ": change the Trainer's Precision policy or the --mixed_precision flag");
}

// `accel launch` with an fsdp_config exports FSDP_SHARDING_STRATEGY (a name,
// or Accelerate's older 1-4 numbering); it must name the compiled strategy.
template <class Strategy>
void check_launcher_sharding() {
  auto requested = comm::process_environment("FSDP_SHARDING_STRATEGY");
  if (!requested) return;
  static const char* numbered[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"};
  std::string name = *requested;
  if (name.size() == 1 && name[0] >= '1' && name[0] <= '4') name = numbered[name[0] - '1'];
  const char* compiled = nullptr;
  if constexpr (requires { Strategy::fsdp_sharding_strategy; }) compiled = Strategy::fsdp_sharding_strategy;
  if (compiled == nullptr || name != compiled)
    throw ConfigurationError("accel: the launcher asked for fsdp_sharding_strategy=" + name +
                             " but this program's Trainer strategy is " +
                             (compiled ? std::string("FSDP ") + compiled : std::string("not an FSDP strategy")) +
                             ": use accel::FSDP<accel::ShardingStrategy::" + name + "> or change the config");
}

// `accel launch` with an fsdp_config exports Accelerate's FSDP_* variables;
// as Accelerate's FSDP plugin does, they set the strategy's fields:
//   FSDP_OFFLOAD_PARAMS            true/false  -> cpu_offload (any ZeRO stage, HybridShard)
//   FSDP_AUTO_WRAP_POLICY          NO_WRAP | SIZE_BASED_WRAP | TRANSFORMER_BASED_WRAP   (ZeRO-3 units)
//   FSDP_MIN_NUM_PARAMS            an integer                                           (SIZE_BASED_WRAP)
//   FSDP_TRANSFORMER_CLS_TO_WRAP   class names, comma-separated                         (TRANSFORMER_BASED_WRAP)
// A value that cannot be read, or offload for a strategy that shards no
// optimizer state, is a ConfigurationError naming the variable.
inline bool launcher_flag(const char* name) {
  auto value = comm::process_environment(name);
  if (!value) return false;
  std::string v = *value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0" || v.empty()) return false;
  throw ConfigurationError(std::string("accel: ") + name + "='" + *value + "' is not true or false");
}

inline void apply_launcher_wrap_policy(ZeRO<3>& zero) {
  if (auto policy = comm::process_environment("FSDP_AUTO_WRAP_POLICY")) {
    if (*policy == "NO_WRAP") zero.auto_wrap_policy = AutoWrapPolicy::NO_WRAP;
    else if (*policy == "SIZE_BASED_WRAP") zero.auto_wrap_policy = AutoWrapPolicy::SIZE_BASED_WRAP;
    else if (*policy == "TRANSFORMER_BASED_WRAP") zero.auto_wrap_policy = AutoWrapPolicy::TRANSFORMER_BASED_WRAP;
    else
      throw ConfigurationError("accel: FSDP_AUTO_WRAP_POLICY='" + *policy +
                               "' is not NO_WRAP, SIZE_BASED_WRAP or TRANSFORMER_BASED_WRAP");
  }
  if (auto count = comm::process_environment("FSDP_MIN_NUM_PARAMS")) {
    std::size_t used = 0;
    long long n = -1;
    try {
      n = std::stoll(*count, &used);
    } catch (const std::exception&) {
    }
    if (n < 0 || used != count->size())
      throw ConfigurationError("accel: FSDP_MIN_NUM_PARAMS='" + *count + "' is not a non-negative integer");
    zero.min_num_params = n;
  }
  if (auto classes = comm::process_environment("FSDP_TRANSFORMER_CLS_TO_WRAP")) {
    zero.transformer_layer_cls_to_wrap.clear();
    std::stringstream list(*classes);
    for (std::string name; std::getline(list, name, ',');) {
      name.erase(0, name.find_first_not_of(" \t"));
      name.erase(name.find_last_not_of(" \t") + 1);
      if (!name.empty()) zero.transformer_layer_cls_to_wrap.push_back(name);
    }
  }
}

template <class Strategy>
Strategy with_launcher_fsdp_settings(Strategy strategy) {
  if constexpr (std::is_same_v<Strategy, ZeRO<3>>) apply_launcher_wrap_policy(strategy);
  if constexpr (requires { strategy.zero; }) apply_launcher_wrap_policy(strategy.zero);
  if (!launcher_flag("FSDP_OFFLOAD_PARAMS")) return strategy;
  if constexpr (requires { strategy.cpu_offload; }) strategy.cpu_offload = true;
  else if constexpr (requires { strategy.zero.cpu_offload; }) strategy.zero.cpu_offload = true;
  else
    throw ConfigurationError("accel: the launcher asked for fsdp_offload_params=true but this program's Trainer "
                             "strategy shards no optimizer state: use accel::ZeRO<N> or an accel::FSDP strategy");
  return strategy;
}

}  // namespace detail

template <class Strategy = SingleProcess, class Precision = FP32, class Device = CPU>
class Trainer : private detail::check_policies<Strategy, Precision, Device> {
 public:
  using strategy_type = Strategy;
  using precision_type = Precision;
  using device_type = Device;
  using engine_type = typename Strategy::template engine<Precision, Device>;

  explicit Trainer(Strategy strategy = {}, Precision precision = {}, Device device = {}, TrainerOptions options = {})
      : strategy_(detail::with_launcher_fsdp_settings(strategy)),
        precision_(precision),
        options_(options),
        world_(comm::world_from_environment()),
        device_(device::traits<Device>::resolve(world_)),
        comm_(connect(strategy_, world_, options_)),
        engine_(strategy_, comm_),
        scaling_(precision),
        accumulation_steps_(detail::accumulation_steps(options.gradient_accumulation_steps)) {
    (void)device;
    detail::check_launcher_precision<Precision>();
    detail::check_launcher_sharding<Strategy>();
  }
  explicit Trainer(TrainerOptions options) : Trainer(Strategy{}, Precision{}, Device{}, options) {}
  Trainer(Strategy strategy, TrainerOptions options) : Trainer(strategy, Precision{}, Device{}, options) {}

  // The strategy's autograd hooks point into the trainer.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // ------------------------------------------------------------ prepare
  /// Registers the model (moved to the device; under DDP rank 0's weights are
  /// broadcast and gradient hooks installed) and/or the optimizer.
  template <class... Objects>
    requires(sizeof...(Objects) > 0 &&
             ((detail::module_holder<Objects> || detail::optimizer<Objects> || detail::lr_scheduler<Objects>) && ...))
  void prepare(Objects&... objects) {
    // Models first: sharding strategies plan around the model, then rewire the optimizer.
    (prepare_model_if<Objects>(objects), ...);
    (prepare_rest_if<Objects>(objects), ...);
  }

  /// This rank's shard of `dataset`, batched (DistributedSampler semantics).
  template <data::batched_dataset Dataset>
  data::DataLoader<Dataset> prepare(Dataset dataset, LoaderOptions options) {
    auto position = std::make_shared<data::LoaderPosition>();
    loader_positions_.push_back(position);
    // Tensor and pipeline peers read the same samples: shard over the data group.
    auto& group = data_group();
    return data::DataLoader<Dataset>(std::move(dataset), options, group.size(), group.rank(), device_, cursor_,
                                     std::move(position));
  }

  // ------------------------------------------------------------ the step
  /// One micro-step: runs `forward` under autocast, then backward; on the
  /// micro-step that completes a gradient accumulation cycle (every one, by
  /// default) also the optimizer step, the scheduler step and zero_grad.
  /// Returns the loss as `forward` computed it.
  template <class F>
  at::Tensor step(F&& forward) {
    (void)detail::check_step_function<std::remove_reference_t<F>>::value;
    [[maybe_unused]] auto micro_step = accumulate();
    at::Tensor loss;
    {
      [[maybe_unused]] auto scope = autocast();
      if constexpr (requires { engine_.before_forward(); }) engine_.before_forward();
      loss = forward();
      if constexpr (requires { engine_.after_forward(); }) engine_.after_forward();
    }
    backward(loss);
    optimizer_step();
    zero_grad();
    return loss;
  }

  /// The batch form of step, for a prepared torch::nn::Sequential: forward
  /// `inputs`, `loss_fn(outputs, targets)`, backward, step. Under pipeline
  /// parallelism it runs the pipeline's schedule over this rank's stage and
  /// returns the loss every stage sees; elsewhere the same as step(lambda).
  template <class LossFn>
  double step(const at::Tensor& inputs, const at::Tensor& targets, LossFn&& loss_fn) {
    if constexpr (requires { engine_.pipelined(); }) {
      if (engine_.pipelined()) {
        [[maybe_unused]] auto micro_step = accumulate();
        double loss = 0;
        {
          [[maybe_unused]] auto scope = autocast();
          loss = engine_.pipeline_step(inputs, targets, loss_fn);
        }
        synchronized_ = false;
        optimizer_step();
        zero_grad();
        return loss;
      }
    }
    if (!sequential_)
      throw std::logic_error("accel: step(inputs, targets, loss_fn) needs a prepared torch::nn::Sequential");
    return step([&] { return loss_fn(sequential_->forward(inputs), targets); }).template item<double>();
  }

  /// The ranks that read different data: the mesh's data group under
  /// Parallel<>, every rank otherwise.
  comm::Communicator& data_group() {
    if constexpr (requires { engine_.data_group(); }) return engine_.data_group();
    else return comm_;
  }

  /// The group a model's tensor-parallel layers (accel::nn) communicate
  /// over: the mesh's tensor dimension under Parallel<>, one rank otherwise.
  comm::Communicator& tensor_group() {
    if constexpr (requires { engine_.tensor_group(); }) return engine_.tensor_group();
    else return solo_;
  }

  /// RAII scope of one micro-step, Accelerate's `with accelerator.accumulate(model)`:
  ///   { auto micro = trainer.accumulate(); trainer.backward(loss);
  ///     trainer.optimizer_step(); trainer.zero_grad(); }
  /// Decides whether this micro-step synchronises gradients: every
  /// `gradient_accumulation_steps`-th one, and the last batch of an epoch.
  class MicroStep {
   public:
    explicit MicroStep(Trainer& trainer) { trainer.begin_micro_step(); }
    ~MicroStep() {}  // user-provided: a scope object, which compilers must not call "unused"
    MicroStep(const MicroStep&) = delete;
    MicroStep& operator=(const MicroStep&) = delete;
  };
  [[nodiscard]] MicroStep accumulate() { return MicroStep(*this); }

  /// `loss.backward()` with the strategy's bookkeeping: the loss is divided
  /// by the accumulation steps (so k micro-batches equal one k times larger
  /// batch), scaled under FP16, and gradient communication is skipped on
  /// non-final micro-steps.
  void backward(const at::Tensor& loss) {
    synchronized_ = false;
    engine_.set_gradient_sync(sync_gradients_);
    at::Tensor scaled = accumulation_steps_ == 1 ? loss : loss / accumulation_steps_;
    scaled = scaling_.scale_loss(scaled);
    engine_.before_backward(scaled);
    scaled.backward();
  }

  /// On a synchronising micro-step: waits for gradient communication,
  /// unscales (FP16), then steps the optimizer unless a gradient overflowed
  /// on any rank, then the prepared scheduler. Elsewhere a no-op.
  void optimizer_step() {
    if (!sync_gradients_) return;
    auto& optimizer = require_optimizer();
    ensure_synchronized();
    step_was_skipped_ = scaling_.unscale(engine_.optimizer_parameters(), comm_);
    if (!step_was_skipped_) {
      optimizer.step();
      engine_.after_optimizer_step();
      if (scheduler_ != nullptr) {
        scheduler_->step();
        ++scheduler_steps_;
      }
    }
    scaling_.update();
    ++optimizer_steps_;
  }

  void zero_grad() {
    if (sync_gradients_) engine_.zero_grad(require_optimizer());
  }

  /// Whether this micro-step synchronises gradients and steps (Accelerate's
  /// `sync_gradients`).
  bool sync_gradients() const { return sync_gradients_; }
  int gradient_accumulation_steps() const { return accumulation_steps_; }
  /// Accelerate's `optimizer_step_was_skipped`: the last step found an
  /// inf/NaN gradient (FP16) and was skipped on every rank.
  bool optimizer_step_was_skipped() const { return step_was_skipped_; }
  /// Optimizer steps taken (skipped ones included): the training step count.
  std::int64_t completed_steps() const { return optimizer_steps_; }
  /// The FP16 loss scale (1 for the other precisions).
  double loss_scale() const { return scaling_.scale(); }

  /// Clips the gradients' global norm to `max_norm`, after communication
  /// and FP16 unscaling; returns the norm before clipping. Call it between
  /// backward and optimizer_step on a synchronising micro-step.
  double clip_grad_norm(double max_norm, double norm_type = 2.0) {
    prepare_gradients_for_clipping("clip_grad_norm");
    const auto& params = engine_.optimizer_parameters();
    if constexpr (!engine_type::shards_gradients) {
      return torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type);
    } else {
      // Each rank holds a shard: combine the shards' partial norms over ranks.
      const bool inf_norm = std::isinf(norm_type);
      double local = 0;
      for (const auto& p : params) {
        if (!p.grad().defined()) continue;
        const double n = p.grad().norm(norm_type).template item<double>();
        local = inf_norm ? std::max(local, n) : local + std::pow(n, norm_type);
      }
      double total = local;
      if (comm_.distributed()) {
        auto t = at::full({1}, local, at::TensorOptions().dtype(at::kDouble));
        if (inf_norm) {
          auto all = comm_.all_gather(t, "all-gather of gradient norm shards");
          for (auto& a : all) total = std::max(total, a.template item<double>());
        } else {
          comm_.all_reduce(t, "all-reduce of gradient norm shards");
          total = t.template item<double>();
        }
      }
      if (!inf_norm) total = std::pow(total, 1.0 / norm_type);
      const double coefficient = max_norm / (total + 1e-6);  // torch's clip_grad_norm_ formula
      if (coefficient < 1)
        for (const auto& p : params)
          if (p.grad().defined()) p.grad().mul_(coefficient);
      return total;
    }
  }

  /// Clamps every gradient element to [-value, value] (after communication
  /// and FP16 unscaling).
  void clip_grad_value(double value) {
    prepare_gradients_for_clipping("clip_grad_value");
    torch::nn::utils::clip_grad_value_(engine_.optimizer_parameters(), value);
  }

  /// The forward-pass autocast scope for this trainer's precision and device.
  precision::AutocastScope<Precision> autocast() const { return precision::AutocastScope<Precision>(device_.type()); }

  // ------------------------------------------------------------ collectives
  /// Every rank's `tensor` concatenated along dimension 0, in rank order.
  /// (Under Parallel<>, over the data group: tensor and pipeline peers hold
  /// the same samples, which would otherwise be gathered twice.)
  at::Tensor gather(const at::Tensor& tensor) {
    auto& group = data_group();
    if (!group.distributed()) return tensor;
    return at::cat(group.all_gather(tensor, "gather"), 0);
  }

  /// Like gather, but drops the samples the sampler repeated to even out the
  /// ranks, so that a metric over the result counts every sample once.
  /// `tensor`'s first dimension must be the current batch of the most
  /// recently iterated prepared loader.
  at::Tensor gather_for_metrics(const at::Tensor& tensor) {
    auto& group = data_group();
    if (!group.distributed()) return tensor;
    auto parts = group.all_gather(tensor, "gather_for_metrics");
    const auto& cursor = *cursor_;
    if (cursor.sampler == nullptr || tensor.size(0) != cursor.count) return at::cat(parts, 0);
    for (int r = 0; r < group.size(); ++r)
      parts[r] = parts[r].narrow(0, 0, cursor.sampler->real_in(r, cursor.first, cursor.count));
    return at::cat(parts, 0);
  }

  /// Sum (or mean, as floating point) of `tensor` over ranks; the input is
  /// left untouched.
  at::Tensor reduce(const at::Tensor& tensor, const std::string& op = "sum") {
    if (op != "sum" && op != "mean") throw std::invalid_argument("accel: reduce op must be \"sum\" or \"mean\"");
    at::Tensor out = tensor.clone();
    comm_.all_reduce(out, "reduce(" + op + ")");
    return op == "mean" ? out.div(num_processes()) : out;
  }

  void wait_for_everyone() { comm_.barrier(); }

  /// What this rank holds now: distinct storages of the prepared models'
  /// parameters, of every gradient (the model's and the optimizer's, shared
  /// storage counted once), and of the optimizer's per-element state.
  ModelStateBytes model_state_bytes() const {
    ModelStateBytes bytes;
    std::unordered_set<const void*> seen;
    auto count = [&](const at::Tensor& t, std::int64_t& into) {
      if (!t.defined() || !t.has_storage()) return;
      if (seen.insert(t.storage().unsafeGetStorageImpl()).second) into += static_cast<std::int64_t>(t.storage().nbytes());
    };
    std::unordered_set<const void*> host;  // the tensors cpu_offload steps in host memory
    if constexpr (requires { engine_.offloaded_parameters(); })
      for (const auto& p : engine_.offloaded_parameters()) {
        host.insert(p.unsafeGetTensorImpl());
        count(p, bytes.offloaded_parameters);
        count(p.grad(), bytes.offloaded_gradients);
      }
    for (const auto& model : models_)
      for (const auto& p : model->parameters()) count(p, bytes.parameters);
    for (const auto& p : engine_.optimizer_parameters()) count(p, bytes.parameters);  // ZeRO-3's own shards
    if constexpr (requires { engine_.device_shards(); })
      for (const auto& p : engine_.device_shards()) count(p, bytes.parameters);
    for (const auto& model : models_)
      for (const auto& p : model->parameters()) count(p.grad(), bytes.gradients);
    for (const auto& p : engine_.optimizer_parameters()) count(p.grad(), bytes.gradients);
    if constexpr (requires { engine_.device_shards(); })
      for (const auto& p : engine_.device_shards()) count(p.grad(), bytes.gradients);
    if (optimizer_ != nullptr)
      for (const auto& group : optimizer_->param_groups())
        for (const auto& p : group.params()) {
          auto it = optimizer_->state().find(compat::optimizer_state_key(*optimizer_, p));
          if (it == optimizer_->state().end()) continue;
          // Copies read back from the state's serialisation: sized, not deduplicated.
          auto& into = host.contains(p.unsafeGetTensorImpl()) ? bytes.offloaded_optimizer_state : bytes.optimizer_state;
          for (const auto& t : detail::per_element_state(*it->second, p))
            into += static_cast<std::int64_t>(t.numel() * t.element_size());
        }
    return bytes;
  }

  /// Accelerate's unwrap_model: the prepared model, whole, on every rank. A
  /// no-op for strategies that never split it; under ZeRO<3> it gathers the
  /// parameters for good and ends sharded training (every rank must call it).
  void unwrap_model() {
    if constexpr (requires { engine_.unshard_permanently(); }) engine_.unshard_permanently();
  }

  // ------------------------------------------------------------ checkpoints
  /// Saves everything needed to resume exactly (see NOTE [Checkpoint commit]):
  /// models, optimizer, scheduler, loss scaler, every rank's RNG state, the
  /// loaders' positions, step counters and registered objects.
  void save_state(const std::filesystem::path& dir) {
    namespace fs = std::filesystem;
    // Rank 0 decides (another rank could see the directory rank 0 just made).
    const bool replace = main_process_says(fs::exists(dir));
    const fs::path target = replace ? fs::path(dir.string() + ".staging") : dir;
    if (is_main_process()) {
      fs::remove_all(target);
      fs::create_directories(target);
    }
    wait_for_everyone();
    {
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::vector<at::Tensor> rng;
      {
        std::lock_guard<std::mutex> lock(generator.mutex());
        rng.push_back(generator.get_state());
      }
      torch::save(rng, (target / ("random_states_" + std::to_string(process_index()) + ".pt")).string());
    }
    if (optimizer_ != nullptr && engine_type::shards_gradients)  // each rank its own shard of the state
      torch::save(*optimizer_, (target / ("optimizer_shard_" + std::to_string(process_index()) + ".pt")).string());
    // ZeRO-3 holds only shards: every rank helps gather the full model first.
    if constexpr (requires { engine_.gather_full_parameters(); }) engine_.gather_full_parameters();
    if (is_main_process()) {
      for (std::size_t i = 0; i < models_.size(); ++i)
        torch::save(models_[i], (target / ("model_" + std::to_string(i) + ".pt")).string());
      if (optimizer_ != nullptr && !engine_type::shards_gradients)
        torch::save(*optimizer_, (target / "optimizer.pt").string());
      for (std::size_t i = 0; i < custom_.size(); ++i) {
        torch::serialize::OutputArchive archive;
        custom_[i].save(archive);
        archive.save_to((target / ("custom_checkpoint_" + std::to_string(i) + ".pt")).string());
      }
    }
    if constexpr (requires { engine_.release_full_parameters(false); }) engine_.release_full_parameters(false);
    wait_for_everyone();
    if (is_main_process()) {
      auto manifest = describe_state();
      manifest["files"] = checkpoint::file_sizes(target);
      checkpoint::write_atomically(target / checkpoint::manifest_name, manifest.dump(2));
      if (replace) {
        const fs::path old = dir.string() + ".old";
        fs::remove_all(old);
        fs::rename(dir, old);
        fs::rename(target, dir);
        fs::remove_all(old);
      }
    }
    wait_for_everyone();
  }

  /// Saves to options.project_dir/checkpoints/checkpoint_<n> (n counts up),
  /// keeping the newest `total_limit`; returns the directory.
  std::filesystem::path save_state() {
    const auto root = options_.project_dir / "checkpoints";
    auto existing = checkpoint::numbered_checkpoints(root);
    const long next = existing.empty() ? 0 : existing.back().first + 1;
    const auto dir = root / ("checkpoint_" + std::to_string(next));
    save_state(dir);
    existing.emplace_back(next, dir);
    if (is_main_process() && options_.total_limit > 0)
      while (static_cast<int>(existing.size()) > options_.total_limit) {
        std::filesystem::remove_all(existing.front().second);
        existing.erase(existing.begin());
      }
    wait_for_everyone();
    return dir;
  }

  /// Restores a checkpoint written by save_state, on any number of ranks for
  /// replicated strategies. Every rank checks it; if any rank cannot load it,
  /// all of them throw, naming the problem.
  void load_state(const std::filesystem::path& dir) {
    std::string error;
    try {
      load_state_here(dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (comm_.distributed()) {
      auto failed = at::full({1}, error.empty() ? 0.0f : 1.0f);
      comm_.all_reduce(failed, "agreement on load_state");
      if (error.empty() && failed.item<float>() > 0)
        error = "accel: another rank could not load checkpoint " + dir.string() + " (see its error)";
    }
    if (!error.empty()) throw checkpoint::CheckpointError("rank " + std::to_string(process_index()) + ": " + error);
  }

  /// Saves `object` (anything with `save(OutputArchive&)` and
  /// `load(InputArchive&)`: a module, an optimizer, ...) with every checkpoint.
  template <class T>
    requires requires(T& t, torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in) {
      t.save(out);
      t.load(in);
    }
  void register_for_checkpointing(T& object) {
    custom_.push_back({[&object](torch::serialize::OutputArchive& a) { object.save(a); },
                       [&object](torch::serialize::InputArchive& a) { object.load(a); }});
  }

  // ------------------------------------------------------------ who am I
  at::Device device() const { return device_; }
  int process_index() const { return world_.rank; }
  int local_process_index() const { return world_.local_rank; }
  int num_processes() const { return world_.world_size; }
  bool is_main_process() const { return world_.rank == 0; }
  bool is_local_main_process() const { return world_.local_rank == 0; }

  /// Prints on the main process only (one line, space-separated).
  template <class... Args>
  void print(const Args&... args) const {
    if (!is_main_process()) return;
    std::ostringstream line;
    ((line << args << ' '), ...);
    std::string text = line.str();
    if (!text.empty()) text.back() = '\n';
    std::cout << text << std::flush;
  }

  /// Seeds LibTorch's generators; `device_specific` adds the rank, as in
  /// Accelerate's set_seed.
  void set_seed(std::uint64_t seed, bool device_specific = false) const {
    at::manual_seed(seed + (device_specific ? static_cast<std::uint64_t>(process_index()) : 0));
  }

  // ------------------------------------------------------------ internals, for tests and benchmarks
  engine_type& strategy_engine() { return engine_; }
  comm::Communicator& communicator() { return comm_; }
  const TrainerOptions& options() const { return options_; }

 private:
  static comm::Communicator connect(const Strategy& strategy, const comm::WorldInfo& world,
                                    const TrainerOptions& options) {
    if constexpr (requires { engine_type::check_world(strategy, world.world_size); })
      engine_type::check_world(strategy, world.world_size);
    if constexpr (!Strategy::distributed) {
      if (world.world_size > 1)
        throw ConfigurationError("accel: WORLD_SIZE=" + std::to_string(world.world_size) +
                                 " but this Trainer's strategy is SingleProcess, which would train " +
                                 std::to_string(world.world_size) +
                                 " independent copies: use accel::DDP, or launch one process");
      return comm::Communicator{};
    } else {
      return comm::Communicator::connect(world, device::traits<Device>::backend, options.timeout);
    }
  }

  template <class T>
  void prepare_model_if(T& object) {
    if constexpr (detail::module_holder<T>) {
      object->to(device_);
      engine_.prepare_model(*object.ptr());
      models_.push_back(object.ptr());
      if constexpr (std::is_same_v<T, torch::nn::Sequential>) sequential_ = object;
    }
  }

  template <class T>
  void prepare_rest_if(T& object) {
    if constexpr (detail::optimizer<T>) {
      if (optimizer_ != nullptr) throw std::logic_error("accel: prepare() takes one optimizer per Trainer");
      engine_.prepare_optimizer(object);
      optimizer_ = &object;
    } else if constexpr (detail::lr_scheduler<T>) {
      scheduler_ = &object;
    }
  }

  void begin_micro_step() {
    const auto& cursor = *cursor_;
    const bool end_of_epoch = cursor.sampler != nullptr && cursor.last_in_epoch;
    if (end_of_epoch) {
      micro_steps_ = 0;
      sync_gradients_ = true;
    } else {
      ++micro_steps_;
      sync_gradients_ = micro_steps_ % accumulation_steps_ == 0;
    }
  }

  void ensure_synchronized() {
    if (synchronized_) return;
    engine_.synchronize_gradients();
    synchronized_ = true;
  }

  void prepare_gradients_for_clipping(const char* what) {
    if (!sync_gradients_)
      throw std::logic_error(std::string("accel: ") + what +
                             " on a micro-step that does not synchronise gradients: call it only when "
                             "trainer.sync_gradients() is true");
    ensure_synchronized();
    scaling_.unscale(engine_.optimizer_parameters(), comm_);
  }

  static int saved_world_size(const nlohmann::json& manifest) { return manifest.at("world_size").get<int>(); }

  // NOTE [Resharding optimizer state]
  // A ZeRO checkpoint holds one optimizer file per saved rank, each with the
  // state of that rank's shard of every bucket. To resume on another number
  // of ranks, each rank loads every saved file into the user's optimizer
  // (pointed for the moment at stand-in tensors of the saved shard sizes),
  // reads each state back through its own serialisation, concatenates the
  // per-element tensors of all saved shards, drops the old padding, pads for
  // the new world size and keeps its own slice; other entries (Adam's step)
  // are taken from saved rank 0. Any elementwise torch::optim optimizer works.
  void reshard_optimizer_state(const std::filesystem::path& dir, int saved_shards, const std::vector<std::int64_t>& numels) {
    auto& optimizer = *optimizer_;
    const auto& mine = engine_.optimizer_parameters();  // (shard,) per bucket, for the current world size
    auto& groups = optimizer.param_groups();
    std::vector<std::vector<at::Tensor>> original;
    for (auto& group : groups) original.push_back(group.params());
    auto bucket_of = [&](const at::Tensor& t) {
      for (std::size_t b = 0; b < mine.size(); ++b)
        if (mine[b].is_same(t)) return b;
      throw std::logic_error("accel: optimizer parameter that is no ZeRO shard");
    };
    auto key = [&](const at::Tensor& t) { return compat::optimizer_state_key(optimizer, t); };
    // saved[s][b]: saved rank s's state of bucket b, serialised; proto[b]: a state object of the right type
    std::vector<std::vector<std::string>> saved(saved_shards, std::vector<std::string>(mine.size()));
    std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> proto(mine.size());
    for (int s = 0; s < saved_shards; ++s) {
      std::vector<at::Tensor> stand_in(mine.size());
      for (std::size_t b = 0; b < mine.size(); ++b) {
        const std::int64_t padded = (numels[b] + saved_shards - 1) / saved_shards * saved_shards;
        stand_in[b] = at::zeros({padded / saved_shards}, mine[b].options());
      }
      for (std::size_t g = 0; g < groups.size(); ++g) {
        groups[g].params().clear();
        for (const auto& p : original[g]) groups[g].params().push_back(stand_in[bucket_of(p)]);
      }
      optimizer.state().clear();
      torch::load(optimizer, (dir / ("optimizer_shard_" + std::to_string(s) + ".pt")).string());
      for (std::size_t b = 0; b < mine.size(); ++b) {
        auto it = optimizer.state().find(key(stand_in[b]));
        if (it == optimizer.state().end()) continue;  // never stepped
        torch::serialize::OutputArchive out;
        it->second->serialize(out);
        std::ostringstream bytes;
        out.save_to(bytes);
        saved[s][b] = bytes.str();
        if (s == 0) proto[b] = it->second->clone();
      }
    }
    optimizer.state().clear();
    for (std::size_t g = 0; g < groups.size(); ++g) groups[g].params() = original[g];
    const int shards_now = engine_.shard_count(), rank = engine_.shard_rank();
    for (std::size_t b = 0; b < mine.size(); ++b) {
      if (!proto[b]) continue;
      std::vector<torch::serialize::InputArchive> shards(saved_shards);
      for (int s = 0; s < saved_shards; ++s) {
        std::istringstream bytes(saved[s][b]);
        shards[s].load_from(bytes);
      }
      const std::int64_t saved_shard = (numels[b] + saved_shards - 1) / saved_shards;
      const std::int64_t shard = mine[b].numel();
      torch::serialize::OutputArchive merged;
      for (const auto& name : shards[0].keys()) {
        c10::IValue first;
        shards[0].read(name, first);
        if (first.isTensor() && first.toTensor().dim() == 1 && first.toTensor().numel() == saved_shard) {
          std::vector<at::Tensor> parts;
          for (int s = 0; s < saved_shards; ++s) {
            c10::IValue part;
            shards[s].read(name, part);
            parts.push_back(part.toTensor());
          }
          // (numels[b],) the whole bucket's state, then (shard,) this rank's slice of it re-padded
          auto full = at::cat(parts).narrow(0, 0, numels[b]);
          auto padded = at::zeros({shard * shards_now}, full.options());
          padded.narrow(0, 0, numels[b]).copy_(full);
          merged.write(name, padded.narrow(0, rank * shard, shard).clone());
        } else {
          merged.write(name, first);
        }
      }
      std::stringstream bytes;
      merged.save_to(bytes);
      torch::serialize::InputArchive in;
      in.load_from(bytes);
      proto[b]->serialize(in);
      optimizer.state()[key(mine[b])] = std::move(proto[b]);
    }
  }

  // A flag as rank 0 sees it, on every rank.
  bool main_process_says(bool flag) {
    if (!comm_.distributed()) return flag;
    auto value = at::full({1}, flag ? 1.0f : 0.0f);
    comm_.broadcast(value, 0, "broadcast of rank 0's decision");
    return value.item<float>() != 0.0f;
  }

  // Module::load would `set_` each parameter to the loaded storage; copying
  // the values in place keeps every tensor's identity (DDP's gradient hooks
  // and the optimizer's state refer to them).
  static void load_in_place(torch::nn::Module& module, torch::serialize::InputArchive& archive) {
    for (auto& item : module.named_parameters(/*recurse=*/false)) {
      at::Tensor saved;
      archive.read(item.key(), saved);
      item.value().copy_(saved);
    }
    for (auto& item : module.named_buffers(/*recurse=*/false)) {
      at::Tensor saved;
      archive.read(item.key(), saved, /*is_buffer=*/true);
      item.value().copy_(saved);
    }
    for (auto& child : module.named_children()) {
      torch::serialize::InputArchive sub;
      archive.read(child.key(), sub);
      load_in_place(*child.value(), sub);
    }
  }

  nlohmann::json describe_state() const {
    nlohmann::json m;
    m["format_version"] = checkpoint::format_version;
    m["world_size"] = num_processes();
    m["replicated"] = !engine_type::shards_gradients;
    if constexpr (engine_type::shards_gradients) {
      m["bucket_numels"] = engine_.bucket_numels();
      m["shard_count"] = engine_.shard_count();
    }
    m["mixed_precision"] = Precision::name;
    m["optimizer_steps"] = optimizer_steps_;
    m["micro_steps"] = micro_steps_;
    m["scheduler_steps"] = scheduler_steps_;
    m["loss_scale"] = scaling_.state().scale;
    m["growth_tracker"] = scaling_.state().growth_tracker;
    m["has_optimizer"] = optimizer_ != nullptr;
    m["custom_objects"] = custom_.size();
    m["models"] = nlohmann::json::array();
    for (const auto& model : models_) {
      nlohmann::json shapes = nlohmann::json::object();
      for (const auto& item : model->named_parameters()) shapes[item.key()] = item.value().sizes().vec();
      m["models"].push_back(shapes);
    }
    m["loaders"] = nlohmann::json::array();
    for (const auto& weak : loader_positions_) {
      auto position = weak.lock();
      if (!position) continue;
      m["loaders"].push_back({{"epoch", position->epoch}, {"next_batch", position->next_batch},
                              {"batch_size", position->batch_size}});
    }
    return m;
  }

  void load_state_here(const std::filesystem::path& dir) {
    namespace fs = std::filesystem;
    const auto m = checkpoint::read_manifest(dir);
    const auto where = "accel: checkpoint " + dir.string() + ": ";
    if (m.at("models").size() != models_.size())
      throw checkpoint::CheckpointError(where + "holds " + std::to_string(m.at("models").size()) +
                                        " model(s) but " + std::to_string(models_.size()) + " were prepared");
    for (std::size_t i = 0; i < models_.size(); ++i) {
      const auto& saved = m.at("models")[i];
      for (const auto& item : models_[i]->named_parameters()) {
        if (!saved.contains(item.key()))
          throw checkpoint::CheckpointError(where + "model " + std::to_string(i) + " has no parameter '" + item.key() + "'");
        const auto shape = saved.at(item.key()).get<std::vector<std::int64_t>>();
        if (shape != item.value().sizes().vec())
          throw checkpoint::CheckpointError(where + "parameter '" + item.key() + "' has shape " +
                                            saved.at(item.key()).dump() + " in the checkpoint but " +
                                            c10::str(item.value().sizes()) + " in the prepared model");
      }
    }
    if (m.value("mixed_precision", "") != std::string(Precision::name) && std::string(Precision::name) == "fp16")
      throw checkpoint::CheckpointError(where + "was written without FP16 loss scaling; this Trainer is FP16");
    const std::int64_t saved_scheduler_steps = m.at("scheduler_steps").get<std::int64_t>();
    if (scheduler_ != nullptr && scheduler_steps_ > saved_scheduler_steps)
      throw checkpoint::CheckpointError(where + "call load_state before training: the scheduler has already stepped");
    // Restoring must not be recorded by autograd, and must write in place
    // (DDP's gradient views and the optimizer refer to these tensors).
    c10::NoGradGuard no_grad;
    if constexpr (requires { engine_.gather_full_parameters(); }) engine_.gather_full_parameters();
    for (std::size_t i = 0; i < models_.size(); ++i) {
      torch::serialize::InputArchive archive;
      archive.load_from((dir / ("model_" + std::to_string(i) + ".pt")).string());
      load_in_place(*models_[i], archive);
    }
    if constexpr (requires { engine_.release_full_parameters(true); }) engine_.release_full_parameters(true);
    if constexpr (requires { engine_.parameters_loaded(); }) engine_.parameters_loaded();  // cpu_offload's host twins
    // LibTorch's LRScheduler exposes no state: replay its steps (the
    // optimizer's learning rates are then overwritten by the saved ones).
    if (scheduler_ != nullptr)
      for (; scheduler_steps_ < saved_scheduler_steps; ++scheduler_steps_) scheduler_->step();
    if (optimizer_ != nullptr) {
      if (!m.value("has_optimizer", false))
        throw checkpoint::CheckpointError(where + "holds no optimizer state, but an optimizer was prepared");
      const bool sharded = !m.at("replicated").get<bool>();
      if (sharded != engine_type::shards_gradients)
        throw checkpoint::CheckpointError(
            where + (sharded ? "holds ZeRO-sharded optimizer state; load it with a ZeRO strategy"
                             : "holds unsharded (DDP) optimizer state; load it with DDP or SingleProcess"));
      if constexpr (engine_type::shards_gradients) {
        const auto numels = m.at("bucket_numels").get<std::vector<std::int64_t>>();
        if (numels != engine_.bucket_numels())
          throw checkpoint::CheckpointError(where + "its ZeRO buckets hold " + m.at("bucket_numels").dump() +
                                            " elements, this trainer's a different layout: use the same "
                                            "bucket_cap_mb and model");
        // Shard s of a saved job is in the file of its rank s (the first
        // shard group's, under HybridShard, whose replicas hold the same).
        const int saved_shards = m.at("shard_count").get<int>();
        if (saved_shards == engine_.shard_count())
          torch::load(*optimizer_, (dir / ("optimizer_shard_" + std::to_string(engine_.shard_rank()) + ".pt")).string());
        else
          reshard_optimizer_state(dir, saved_shards, numels);
      } else {
        torch::load(*optimizer_, (dir / "optimizer.pt").string());
      }
    }
    if (m.at("custom_objects").get<std::size_t>() != custom_.size())
      throw checkpoint::CheckpointError(where + "holds " + m.at("custom_objects").dump() +
                                        " registered object(s) but " + std::to_string(custom_.size()) +
                                        " are registered");
    for (std::size_t i = 0; i < custom_.size(); ++i) {
      torch::serialize::InputArchive archive;
      archive.load_from((dir / ("custom_checkpoint_" + std::to_string(i) + ".pt")).string());
      custom_[i].load(archive);
    }
    scaling_.load_state({m.at("loss_scale").get<double>(), m.at("growth_tracker").get<std::int64_t>()});
    // Each rank its own RNG stream; on more ranks than saved, rank r takes r mod saved.
    const int saved_world = saved_world_size(m);
    {
      std::vector<at::Tensor> rng;
      torch::load(rng, (dir / ("random_states_" + std::to_string(process_index() % saved_world) + ".pt")).string());
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(rng.at(0));
    }
    // Data position: in samples read by all ranks together, so that a run
    // resumed on another number of ranks skips what the whole job had read.
    std::size_t k = 0;
    for (const auto& weak : loader_positions_) {
      auto position = weak.lock();
      if (!position) continue;
      if (k >= m.at("loaders").size())
        throw checkpoint::CheckpointError(where + "holds the position of " + std::to_string(m.at("loaders").size()) +
                                          " data loader(s) but more were prepared");
      const auto& saved = m.at("loaders")[k++];
      const std::int64_t read = saved.at("next_batch").get<std::int64_t>() *
                                saved.at("batch_size").get<std::int64_t>() * saved_world;
      position->epoch = saved.at("epoch").get<std::int64_t>();
      position->skip = read / (position->batch_size * num_processes());
      position->next_batch = position->skip;
    }
    optimizer_steps_ = m.at("optimizer_steps").get<std::int64_t>();
    micro_steps_ = m.at("micro_steps").get<int>();
  }

  torch::optim::Optimizer& require_optimizer() {
    if (optimizer_ == nullptr)
      throw std::logic_error("accel: no optimizer was prepared: call trainer.prepare(model, optimizer) first");
    return *optimizer_;
  }

  Strategy strategy_;
  Precision precision_;
  TrainerOptions options_;
  comm::WorldInfo world_;
  at::Device device_;
  comm::Communicator comm_;
  engine_type engine_;
  precision::LossScaling<Precision> scaling_;
  int accumulation_steps_ = 1;
  int micro_steps_ = 0;
  bool sync_gradients_ = true;
  bool synchronized_ = false;
  bool step_was_skipped_ = false;
  std::int64_t optimizer_steps_ = 0;
  std::int64_t scheduler_steps_ = 0;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  torch::optim::LRScheduler* scheduler_ = nullptr;
  torch::nn::Sequential sequential_{nullptr};
  comm::Communicator solo_;  // the one-rank tensor group of strategies without tensor parallelism
  struct CustomObject {
    std::function<void(torch::serialize::OutputArchive&)> save;
    std::function<void(torch::serialize::InputArchive&)> load;
  };
  std::vector<CustomObject> custom_;
  std::vector<std::weak_ptr<data::LoaderPosition>> loader_positions_;
  std::shared_ptr<data::LoaderCursor> cursor_ = std::make_shared<data::LoaderCursor>();
};

}  // namespace accel
