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

#include <ATen/core/Tensor.h>
#include <torch/serialize.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <concepts>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "accel/checkpoint/accelerate_state.hpp"
#include "accel/checkpoint/save_model.hpp"
#include "accel/checkpoint/state.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/comm/environment.hpp"
#include "accel/core/concepts.hpp"
#include "accel/core/errors.hpp"
#include "accel/core/policies.hpp"
#include "accel/core/rules.hpp"
#include "accel/data/loader.hpp"
#include "accel/device/device.hpp"
#include "accel/device/out_of_memory.hpp"
#include "accel/launch/settings.hpp"
#include "accel/precision/autocast.hpp"
#include "accel/precision/loss_scaling.hpp"
#include "accel/strategy/autograd_graph.hpp"
#include "accel/strategy/engine.hpp"
#include "accel/strategy/gradient_norm.hpp"
#include "accel/strategy/memory.hpp"
#include "accel/strategy/single_process.hpp"  // the default strategy's; the others come with their headers
#include "accel/trainer_base.hpp"

namespace accel {

namespace detail {

// Whether the engine's definition was included (an incomplete type has no size).
template <class T>
concept defined = requires { sizeof(T); };

// The contract is checked only once the engine is there (else the sentence above says what to include).
template <class E, bool = defined<E>>
inline constexpr bool meets_contract = true;
template <class E>
inline constexpr bool meets_contract<E, true> = strategy::complete_engine<E>;

template <class T>
concept module_holder = requires(T& m) {
  { m.ptr() } -> std::convertible_to<std::shared_ptr<torch::nn::Module>>;
};

// The three ways C++ code holds a model: a TORCH_MODULE holder, the Module
// subclass object itself (`struct Net : torch::nn::Module`, owned by the
// caller), or a std::shared_ptr to one.
template <class T>
concept module_object = std::derived_from<T, torch::nn::Module>;

template <class T>
concept module_pointer = requires { typename T::element_type; } &&
                         std::same_as<T, std::shared_ptr<typename T::element_type>> &&
                         std::derived_from<typename T::element_type, torch::nn::Module>;

template <class T>
concept model = module_holder<T> || module_object<T> || module_pointer<T>;

// The model as the Trainer keeps it. An object the caller owns is not owned
// here (an aliasing pointer with no owner): the caller keeps it alive, as it
// keeps the optimizer.
template <model T>
std::shared_ptr<torch::nn::Module> module_of(T& m) {
  if constexpr (module_holder<T>) return m.ptr();
  else if constexpr (module_pointer<T>) return m;
  else return std::shared_ptr<torch::nn::Module>(std::shared_ptr<void>(), &m);
}

template <class T>
concept optimizer = std::derived_from<T, torch::optim::Optimizer>;

template <class T>
concept lr_scheduler = std::derived_from<T, torch::optim::LRScheduler>;

// LibTorch's LRScheduler keeps its optimizer private; its protected
// get_current_lrs() reads that optimizer's learning rates, and a pointer to
// it formed in a derived class reaches it on any scheduler.
struct SchedulerLearningRates : torch::optim::LRScheduler {
  static std::vector<double> of(const torch::optim::LRScheduler& scheduler) {
    return (scheduler.*&SchedulerLearningRates::get_current_lrs)();
  }
};

// Whether `scheduler` sets `optimizer`'s learning rates: the optimizer's are
// swapped for negative ones, which no optimizer's real learning rate is, read
// back through the scheduler and restored.
inline bool schedules(const torch::optim::LRScheduler& scheduler, torch::optim::Optimizer& optimizer) {
  auto& groups = optimizer.param_groups();
  if (groups.empty()) return false;
  std::vector<double> real, marked;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    real.push_back(groups[g].options().get_lr());
    marked.push_back(-1.0 - static_cast<double>(g));
    groups[g].options().set_lr(marked.back());
  }
  const auto seen = SchedulerLearningRates::of(scheduler);
  for (std::size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(real[g]);
  return seen == marked;
}

// A model built by device::build_on_meta: its parameters are meta tensors.
inline bool built_on_meta(const torch::nn::Module& model) {
  for (const auto& p : model.parameters())
    if (p.is_meta()) return true;
  return false;
}

}  // namespace detail

template <class Strategy = SingleProcess, class Precision = FP32, class Device = CPU>
class Trainer : private detail::check_policies<Strategy, Precision, Device>, public TrainerBase {
 public:
  using strategy_type = Strategy;
  using precision_type = Precision;
  using device_type = Device;
  using engine_type = typename Strategy::engine;
  static_assert(detail::defined<engine_type>,
                "accel: this Trainer's strategy engine is not included: include the strategy's header "
                "(DDP: <accel/strategy/ddp.hpp>; ZeRO<1>, ZeRO<2>, ZeRO<3>: <accel/strategy/zero.hpp>; "
                "HybridShard: <accel/strategy/hybrid_shard.hpp>; "
                "Parallel<>: <accel/strategy/parallel.hpp>) or <accel/accel.hpp>");
  static_assert(detail::meets_contract<engine_type>,
                "accel: this strategy's engine does not meet the engine contract (NOTE [Engine contract] in "
                "<accel/strategy/engine.hpp>)");

