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

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <chrono>
#include <concepts>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

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

namespace accel {

using data::LoaderOptions;

/// Settings of the run rather than of a policy.
struct TrainerOptions {
  /// Every collective (and the rendezvous) fails after this long instead of
  /// hanging; c10d's own default is 30 minutes.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// Micro-batches per optimizer step. Unset: ACCELERATE_GRADIENT_ACCUMULATION_STEPS
  /// (what `accel launch --gradient_accumulation_steps` sets), else 1.
  std::optional<int> gradient_accumulation_steps;
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

}  // namespace detail

template <class Strategy = SingleProcess, class Precision = FP32, class Device = CPU>
class Trainer : private detail::check_policies<Strategy, Precision, Device> {
 public:
  using strategy_type = Strategy;
  using precision_type = Precision;
  using device_type = Device;
  using engine_type = typename Strategy::template engine<Precision, Device>;

  explicit Trainer(Strategy strategy = {}, Precision precision = {}, Device device = {}, TrainerOptions options = {})
      : strategy_(strategy),
        precision_(precision),
        options_(options),
        world_(comm::world_from_environment()),
        device_(device::traits<Device>::resolve(world_)),
        comm_(connect(world_, options_)),
        engine_(strategy_, comm_),
        scaling_(precision),
        accumulation_steps_(detail::accumulation_steps(options.gradient_accumulation_steps)) {
    (void)device;
    detail::check_launcher_precision<Precision>();
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
    (prepare_one(objects), ...);
  }

  /// This rank's shard of `dataset`, batched (DistributedSampler semantics).
  template <data::batched_dataset Dataset>
  data::DataLoader<Dataset> prepare(Dataset dataset, LoaderOptions options) {
    return data::DataLoader<Dataset>(std::move(dataset), options, num_processes(), process_index(), device_,
                                     cursor_);
  }

  // ------------------------------------------------------------ the step
  /// One micro-step: runs `forward` under autocast, then backward; on the
  /// micro-step that completes a gradient accumulation cycle (every one, by
  /// default) also the optimizer step, the scheduler step and zero_grad.
  /// Returns the loss as `forward` computed it.
  template <class F>
  at::Tensor step(F&& forward) {
    (void)detail::check_step_function<std::remove_reference_t<F>>::value;
    auto micro_step = accumulate();
    at::Tensor loss;
    {
      [[maybe_unused]] auto scope = autocast();
      loss = forward();
    }
    backward(loss);
    optimizer_step();
    zero_grad();
    return loss;
  }

  /// RAII scope of one micro-step, Accelerate's `with accelerator.accumulate(model)`:
  ///   { auto micro = trainer.accumulate(); trainer.backward(loss);
  ///     trainer.optimizer_step(); trainer.zero_grad(); }
  /// Decides whether this micro-step synchronises gradients: every
  /// `gradient_accumulation_steps`-th one, and the last batch of an epoch.
  class MicroStep {
   public:
    explicit MicroStep(Trainer& trainer) { trainer.begin_micro_step(); }
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
    step_was_skipped_ = scaling_.unscale(params_, comm_);
    if (!step_was_skipped_) {
      optimizer.step();
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
    return torch::nn::utils::clip_grad_norm_(params_, max_norm, norm_type);
  }

  /// Clamps every gradient element to [-value, value] (after communication
  /// and FP16 unscaling).
  void clip_grad_value(double value) {
    prepare_gradients_for_clipping("clip_grad_value");
    torch::nn::utils::clip_grad_value_(params_, value);
  }

  /// The forward-pass autocast scope for this trainer's precision and device.
  precision::AutocastScope<Precision> autocast() const { return precision::AutocastScope<Precision>(device_.type()); }

  // ------------------------------------------------------------ collectives
  /// Every rank's `tensor` concatenated along dimension 0, in rank order.
  at::Tensor gather(const at::Tensor& tensor) {
    if (!comm_.distributed()) return tensor;
    return at::cat(comm_.all_gather(tensor, "gather"), 0);
  }

  /// Like gather, but drops the samples the sampler repeated to even out the
  /// ranks, so that a metric over the result counts every sample once.
  /// `tensor`'s first dimension must be the current batch of the most
  /// recently iterated prepared loader.
  at::Tensor gather_for_metrics(const at::Tensor& tensor) {
    if (!comm_.distributed()) return tensor;
    auto parts = comm_.all_gather(tensor, "gather_for_metrics");
    const auto& cursor = *cursor_;
    if (cursor.sampler == nullptr || tensor.size(0) != cursor.count) return at::cat(parts, 0);
    for (int r = 0; r < num_processes(); ++r)
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
  static comm::Communicator connect(const comm::WorldInfo& world, const TrainerOptions& options) {
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

  template <detail::module_holder M>
  void prepare_one(M& model) {
    model->to(device_);
    engine_.prepare_model(*model.ptr());
    for (auto& p : model->parameters())
      if (p.requires_grad()) params_.push_back(p);
    models_.push_back(model.ptr());
  }

  template <detail::optimizer O>
  void prepare_one(O& optimizer) {
    optimizer_ = &optimizer;
  }

  template <detail::lr_scheduler S>
  void prepare_one(S& scheduler) {
    scheduler_ = &scheduler;
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
    scaling_.unscale(params_, comm_);
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
  std::vector<at::Tensor> params_;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  torch::optim::LRScheduler* scheduler_ = nullptr;
  std::shared_ptr<data::LoaderCursor> cursor_ = std::make_shared<data::LoaderCursor>();
};

}  // namespace accel
