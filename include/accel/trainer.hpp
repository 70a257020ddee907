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
#include <torch/optim/optimizer.h>

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
#include "accel/strategy/ddp.hpp"
#include "accel/strategy/single_process.hpp"

namespace accel {

using data::LoaderOptions;

/// Settings of the run rather than of a policy.
struct TrainerOptions {
  /// Every collective (and the rendezvous) fails after this long instead of
  /// hanging; c10d's own default is 30 minutes.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
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
        engine_(strategy_, comm_) {
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
    requires(sizeof...(Objects) > 0 && ((detail::module_holder<Objects> || detail::optimizer<Objects>) && ...))
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
  /// Runs `forward` (under autocast), then backward, the optimizer step and
  /// zeroing of the gradients; returns the loss.
  template <class F>
  at::Tensor step(F&& forward) {
    (void)detail::check_step_function<std::remove_reference_t<F>>::value;
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

  /// `loss.backward()`, with the strategy's bookkeeping (for users who drive
  /// their own loop: backward, then optimizer_step, then zero_grad).
  void backward(const at::Tensor& loss) {
    engine_.before_backward(loss);
    loss.backward();
  }

  /// Waits for gradient communication, then steps the prepared optimizer.
  void optimizer_step() {
    engine_.synchronize_gradients();
    require_optimizer().step();
  }

  void zero_grad() { engine_.zero_grad(require_optimizer()); }

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
  }

  template <detail::optimizer O>
  void prepare_one(O& optimizer) {
    optimizer_ = &optimizer;
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
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::shared_ptr<data::LoaderCursor> cursor_ = std::make_shared<data::LoaderCursor>();
};

}  // namespace accel