  explicit Trainer(Strategy strategy = {}, Precision precision = {}, Device device = {}, TrainerOptions options = {})
      : Trainer(Resolved{}, launch::with_launcher_fsdp_settings(strategy), precision, comm::world_from_environment(),
                std::move(options)) {
    (void)device;
  }
  explicit Trainer(TrainerOptions options) : Trainer(Strategy{}, Precision{}, Device{}, options) {}
  Trainer(Strategy strategy, TrainerOptions options) : Trainer(strategy, Precision{}, Device{}, options) {}

  // The strategy's autograd hooks point into the trainer.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // ------------------------------------------------------------ prepare
  /// Registers the models (moved to the device; under DDP rank 0's weights
  /// are broadcast and gradient hooks installed), optimizers and LR
  /// schedulers, in any order and over any number of calls, as Accelerate's
  /// prepare. A model may be a TORCH_MODULE holder (torch::nn::Linear, your
  /// TORCH_MODULE(Net)), a torch::nn::Module subclass object you own (kept
  /// by reference: it must outlive the Trainer) or a std::shared_ptr to one.
  /// Several models (a GAN's prepare(G, D, opt_G, opt_D)): each optimizer
  /// goes with the model whose parameters it steps, and each scheduler with
  /// the optimizer it was built on (NOTE [Several models]).
  template <class... Objects>
    requires(sizeof...(Objects) > 0)
  void prepare(Objects&... objects) {
    static_assert(((detail::model<Objects> || detail::optimizer<Objects> || detail::lr_scheduler<Objects>) && ...),
                  "accel: prepare() takes models, optimizers (torch::optim::Optimizer) and LR schedulers "
                  "(torch::optim::LRScheduler); a model as a TORCH_MODULE holder (torch::nn::Linear, "
                  "TORCH_MODULE(Net)), a torch::nn::Module subclass object you own (Net net; prepare(net)) or a "
                  "std::shared_ptr<Net>; a dataset goes in prepare(dataset, {.batch_size = ...})");
    // Models first: sharding strategies plan around the model, then rewire the optimizer.
    (prepare_model_if<Objects>(objects), ...);
    (prepare_optimizer_if<Objects>(objects), ...);
    (prepare_scheduler_if<Objects>(objects), ...);
  }

  // Datasets, samplers and iterables: TrainerBase::prepare.
  using TrainerBase::prepare;

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
      for (auto& engine : engines_) engine->before_forward();
      loss = forward();
      for (auto& engine : engines_) engine->after_forward();
    }
    backward(loss);
    for (std::size_t k = 0; k < optimizers_.size() || k == 0; ++k) step_optimizer(k);  // every prepared optimizer
    zero_grad();
    return loss;
  }

  /// The batch form of step, for a prepared torch::nn::Sequential: forward
  /// `inputs`, `loss_fn(outputs, targets)`, backward, step. Under pipeline
  /// parallelism it runs the pipeline's schedule over this rank's stage and
  /// returns the loss every stage sees; elsewhere the same as step(lambda).
  template <class LossFn>
  double step(const at::Tensor& inputs, const at::Tensor& targets, LossFn&& loss_fn) {
    if (engine().pipelined()) {
      [[maybe_unused]] auto micro_step = accumulate();
      double loss = 0;
      {
        [[maybe_unused]] auto scope = autocast();
        // As backward() would: the loss over the accumulation steps, scaled (FP16).
        loss = engine().pipeline_step(inputs, targets, loss_fn, scaling_.scale() / accumulation_steps_, sync_gradients_);
      }
      synchronized_.front() = false;
      optimizer_step();
      zero_grad();
      return loss;
    }
    if (!sequential_)
      throw std::logic_error("accel: step(inputs, targets, loss_fn) needs a prepared torch::nn::Sequential");
    return step([&] { return loss_fn(sequential_->forward(inputs), targets); }).template item<double>();
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
  /// non-final micro-steps and inside no_sync(). On a synchronising one the
  /// gradients are final when it returns, averaged over the data ranks
  /// (DDP's and Accelerate's contract: LibTorch's own clip_grad_norm_ or a
  /// read of `.grad()` sees what one process on the global batch would).
  /// Under BF16/FP16 the loss must come from a forward under autocast()
  /// (or step(lambda)): a forward in fp32 is refused here, never trained on
  /// silently (NOTE [Forward precision]). With several models, the models
  /// the loss reaches (NOTE [Several models]).
  void backward(const at::Tensor& loss) {
    check_forward_precision();
    const bool sync = (sync_gradients_ && no_sync_depth_ == 0) || sync_next_backward_;
    sync_next_backward_ = false;
    at::Tensor scaled = accumulation_steps_ == 1 ? loss : loss / accumulation_steps_;
    scaled = scaling_.scale_loss(scaled);
    const auto& reached = engines_reached_by(scaled);
    for (std::size_t i = 0; i < engines_.size(); ++i) {
      if (!reached[i]) {
        // A forward this backward does not reach (the generator's, under a detached
        // fake) releases what it gathered (ZeRO-3's units); its own backward re-gathers.
        engines_[i]->after_forward();
        continue;
      }
      synchronized_[i] = false;
      engines_[i]->set_gradient_sync(sync);
      engines_[i]->before_backward(scaled);
    }
    scaled.backward();
    if (sync)
      for (std::size_t i = 0; i < engines_.size(); ++i)
        if (reached[i]) ensure_synchronized(i);
    // A no_sync() backward on a step that synchronises leaves local gradients a synchronising backward must average.
    local_gradients_ = !sync && (local_gradients_ || sync_gradients_);
  }

  /// Accelerate's no_sync(model) / DDP's no_sync(): backward passes inside
  /// the scope accumulate gradients locally, without communication; the
  /// first synchronising backward after it averages everything accumulated.
  ///   { auto local = trainer.no_sync(); trainer.backward(loss); }
  class NoSync {
   public:
    explicit NoSync(Trainer& trainer) : trainer_(trainer) { ++trainer_.no_sync_depth_; }
    ~NoSync() { --trainer_.no_sync_depth_; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    Trainer& trainer_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  /// Accelerate's trigger_sync_in_backward: the next backward synchronises
  /// gradients even inside no_sync() or on an accumulating micro-step.
  void trigger_sync_in_backward() { sync_next_backward_ = true; }

  /// On a synchronising micro-step: waits for gradient communication,
  /// unscales (FP16), then steps the optimizer unless a gradient overflowed
  /// on any rank, then the prepared scheduler. Elsewhere a no-op.
  /// The prepared scheduler then steps as Accelerate's AcceleratedScheduler
  /// does: once per data rank (the global batch is that many per-rank
  /// batches), once under split_batches or with
  /// TrainerOptions::step_scheduler_with_optimizer off, never after a
  /// skipped step. With several optimizers prepared, name the one to step.
  void optimizer_step() {
    if (optimizers_.size() > 1)
      throw std::logic_error("accel: optimizer_step() with " + std::to_string(optimizers_.size()) +
                             " optimizers prepared: name the one to step, trainer.optimizer_step(optimizer)");
    step_optimizer(0);
  }
  /// The same for one of several prepared optimizers (a GAN's opt_D, then
  /// opt_G), each with its own scheduler; the loss scale (FP16) is updated
  /// after each, as Accelerate's AcceleratedOptimizer.step does.
  void optimizer_step(torch::optim::Optimizer& optimizer) { step_optimizer(index_of(optimizer)); }

  /// Zeroes the gradients of every prepared optimizer's models (on a
  /// synchronising micro-step; elsewhere they keep accumulating).
  void zero_grad() {
    if (!sync_gradients_) return;
    if (optimizers_.empty()) require_optimizer(0);
    for (auto& o : optimizers_)
      for (auto i : o.engines) engines_[i]->zero_grad(*o.optimizer);
    local_gradients_ = false;
  }
  /// The same for one optimizer's model (PyTorch's opt_D.zero_grad()).
  void zero_grad(torch::optim::Optimizer& optimizer) {
    if (!sync_gradients_) return;
    for (auto i : optimizers_[index_of(optimizer)].engines) engines_[i]->zero_grad(optimizer);
    local_gradients_ = false;
  }

  /// Whether this micro-step synchronises gradients and steps (Accelerate's
  /// `sync_gradients`).
  bool sync_gradients() const { return sync_gradients_; }
  int gradient_accumulation_steps() const { return accumulation_steps_; }
  /// Accelerate's `optimizer_step_was_skipped`: the last step found an
  /// inf/NaN gradient (FP16) and was skipped on every rank.
  bool optimizer_step_was_skipped() const { return step_was_skipped_; }
  /// The FP16 loss scale (1 for the other precisions).
  double loss_scale() const { return scaling_.scale(); }

  /// Clips the gradients' global norm to `max_norm`, after communication
  /// and FP16 unscaling; returns the norm before clipping. Call it between
  /// backward and optimizer_step on a synchronising micro-step. With several
  /// models, name the one (Accelerate's clip_grad_norm_(model.parameters(), ...)).
  double clip_grad_norm(double max_norm, double norm_type = 2.0) {
    if (models_.size() > 1)
      throw std::logic_error("accel: clip_grad_norm() with " + std::to_string(models_.size()) +
                             " models prepared: name the model whose gradients to clip, "
                             "trainer.clip_grad_norm(model, max_norm)");
    return clip_engine_norm(0, max_norm, norm_type);
  }
  /// The same for one of several prepared models: its own gradients' norm.
  template <detail::model Model>
  double clip_grad_norm(Model& model, double max_norm, double norm_type = 2.0) {
    return clip_engine_norm(engine_index_of(model), max_norm, norm_type);
  }

  /// Clamps every gradient element to [-value, value] (after communication
  /// and FP16 unscaling), of every prepared model.
  void clip_grad_value(double value) {
    for (std::size_t i = 0; i < engines_.size(); ++i) clip_engine_value(i, value);
  }
  /// The same for one of several prepared models.
  template <detail::model Model>
  void clip_grad_value(Model& model, double value) {
    clip_engine_value(engine_index_of(model), value);
  }

  /// The forward-pass autocast scope for this trainer's precision and device.
  precision::AutocastScope<Precision> autocast() const {
    autocast_seen_ = true;
    return precision::AutocastScope<Precision>(device_.type());
  }

  /// Accelerate's find_executable_batch_size: calls `attempt(batch_size)`
  /// from `starting_batch_size`, and after an out-of-memory error on any
  /// rank calls it again on every rank at 90% of the size, until it runs;
  /// returns what `attempt` returns. See <accel/device/out_of_memory.hpp>
  /// for what it can and cannot rescue.
  template <class Attempt>
  auto find_executable_batch_size(std::int64_t starting_batch_size, Attempt&& attempt,
                                  const std::function<std::int64_t(std::int64_t)>& reduce_batch_size =
                                      device::reduce_batch_size) {
    const auto release = [] {  // the caching allocator's freed blocks back to the driver (torch.cuda.empty_cache)
      if constexpr (std::is_same_v<Device, CUDA>) compat::cuda_empty_cache();
    };
    return device::find_executable_batch_size(comm_, starting_batch_size, std::forward<Attempt>(attempt), release,
                                              reduce_batch_size);
  }

  /// Accelerate's free_memory: forgets every prepared model, optimizer,
  /// scheduler, loader and registered object, takes the strategy's hooks off
  /// the models and drops its buckets and shards (a fresh engine), resets the
  /// step counters, and returns the device's cached blocks, so the Trainer
  /// can prepare the next ones (a search's next trial). Every rank calls it.
  /// The models are left whole and plain (ZeRO-3 gathers its shards back,
  /// as when a Trainer ends; a model built on meta goes back to meta).
  /// Loaders already returned keep working but are no longer saved in
  /// checkpoints.
  void free_memory() {
    if (no_sync_depth_ > 0) throw std::logic_error("accel: free_memory() inside a no_sync() scope: leave it first");
    while (!engines_.empty()) engines_.pop_back();  // the last first, the same order on every rank
    synchronized_.clear();
    add_engine();
    models_.clear();
    optimizers_.clear();
    orphan_schedulers_.clear();
    sequential_ = torch::nn::Sequential(nullptr);
    forget_prepared_data();
    scaling_ = precision::LossScaling<Precision>(precision_);
    sync_gradients_ = true;
    local_gradients_ = sync_next_backward_ = autocast_seen_ = step_was_skipped_ = false;
    if constexpr (std::is_same_v<Device, CUDA>) compat::cuda_empty_cache();
  }

  /// What this rank holds now: distinct storages of the prepared models'
  /// parameters, of every gradient (the model's and the optimizer's, shared
  /// storage counted once), and of the optimizers' per-element state;
  /// several models' summed.
  ModelStateBytes model_state_bytes() const {
    ModelStateBytes total;
    for (std::size_t i = 0; i < engines_.size(); ++i) {
      std::vector<std::shared_ptr<torch::nn::Module>> model;
      if (i < models_.size()) model.push_back(models_[i]);
      torch::optim::Optimizer* optimizer = nullptr;
      for (const auto& o : optimizers_)
        if (std::find(o.engines.begin(), o.engines.end(), i) != o.engines.end()) optimizer = o.optimizer;
      const auto& engine = *engines_[i];
      total += strategy::model_state_bytes(model, optimizer, engine.optimizer_parameters(),
                                           engine.offloaded_parameters(), engine.device_shards());
    }
    return total;
  }

  /// Host memory the engines keep for their step's buffers and no tensor
  /// uses now (NOTE [Buffers that live as long as the engine] in
  /// <accel/device/buffer_pool.hpp>): ZeRO-3 (and HybridShard) keep their
  /// gathered units, full gradient buckets and Gloo's receive buffers between
  /// steps instead of freeing them; the other strategies none. Between steps,
  /// what a rank holds is model_state_bytes() plus this.
  std::int64_t idle_buffer_bytes() const {
    std::int64_t total = 0;
    for (const auto& engine : engines_) total += engine->idle_buffer_bytes();
    return total;
  }

  /// Accelerate's unwrap_model: the prepared models, whole, on every rank. A
  /// no-op for strategies that never split them; under ZeRO<3> it gathers the
  /// parameters for good and ends sharded training (every rank must call it).
  void unwrap_model() {
    for (auto& engine : engines_) engine->unshard_permanently();
  }

  /// Accelerate's save_model: `model`'s weights as safetensors in `dir`
  /// (model.safetensors, or model-0000k-of-0000n.safetensors and their index
  /// past options.max_shard_size), dtype kept. Every rank calls it and writes
  /// what it holds (NOTE [Writing a model from its shards]): a sharded model
  /// is never gathered whole.
  template <detail::model Model>
  void save_model(Model& model, const std::filesystem::path& dir, const SaveModelOptions& options = {}) {
    const std::size_t i = engine_index_of(model);
    checkpoint::save_model(comm_, *engines_[i], *models_[i], dir, options);
  }

  /// Loads `model`'s weights from safetensors (a file, an index, or a
  /// directory of either: Hugging Face's layouts), by name (LoadOptions), into
  /// what each rank holds: under ZeRO<3> and HybridShard each rank reads only
  /// its shard's bytes, also for a model built with build_on_meta. Every rank
  /// calls it; all load or all throw, changing nothing.
  template <detail::model Model>
  LoadReport load_safetensors(Model& model, const std::filesystem::path& path, const LoadOptions& options = {}) {
    const std::size_t i = engine_index_of(model);
    return checkpoint::load_model(comm_, *engines_[i], *models_[i], path, options);
  }

  // ------------------------------------------------------------ checkpoints
  /// Saves everything needed to resume exactly (see NOTE [Checkpoint commit]):
  /// models, optimizer, scheduler, loss scaler, every rank's RNG state, the
  /// loaders' positions, step counters and registered objects.
  void save_state(const std::filesystem::path& dir) {
    auto view = checkpoint_view();
    checkpoint::save_state(view.trainer, dir);
  }

  /// Saves to options.project_dir/checkpoints/checkpoint_<n> (n counts up),
  /// keeping the newest `total_limit`; returns the directory.
  std::filesystem::path save_state() {
    return save_numbered_state([this](const std::filesystem::path& dir) { save_state(dir); });
  }

  /// Restores a checkpoint written by save_state, on any number of ranks for
  /// replicated strategies, or a directory the Python Accelerate's save_state
  /// wrote (NOTE [Resuming a Python Accelerate run]). Every rank checks it; if
  /// any rank cannot load it, all of them throw, naming the problem.
  void load_state(const std::filesystem::path& dir) {
    auto view = checkpoint_view();
    if (checkpoint::is_accelerate_state(dir))
      checkpoint::load_accelerate_state(view.trainer, dir);
    else
      checkpoint::load_state(view.trainer, dir);
    view.commit();
  }

  /// Resumes a restarted job (`accel launch --max_restarts`): loads the
  /// newest complete checkpoint under project_dir/checkpoints (a save that
  /// was killed midway is passed over) and returns its directory; loads
  /// nothing and returns nothing when there is none, a fresh start. Rank 0
  /// chooses, so every rank loads the same one. Call it where load_state
  /// would go: after preparing the models, optimizers and loaders.
  std::optional<std::filesystem::path> load_latest_state() {
    auto dir = checkpoint_to_resume();
    if (dir) load_state(*dir);
    return dir;
  }

  // ------------------------------------------------------------ internals, for tests and benchmarks
  /// The engine of the i-th prepared model.
  engine_type& strategy_engine(std::size_t model = 0) { return *engines_.at(model); }

 private:
  struct Resolved {};  // the strategy with the launcher's settings, the world from the environment
  Trainer(Resolved, Strategy strategy, Precision precision, comm::WorldInfo world, TrainerOptions options)
      : TrainerBase(std::move(options), world, device::traits<Device>::resolve(world),
                    [&strategy](const comm::WorldInfo& w, const TrainerOptions& o) { return connect(strategy, w, o); }),
        strategy_(strategy),
        precision_(precision),
        scaling_(precision),
        accumulation_steps_(launch::accumulation_steps(options_.gradient_accumulation_steps)) {
    add_engine();  // the first model's, there from the start (the mesh's groups are the engine's)
    launch::check_launcher_settings<Strategy, Precision>();
  }

  static comm::Communicator connect(const Strategy& strategy, const comm::WorldInfo& world,
                                    const TrainerOptions& options) {
    engine_type::check_world(strategy, world.world_size);
    if constexpr (!Strategy::distributed) {
      if (world.world_size > 1)
        throw ConfigurationError("accel: WORLD_SIZE=" + std::to_string(world.world_size) +
                                 " but this Trainer's strategy is SingleProcess, which would train " +
                                 std::to_string(world.world_size) +
                                 " independent copies: use accel::DDP, or launch one process");
      return comm::Communicator{};
    } else {
      auto comm = comm::Communicator::connect(world, device::traits<Device>::backend, options.timeout);
      comm.set_debug(launch::debug_mode(options.debug));
      return comm;
    }
  }

  // NOTE [Several models]
  // prepare(G, D, opt_G, opt_D), as Accelerate's prepare: each model gets an
  // engine of its own (its buckets, shards and hooks) on the Trainer's
  // communicator, and each optimizer goes with the engine of the model whose
  // parameters it steps (under a sharding strategy, exactly one model's: it
  // is rewired to that model's shards), and each scheduler with the optimizer
  // it was built on (prepare_scheduler_if). A backward synchronises the models
  // its loss reaches, found from the autograd graph before it runs, so the
  // discriminator's backward on a detached fake leaves the generator alone
  // and the generator's backward through the discriminator averages both. A
  // model whose optimizer does not step keeps its gradients until its
  // zero_grad, as in PyTorch. Under Parallel<> the mesh is cut around one
  // model: a second is refused at prepare.
  void add_engine() {
    engines_.push_back(std::make_unique<engine_type>(strategy_, comm_));
    synchronized_.push_back(false);
    if (engines_.size() == 1) use_groups(engines_.front()->data_group(), engines_.front()->tensor_group());
  }

  // The first model's engine: the one that holds the mesh and the pipeline.
  engine_type& engine() { return *engines_.front(); }

  template <class T>
  void prepare_model_if(T& object) {
    if constexpr (detail::model<T>) {
      std::shared_ptr<torch::nn::Module> module = detail::module_of(object);
      for (const auto& prepared : models_)
        if (prepared.get() == module.get()) throw std::logic_error("accel: prepare(): this model was already prepared");
      if (!models_.empty()) {
        if (engine().data_group() != nullptr)
          throw ConfigurationError("accel: Parallel<> cuts its device mesh and pipeline around one model; a second "
                                   "model needs a Trainer of its own (or one Module holding both)");
        add_engine();
      }
      auto& engine = *engines_[models_.size()];
      if (detail::built_on_meta(*module)) {
        engine.prepare_meta_model(*module, device_);  // its values computed where they are kept
      } else {
        module->to(device_);
        engine.prepare_model(*module);
      }
      models_.push_back(module);
      if (models_.size() == 1)
        if (auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module))
          sequential_ = torch::nn::Sequential(std::move(sequential));
    }
  }

  template <class T>
  void prepare_optimizer_if(T& object) {
    if constexpr (detail::optimizer<T>) {
      for (const auto& o : optimizers_)
        if (o.optimizer == &object) throw std::logic_error("accel: prepare(): this optimizer was already prepared");
      auto engines = engines_stepped_by(object);
      for (auto i : engines) engines_[i]->prepare_optimizer(object);
      optimizers_.push_back({&object, std::move(engines)});
      // A scheduler prepared before its optimizer (prepare(scheduler, optimizer)) joins it now.
      for (auto it = orphan_schedulers_.begin(); it != orphan_schedulers_.end(); ++it)
        if (detail::schedules(**it, object)) {
          optimizers_.back().scheduler = *it;
          orphan_schedulers_.erase(it);
          break;
        }
    }
  }

  // Each scheduler joins the optimizer it was built on, found by what it
  // reads (LibTorch keeps that optimizer private), whatever the order of the
  // prepare calls; one prepared before its optimizer waits for it.
  template <class T>
  void prepare_scheduler_if(T& object) {
    if constexpr (detail::lr_scheduler<T>) {
      for (const auto& o : optimizers_)
        if (o.scheduler == &object) throw std::logic_error("accel: prepare(): this scheduler was already prepared");
      for (auto& o : optimizers_)
        if (detail::schedules(object, *o.optimizer)) {
          if (o.scheduler != nullptr)
            throw std::logic_error("accel: prepare(): two LR schedulers set the same optimizer's learning rates; "
                                   "prepare one (torch::optim::LRScheduler steps one schedule per optimizer)");
          o.scheduler = &object;
          return;
        }
      orphan_schedulers_.push_back(&object);
    }
  }

  // A scheduler whose optimizer was never prepared would never step.
  void require_schedulers_paired() const {
    if (!orphan_schedulers_.empty())
      throw std::logic_error("accel: a prepared LR scheduler's optimizer was never prepared: prepare(optimizer) "
                             "too, so that the scheduler steps with it");
  }

  // Which models' engines an optimizer steps: the one prepared model, or
  // those whose parameters it holds.
  std::vector<std::size_t> engines_stepped_by(torch::optim::Optimizer& optimizer) const {
    if (models_.size() <= 1) {
      if (!optimizers_.empty())
        throw std::logic_error("accel: prepare(): a second optimizer over the same model: accel steps one optimizer "
                               "per model; use one optimizer with several parameter groups");
      return {0};
    }
    std::unordered_set<const void*> stepped;
    for (const auto& group : optimizer.param_groups())
      for (const auto& p : group.params()) stepped.insert(p.unsafeGetTensorImpl());
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < models_.size(); ++i)
      for (const auto& p : models_[i]->parameters())
        if (stepped.count(p.unsafeGetTensorImpl())) {
          out.push_back(i);
          break;
        }
    if (out.empty())
      throw std::logic_error("accel: prepare(): this optimizer steps none of the prepared models' parameters: prepare "
                             "its model before or with it (prepare(G, D, opt_G, opt_D))");
    if (engine_type::shards_optimizer_state && out.size() > 1)
      throw ConfigurationError("accel: prepare(): an optimizer over several prepared models' parameters, under a "
                               "sharding strategy that steps each model's own shards: give each model its optimizer "
                               "(as a GAN's opt_G and opt_D)");
    for (const auto& o : optimizers_)
      for (auto i : o.engines)
        if (std::find(out.begin(), out.end(), i) != out.end())
          throw std::logic_error("accel: prepare(): a second optimizer over model " + std::to_string(i) +
                                 ": accel steps one optimizer per model; use one optimizer with several parameter "
                                 "groups");
    return out;
  }

  std::size_t index_of(const torch::optim::Optimizer& optimizer) const {
    for (std::size_t k = 0; k < optimizers_.size(); ++k)
      if (optimizers_[k].optimizer == &optimizer) return k;
    throw std::logic_error("accel: this optimizer was not prepared: trainer.prepare(model, optimizer) first");
  }

  template <class Model>
  std::size_t engine_index_of(Model& model) const {
    const auto module = detail::module_of(model);
    for (std::size_t i = 0; i < models_.size(); ++i)
      if (models_[i].get() == module.get()) return i;
    throw std::logic_error("accel: this model was not prepared: trainer.prepare(model, optimizer) first");
  }

  // Per engine, whether the backward from `loss` reaches its model (all of
  // them when there is one: no graph walk, no allocation).
  const std::vector<char>& engines_reached_by(const at::Tensor& loss) {
    reached_.assign(engines_.size(), engines_.size() == 1 ? 1 : 0);
    if (engines_.size() == 1) return reached_;
    const auto nodes = strategy::reachable_nodes(loss);
    for (std::size_t i = 0; i < models_.size(); ++i)
      for (const auto& p : models_[i]->parameters())
        if (p.requires_grad() && strategy::reaches(nodes, p)) {
          reached_[i] = 1;
          break;
        }
    return reached_;
  }

  // The tensors optimizer k steps, as its engines hold them.
  std::vector<at::Tensor> stepped_parameters(std::size_t k) const {
    const auto& o = optimizers_[k];
    if (o.engines.size() == 1) return engines_[o.engines.front()]->optimizer_parameters();
    std::vector<at::Tensor> out;
    for (auto i : o.engines) {
      const auto& more = engines_[i]->optimizer_parameters();
      out.insert(out.end(), more.begin(), more.end());
    }
    return out;
  }

  void step_optimizer(std::size_t k) {
    if (!sync_gradients_) return;
    if (no_sync_depth_ > 0 || local_gradients_)
      throw std::logic_error(std::string("accel: optimizer_step() ") +
                             (no_sync_depth_ > 0 ? "inside no_sync()" : "after a backward inside no_sync()") +
                             ": those gradients were never averaged over the ranks; end the step with a "
                             "synchronising backward (outside no_sync(), or after trigger_sync_in_backward())");
    auto& o = require_optimizer(k);
    require_schedulers_paired();
    for (auto i : o.engines) ensure_synchronized(i);
    step_was_skipped_ = o.engines.size() == 1 ? scaling_.unscale(engines_[o.engines.front()]->optimizer_parameters(), comm_)
                                              : scaling_.unscale(stepped_parameters(k), comm_);
    if (!step_was_skipped_) {
      o.optimizer->step();
      for (auto i : o.engines) engines_[i]->after_optimizer_step();
      if (!o.stepped) {
        o.stepped = true;
        release_idle_host_blocks();
      }
      if (o.scheduler != nullptr)
        for (int n = scheduler_steps_per_optimizer_step(); n > 0; --n) {
          o.scheduler->step();
          ++o.scheduler_steps;  // a checkpoint replays the calls
        }
    }
    scaling_.update();
    if (k == 0) ++counters_.optimizer_steps;
    autocast_seen_ = false;
  }

  double clip_engine_norm(std::size_t i, double max_norm, double norm_type) {
    prepare_gradients_for_clipping("clip_grad_norm", i);
    return strategy::clip_grad_norm(engines_[i]->optimizer_parameters(), max_norm, norm_type,
                                    engines_[i]->norm_reduction());
  }

  void clip_engine_value(std::size_t i, double value) {
    prepare_gradients_for_clipping("clip_grad_value", i);
    torch::nn::utils::clip_grad_value_(engines_[i]->optimizer_parameters(), value);
  }

  void begin_micro_step() {
    const auto& cursor = *cursor_;
    const bool end_of_epoch = options_.sync_with_dataloader && cursor.batch >= 0 && cursor.last_in_epoch;
    if (end_of_epoch) {
      counters_.micro_steps = 0;
      sync_gradients_ = true;
    } else {
      ++counters_.micro_steps;
      sync_gradients_ = counters_.micro_steps % accumulation_steps_ == 0;
    }
  }

  // NOTE [Forward precision]
  // Accelerate wraps the model's forward in autocast at prepare. A C++
  // Module's forward is not virtual and cannot be wrapped, so a BF16/FP16
  // Trainer asks for the forward to run inside autocast() (step(lambda) does
  // it) and refuses a backward when no autocast scope was opened since the
  // last optimizer step and none is open: the loss would come from an fp32
  // forward and the run would silently train in fp32.
  void check_forward_precision() const {
    if constexpr (precision::uses_autocast<Precision>) {
      if (!autocast_seen_ && !compat::autocast_enabled(device_.type()))
        throw std::logic_error(
            std::string("accel: backward() on a Trainer with mixed_precision=") + Precision::name +
            " got a loss whose forward ran outside autocast, so in fp32: compute it inside "
            "`{ auto scope = trainer.autocast(); loss = ...; }` or use trainer.step([&] { return loss; })");
    }
  }

  void ensure_synchronized(std::size_t i) {
    if (synchronized_[i]) return;
    engines_[i]->synchronize_gradients();
    synchronized_[i] = true;
  }

  void prepare_gradients_for_clipping(const char* what, std::size_t i) {
    if (!sync_gradients_)
      throw std::logic_error(std::string("accel: ") + what +
                             " on a micro-step that does not synchronise gradients: call it only when "
                             "trainer.sync_gradients() is true");
    ensure_synchronized(i);
    scaling_.unscale(engines_[i]->optimizer_parameters(), comm_);
  }

  // The trainer as the checkpoint room sees it; commit() takes back what a
  // load changed in the loss scaler.
  struct CheckpointView {
    Trainer& self;
    precision::ScalerState scaler;
    checkpoint::TrainerView trainer;
    explicit CheckpointView(Trainer& t)
        : self(t),
          scaler(t.scaling_.state()),
          trainer{t.device_,         t.comm_,      t.data_group(), engine_hooks(t.engines_), Precision::name,
                  t.models_,         t.optimizer_views(), t.counters_, scaler,   t.custom_,
                  t.loader_positions_} {}
    void commit() { self.scaling_.load_state(scaler); }
    static std::vector<checkpoint::EngineHooks*> engine_hooks(std::vector<std::unique_ptr<engine_type>>& engines) {
      std::vector<checkpoint::EngineHooks*> out;
      for (auto& e : engines) out.push_back(e.get());
      return out;
    }
  };
  std::vector<checkpoint::OptimizerView> optimizer_views() {
    std::vector<checkpoint::OptimizerView> out;
    for (auto& o : optimizers_) out.push_back({o.optimizer, o.engines.front(), o.scheduler, &o.scheduler_steps});
    return out;
  }
  CheckpointView checkpoint_view() { return CheckpointView(*this); }

  struct PreparedOptimizer {
    torch::optim::Optimizer* optimizer = nullptr;
    std::vector<std::size_t> engines;  // the models it steps
    torch::optim::LRScheduler* scheduler = nullptr;
    std::int64_t scheduler_steps = 0;
    bool stepped = false;  // its first step is taken (its state exists)
  };

  PreparedOptimizer& require_optimizer(std::size_t k) {
    if (k >= optimizers_.size())
      throw std::logic_error("accel: no optimizer was prepared: call trainer.prepare(model, optimizer) first");
    return optimizers_[k];
  }

  Strategy strategy_;
  Precision precision_;
  std::vector<std::unique_ptr<engine_type>> engines_;  // engines_[i] trains models_[i]; [0] exists from the start
  std::vector<char> synchronized_;                     // per engine: its last backward's gradients waited for
  std::vector<char> reached_;                          // per engine: reached by the backward being run
  precision::LossScaling<Precision> scaling_;
  int accumulation_steps_ = 1;
  bool sync_gradients_ = true;
  int no_sync_depth_ = 0;
  bool local_gradients_ = false;  // a no_sync() backward since the last synchronising one
  bool sync_next_backward_ = false;
  mutable bool autocast_seen_ = false;  // an autocast() scope opened since the last optimizer step
  bool step_was_skipped_ = false;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  std::vector<PreparedOptimizer> optimizers_;
  std::vector<torch::optim::LRScheduler*> orphan_schedulers_;  // prepared before their optimizer
  torch::nn::Sequential sequential_{nullptr};
};

}  // namespace accel
