#pragma once
// accel::TrainerBase: what a Trainer does whatever its strategy, precision
// and device: who this process is, its process group, the data loaders, the
// collectives on user tensors and objects, process control, trackers and the
// numbered checkpoint directories. An ordinary class, so its functions are
// compiled once (NOTE [Compiled once]) instead of once per Trainer type per
// translation unit; Trainer<S, P, D> derives from it publicly and keeps what
// the policies change (the engines, the step, autocast, loss scaling).
//
// A function that only logs, gathers or prints can take any trainer:
//   double evaluate(accel::TrainerBase& trainer, ...);   // compiled once, for every Trainer<...>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <torch/serialize.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "accel/checkpoint/files.hpp"
#include "accel/checkpoint/state.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/comm/environment.hpp"
#include "accel/comm/objects.hpp"
#include "accel/comm/rank_order.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/core/json.hpp"
#include "accel/data/iterable.hpp"
#include "accel/data/loader.hpp"
#include "accel/data/split.hpp"
#include "accel/data/torch_dataset.hpp"
#include "accel/device/host_block_cache.hpp"
#include "accel/device/host_memory.hpp"
#include "accel/device/random_state.hpp"
#include "accel/tracking/progress.hpp"
#include "accel/tracking/trackers.hpp"

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
  /// Before each collective the ranks check that they agree on it, and every
  /// rank raises comm::CollectiveMismatch with each rank's view where they do
  /// not (NOTE [Debug mode] in comm/checked_group.hpp). Unset:
  /// ACCELERATE_DEBUG_MODE (what `accel launch --debug` sets), else off.
  std::optional<bool> debug{};
  /// Accelerate's GradientAccumulationPlugin(sync_with_dataloader): the last
  /// batch of a prepared loader's epoch also synchronises and steps (and
  /// starts a new accumulation cycle), so no gradients carry over into the
  /// next epoch. Off: only every gradient_accumulation_steps-th micro-step.
  bool sync_with_dataloader = true;
  /// Accelerate's log_with: the built-in trackers init_trackers starts
  /// ("jsonl", "csv", "tensorboard", "all"; empty: "jsonl"), writing to
  /// project_dir/<project> (NOTE at the top of <accel/tracking/trackers.hpp>).
  std::vector<std::string> log_with{};
  /// On the CPU device, freed host blocks over 1 MiB go back to the system
  /// (NOTE [Returning host memory] in <accel/device/host_memory.hpp>), so the
  /// resident set follows what the strategy holds, for the price of fresh
  /// pages each step (ZeRO-3 measured 1.8x slower per step, DDP 2%). The
  /// default, cache_host_memory, gets the same resident set without that cost.
  bool return_host_memory = false;
  /// On the CPU device, host blocks of 128 KiB or more are kept when freed and
  /// reused by the next request they fit, process-wide, under LibTorch's own
  /// CPU allocator (NOTE [Host blocks kept for reuse] in
  /// <accel/device/host_block_cache.hpp>): the resident set follows what the
  /// strategy holds, with no fresh pages per step. return_host_memory wins
  /// over it.
  bool cache_host_memory = true;
  /// Accelerate's step_scheduler_with_optimizer: the prepared scheduler
  /// steps once per data rank at each optimizer step (Accelerate's rule: its
  /// schedule counts per-process batches). Off: once per optimizer step.
  bool step_scheduler_with_optimizer = true;
};

class TrainerBase {
 public:
  TrainerBase(const TrainerBase&) = delete;
  TrainerBase& operator=(const TrainerBase&) = delete;

  // ------------------------------------------------------------ data
  /// This rank's shard of `dataset`, batched (Accelerate's prepared
  /// DataLoader: data::Sharding). `dataset` is accel's (TensorDataset, or
  /// anything with size() and get(indices)) or LibTorch's own
  /// (torch::data, with its .map(...) chains: <accel/data/torch_dataset.hpp>).
  template <class Dataset>
    requires(data::batched_dataset<Dataset> || data::torch_dataset<Dataset>)
  auto prepare(Dataset dataset, LoaderOptions options) {
    return make_loader(std::move(dataset), options, {});
  }

  /// This rank's share of an iterable (streaming) dataset, a range of
  /// examples read from its begin() each pass: every rank reads the stream
  /// and keeps its batch of each group of ranks x batch_size samples, as
  /// Accelerate's IterableDatasetShard (<accel/data/iterable.hpp>).
  template <data::iterable_dataset Range>
  data::IterableLoader<Range> prepare(Range range, LoaderOptions options) {
    auto& group = data_group();
    return data::IterableLoader<Range>(std::move(range), options, group.size(), group.rank(), device_, cursor_,
                                       register_loader(options));
  }

  /// The same with a LibTorch sampler (torch::data::samplers::Sampler<>:
  /// SequentialSampler, RandomSampler, your own) giving each epoch's order,
  /// which the loader deals out to the ranks in batches as Accelerate's
  /// BatchSamplerShard does. RandomSampler draws with options.seed + epoch,
  /// the same on every rank (data::epoch_order_of).
  template <class Dataset, data::torch_sampler Sampler>
    requires(data::batched_dataset<Dataset> || data::torch_dataset<Dataset>)
  auto prepare(Dataset dataset, LoaderOptions options, Sampler sampler) {
    refuse_shuffle_with_sampler(options);
    const auto size = dataset_size(dataset);
    return make_loader(std::move(dataset), options, data::epoch_order_of(std::move(sampler), size, options.seed,
                                                                               static_cast<std::size_t>(options.batch_size)));
  }

  /// The same with a LibTorch batch sampler, whose batches keep their own
  /// sizes (Python's DataLoader(batch_sampler=...)): wrap it,
  /// `prepare(dataset, {.even_batches = ...}, accel::data::batch_sampler(sampler))`.
  /// Batch i goes whole to data rank i mod N, as Accelerate's
  /// BatchSamplerShard deals a batch sampler's batches: the last round is
  /// filled with the epoch's first batches (even_batches; gather_for_metrics
  /// drops them), or left short (even_batches = false: the ranks past the
  /// last batch run an empty one), or dropped (drop_last). Positions and
  /// checkpoints count batches. `options.batch_size` is what the sampler is
  /// asked for; split_batches is refused, as Accelerate refuses it.
  template <class Dataset, data::torch_sampler Sampler>
    requires(data::batched_dataset<Dataset> || data::torch_dataset<Dataset>)
  auto prepare(Dataset dataset, LoaderOptions options, data::BatchSampler<Sampler> sampler) {
    refuse_shuffle_with_sampler(options);
    refuse_split_batches_with_batch_sampler(options);
    const auto size = dataset_size(dataset);
    return make_loader(std::move(dataset), options, {},
                       data::epoch_batches_of(std::move(sampler.sampler), size, options.seed,
                                              static_cast<std::size_t>(options.batch_size)));
  }

  /// Accelerate's split_between_processes: this rank's contiguous share of
  /// `inputs`, which every rank holds whole (a std::vector, a std::map of
  /// equally long vectors or tensors, a tensor along dimension 0, or a
  /// dataset, as a data::Subset); the first ranks take one more where it
  /// does not divide. apply_padding pads every share to the longest with the
  /// last item. Over the data ranks (tensor and pipeline peers get the same
  /// share). A value, not Accelerate's `with` block.
  template <class Inputs>
  auto split_between_processes(Inputs inputs, bool apply_padding = false) {
    auto& group = data_group();
    return data::split_between_processes(std::move(inputs), group.rank(), group.size(), apply_padding);
  }

  /// Accelerate's skip_first_batches: `loader`'s next pass starts `count`
  /// batches into its epoch; returns the loader.
  template <class Dataset>
  data::DataLoader<Dataset>& skip_first_batches(data::DataLoader<Dataset>& loader, std::int64_t count) {
    return loader.skip_first_batches(count);
  }

  /// The ranks that read different data: the mesh's data group under
  /// Parallel<>, every rank otherwise.
  comm::Communicator& data_group() { return data_group_ != nullptr ? *data_group_ : comm_; }

  /// The group a model's tensor-parallel layers (accel::nn) communicate
  /// over: the mesh's tensor dimension under Parallel<>, one rank otherwise.
  comm::Communicator& tensor_group() { return tensor_group_ != nullptr ? *tensor_group_ : solo_; }

  /// How many times the prepared scheduler steps per optimizer step
  /// (Accelerate's AcceleratedScheduler rule).
  ACCEL_COMPILED_ONCE int scheduler_steps_per_optimizer_step();

  // ------------------------------------------------------------ collectives
  /// Every rank's `tensor` concatenated along dimension 0, in rank order.
  /// (Under Parallel<>, over the data group: tensor and pipeline peers hold
  /// the same samples, which would otherwise be gathered twice.)
  ACCEL_COMPILED_ONCE at::Tensor gather(const at::Tensor& tensor);

  /// Like gather, but drops the samples the sampler repeated to even out the
  /// ranks, so that a metric over the result counts every sample once.
  /// `tensor`'s first dimension must be the current batch of the most
  /// recently iterated prepared loader.
  ACCEL_COMPILED_ONCE at::Tensor gather_for_metrics(const at::Tensor& tensor);

  /// Sum, mean (as floating point) or element-wise maximum of `tensor` over
  /// ranks (Accelerate's reduce with "sum", "mean", "max"); the input is
  /// left untouched. Over the same ranks as gather: under Parallel<> tensor
  /// and pipeline peers hold the same samples, and a sum over the world
  /// would count each of them once per peer.
  ACCEL_COMPILED_ONCE at::Tensor reduce(const at::Tensor& tensor, const std::string& op = "sum");

  /// Every rank's `object` in rank order (Accelerate's gather_object), over
  /// the same ranks as gather. `T`: anything nlohmann::json converts both
  /// ways (strings, numbers, vectors and maps of them, your own types with
  /// to_json/from_json).
  template <class T>
  std::vector<T> gather_object(const T& object) {
    return comm::gather_object(data_group(), object);
  }
  /// A vector is gathered as Accelerate gathers a list: the ranks' vectors
  /// concatenated in rank order ([0] and [1] give [0, 1]).
  template <class T>
  std::vector<T> gather_object(const std::vector<T>& objects) {
    std::vector<T> out;
    for (auto& part : comm::gather_object(data_group(), objects))
      out.insert(out.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
    return out;
  }

  /// `tensor` padded with `pad_value` along `dim` to the largest size any
  /// rank has there (at the start with `pad_first`), so that ragged
  /// per-rank results can be gathered (Accelerate's pad_across_processes).
  ACCEL_COMPILED_ONCE at::Tensor pad_across_processes(const at::Tensor& tensor, std::int64_t dim = 0,
                                                      double pad_value = 0, bool pad_first = false);

  /// Accelerate's synchronize_rng_states: every rank's CPU generator (and
  /// its GPU's, on CUDA) set to rank 0's state, e.g. before drawing the same
  /// random augmentation or noise everywhere. A collective.
  ACCEL_COMPILED_ONCE void synchronize_rng_states();

  // ------------------------------------------------------------ process control
  void wait_for_everyone() { comm_.barrier(); }

  /// Accelerate's main_process_first: the block holding the returned object
  /// runs on the main process before the others (which wait at its start);
  /// every rank must enter it.
  ///   { auto first = trainer.main_process_first(); build_cache(); }
  [[nodiscard]] comm::GoesFirst main_process_first() { return {comm_, is_main_process()}; }
  /// The same with each machine's local main process first.
  [[nodiscard]] comm::GoesFirst local_main_process_first() { return {comm_, is_local_main_process()}; }
  /// Runs `fn` on the main process only (Accelerate's on_main_process).
  template <class F>
  void on_main_process(F&& fn) const {
    if (is_main_process()) std::forward<F>(fn)();
  }
  template <class F>
  void on_local_main_process(F&& fn) const {
    if (is_local_main_process()) std::forward<F>(fn)();
  }
  /// Runs `fn` on the process of rank `process_index` only (Accelerate's on_process).
  template <class F>
  void on_process(int process_index, F&& fn) const {
    require_process_index(process_index);
    if (world_.rank == process_index) std::forward<F>(fn)();
  }
  /// Runs `fn` on the last process only (Accelerate's on_last_process).
  template <class F>
  void on_last_process(F&& fn) const {
    if (is_last_process()) std::forward<F>(fn)();
  }

  /// Accelerate's set_trigger / check_trigger: any rank raises the flag, and
  /// every rank's next check_trigger() (a collective: all ranks call it at
  /// the same point) returns true, e.g. to stop every rank on a NaN loss.
  void set_trigger() { trigger_.set(); }
  bool check_trigger() { return trigger_.check(comm_); }

  // ------------------------------------------------------------ trackers and progress
  /// Starts the trackers (TrainerOptions::log_with, plus any of your own
  /// meeting accel::tracking::tracker) on the main process, in
  /// project_dir/`project`, and stores `config` with each (Accelerate's
  /// init_trackers). The other ranks keep none; every call below is then a
  /// no-op there, so the loop needs no `if (is_main_process())`. (Compiled
  /// once, a config or log values need <nlohmann/json.hpp>: core/json.hpp.)
  template <tracking::tracker... Custom>
  void init_trackers(const std::string& project, const nlohmann::json& config, Custom... custom) {
    std::vector<tracking::AnyTracker> mine;
    (mine.emplace_back(std::move(custom)), ...);
    start_trackers(project, &config, std::move(mine));
  }
  /// The same with an empty configuration and the built-in trackers only.
  void init_trackers(const std::string& project) { start_trackers(project, nullptr, {}); }
  /// Hands `values` (a JSON object: numbers, strings, nested objects) to
  /// every tracker at `step` (default: the optimizer steps taken so far).
  ACCEL_COMPILED_ONCE void log(const nlohmann::json& values, std::optional<std::int64_t> step = std::nullopt);
  /// Finishes every tracker (Accelerate's end_training).
  void end_training() { trackers_.finish(); }
  /// The running tracker of type T (a built-in one such as
  /// tracking::TensorBoardTracker, or your own); nullptr if none, and on
  /// every rank but the main process.
  template <class T>
  T* get_tracker() {
    return trackers_.template get<T>();
  }

  /// A tqdm-style progress bar (steps, rate, ETA, last loss) drawn on the
  /// main process only, and only where stdout is a terminal:
  ///   auto bar = trainer.progress_bar(loader.size(), {.description = "epoch 1"});
  ///   ... bar.update(1, loss.item<double>());
  tracking::ProgressBar progress_bar(std::int64_t total, tracking::ProgressOptions options = {}) const {
    options.disable = options.disable || !is_main_process();
    return tracking::ProgressBar(total, std::move(options));
  }

  /// Optimizer steps taken (skipped ones included): the training step count
  /// (with several optimizers, the first prepared one's steps).
  std::int64_t completed_steps() const { return counters_.optimizer_steps; }

  // ------------------------------------------------------------ checkpoints
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
  bool is_last_process() const { return world_.rank == world_.world_size - 1; }

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
  ACCEL_COMPILED_ONCE void set_seed(std::uint64_t seed, bool device_specific = false) const;

  // ------------------------------------------------------------ internals, for tests and benchmarks
  comm::Communicator& communicator() { return comm_; }
  const TrainerOptions& options() const { return options_; }

 protected:
  // `connect(world, options)` makes the process group, once the host block
  // cache is in place (the group's first buffers already come from it).
  template <class Connect>
  TrainerBase(TrainerOptions options, comm::WorldInfo world, at::Device device, Connect&& connect)
      : options_(std::move(options)),
        world_(world),
        device_(device),
        host_cache_(device_.is_cpu() && options_.cache_host_memory && !options_.return_host_memory),
        comm_(std::forward<Connect>(connect)(world_, options_)) {
    apply_host_memory_option();
    check_tracker_names();
  }
  ~TrainerBase() = default;  // not deleted through a base pointer: a Trainer owns its engines

  // The first engine's groups (null: the whole world, or one rank); they live as long as that engine.
  void use_groups(comm::Communicator* data, comm::Communicator* tensor) {
    data_group_ = data;
    tensor_group_ = tensor;
  }
  // Once per optimizer, after its first step (NOTE [Host blocks after the first step]).
  void release_idle_host_blocks() {
    if (auto* cache = host_cache_.get()) cache->release_idle();
  }
  // free_memory's share: the loaders, registered objects and counters forgotten.
  ACCEL_COMPILED_ONCE void forget_prepared_data();
  // save_state() without a directory: the next numbered one under project_dir/checkpoints,
  // saved by `save`, then the oldest past total_limit removed.
  ACCEL_COMPILED_ONCE std::filesystem::path save_numbered_state(
      const std::function<void(const std::filesystem::path&)>& save);
  // The newest complete numbered checkpoint, chosen by rank 0 (a collective); none on a fresh start.
  ACCEL_COMPILED_ONCE std::optional<std::filesystem::path> checkpoint_to_resume();

  TrainerOptions options_;
  comm::WorldInfo world_;
  at::Device device_;
  device::HostBlockCacheUse host_cache_;  // before the engines, whose buffers go back to it
  comm::Communicator comm_;
  comm::Communicator solo_;  // the one-rank tensor group of strategies without tensor parallelism
  comm::Trigger trigger_;
  bool split_batches_ = false;  // a prepared loader splits the global batch: the scheduler steps once
  checkpoint::StepCounters counters_;
  std::vector<checkpoint::CustomObject> custom_;
  std::vector<std::weak_ptr<data::LoaderPosition>> loader_positions_;
  std::shared_ptr<data::LoaderCursor> cursor_ = std::make_shared<data::LoaderCursor>();

 private:
  template <class Dataset>
  auto make_loader(Dataset dataset, LoaderOptions options, data::EpochOrder order, data::EpochBatches batches = {}) {
    if constexpr (data::torch_dataset<Dataset>) {
      return make_loader(data::TorchDataset<Dataset>(std::move(dataset)), options, std::move(order), std::move(batches));
    } else {
      // Tensor and pipeline peers read the same samples: shard over the data group.
      auto& group = data_group();
      return data::DataLoader<Dataset>(std::move(dataset), options, group.size(), group.rank(), device_, cursor_,
                                       register_loader(options), std::move(order), std::move(batches));
    }
  }

  template <class Dataset>
  static std::size_t dataset_size(const Dataset& dataset) {
    if constexpr (data::torch_dataset<Dataset>) return dataset.size().value_or(0);
    else return static_cast<std::size_t>(dataset.size());
  }

  ACCEL_COMPILED_ONCE static void refuse_shuffle_with_sampler(const LoaderOptions& options);
  ACCEL_COMPILED_ONCE static void refuse_split_batches_with_batch_sampler(const LoaderOptions& options);
  ACCEL_COMPILED_ONCE void require_process_index(int process_index) const;
  // A new loader's position, which checkpoints save and restore; a loader that splits the global
  // batch makes the scheduler step once per optimizer step.
  ACCEL_COMPILED_ONCE std::shared_ptr<data::LoaderPosition> register_loader(const LoaderOptions& options);
  ACCEL_COMPILED_ONCE void apply_host_memory_option();
  ACCEL_COMPILED_ONCE void check_tracker_names() const;
  ACCEL_COMPILED_ONCE void start_trackers(const std::string& project, const nlohmann::json* config,
                                          std::vector<tracking::AnyTracker> custom);

  comm::Communicator* data_group_ = nullptr;
  comm::Communicator* tensor_group_ = nullptr;
  tracking::Trackers trackers_;  // started on the main process only
  bool trackers_initialised_ = false;
};

#if ACCEL_DEFINE_COMPILED_ONCE
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE int TrainerBase::scheduler_steps_per_optimizer_step() {
  if (!options_.step_scheduler_with_optimizer || split_batches_) return 1;
  return data_group().size();
}

ACCEL_COMPILED_ONCE at::Tensor TrainerBase::gather(const at::Tensor& tensor) {
  auto& group = data_group();
  if (!group.distributed()) return tensor;
  return at::cat(group.all_gather(tensor, "gather"), 0);
}

ACCEL_COMPILED_ONCE at::Tensor TrainerBase::gather_for_metrics(const at::Tensor& tensor) {
  auto& group = data_group();
  if (!group.distributed()) return tensor;
  const auto& cursor = *cursor_;
  if (cursor.sampler != nullptr && !cursor.sampler->even()) {  // batches may differ in size
    auto parts = comm::all_gather_rows(group, tensor, "gather_for_metrics");
    // A batch sampler's last round filled with its first batches: those go (the rest pads nothing).
    if (cursor.sampler->batched())
      for (int r = 0; r < group.size(); ++r)
        if (!cursor.sampler->real_batch(r, cursor.batch)) parts[r] = parts[r].narrow(0, 0, 0);
    return at::cat(parts, 0);
  }
  auto parts = group.all_gather(tensor, "gather_for_metrics");
  if (tensor.size(0) != cursor.count) return at::cat(parts, 0);
  for (int r = 0; r < group.size(); ++r) {
    if (cursor.sampler != nullptr)
      parts[r] = parts[r].narrow(0, 0, cursor.sampler->real_in(r, cursor.first, cursor.count));
    else if (cursor.real_in_step >= 0)  // an iterable loader's last batch, filled from the stream's head
      parts[r] = parts[r].narrow(0, 0, std::clamp<std::int64_t>(cursor.real_in_step - r * cursor.count, 0, cursor.count));
  }
  return at::cat(parts, 0);
}

ACCEL_COMPILED_ONCE at::Tensor TrainerBase::reduce(const at::Tensor& tensor, const std::string& op) {
  if (op != "sum" && op != "mean" && op != "max")
    throw std::invalid_argument("accel: reduce op must be \"sum\", \"mean\" or \"max\", got \"" + op + "\"");
  at::Tensor out = tensor.clone();
  auto& group = data_group();
  if (op == "max") {
    group.all_reduce_max(out, "reduce(max)");
    return out;
  }
  group.all_reduce(out, "reduce(" + op + ")");
  return op == "mean" ? out.div(group.size()) : out;
}

ACCEL_COMPILED_ONCE at::Tensor TrainerBase::pad_across_processes(const at::Tensor& tensor, std::int64_t dim,
                                                                 double pad_value, bool pad_first) {
  return comm::pad_across_processes(data_group(), tensor, dim, pad_value, pad_first);
}

ACCEL_COMPILED_ONCE void TrainerBase::synchronize_rng_states() {
  auto states = device::random_states(device_);
  for (std::size_t i = 0; i < states.size(); ++i)
    comm_.broadcast(states[i], 0, "synchronize_rng_states (generator " + std::to_string(i) + ")");
  device::restore_random_states(device_, states);
}

ACCEL_COMPILED_ONCE void TrainerBase::log(const nlohmann::json& values, std::optional<std::int64_t> step) {
  if (!trackers_initialised_)  // on every rank alike, so a missing init_trackers is found on a 1-rank run too
    throw std::logic_error("accel: log() before init_trackers(): start the trackers first");
  if (!is_main_process()) return;
  trackers_.log(values, step.value_or(completed_steps()));
}

ACCEL_COMPILED_ONCE void TrainerBase::set_seed(std::uint64_t seed, bool device_specific) const {
  at::manual_seed(seed + (device_specific ? static_cast<std::uint64_t>(process_index()) : 0));
}

ACCEL_COMPILED_ONCE void TrainerBase::forget_prepared_data() {
  custom_.clear();
  loader_positions_.clear();
  *cursor_ = data::LoaderCursor{};
  counters_ = {};
  split_batches_ = false;
}

ACCEL_COMPILED_ONCE std::filesystem::path TrainerBase::save_numbered_state(
    const std::function<void(const std::filesystem::path&)>& save) {
  const auto root = options_.project_dir / "checkpoints";
  auto existing = checkpoint::numbered_checkpoints(root);
  const long next = existing.empty() ? 0 : existing.back().first + 1;
  const auto dir = root / ("checkpoint_" + std::to_string(next));
  save(dir);
  existing.emplace_back(next, dir);
  if (is_main_process() && options_.total_limit > 0)
    while (static_cast<int>(existing.size()) > options_.total_limit) {
      std::filesystem::remove_all(existing.front().second);
      existing.erase(existing.begin());
    }
  wait_for_everyone();
  return dir;
}

ACCEL_COMPILED_ONCE std::optional<std::filesystem::path> TrainerBase::checkpoint_to_resume() {
  const auto root = options_.project_dir / "checkpoints";
  at::Tensor chosen = at::full({1}, -1, at::TensorOptions().dtype(at::kLong));
  if (is_main_process())
    if (auto newest = checkpoint::newest_complete_checkpoint(root)) chosen.fill_(newest->first);
  comm_.broadcast(chosen, 0, "which checkpoint to resume from");
  const long number = chosen.item<long>();
  if (number < 0) return std::nullopt;
  return root / ("checkpoint_" + std::to_string(number));
}

ACCEL_COMPILED_ONCE void TrainerBase::refuse_shuffle_with_sampler(const LoaderOptions& options) {
  if (options.shuffle)
    throw std::invalid_argument("accel: a loader with a sampler cannot also shuffle (the sampler gives the order, "
                                "as in PyTorch's DataLoader): drop .shuffle, or use a RandomSampler");
}

ACCEL_COMPILED_ONCE void TrainerBase::refuse_split_batches_with_batch_sampler(const LoaderOptions& options) {
  if (options.split_batches)
    throw std::invalid_argument("accel: split_batches splits batches of one known size; a batch sampler's batches "
                                "have their own sizes and are dealt to the ranks whole (Accelerate refuses it too)");
}

ACCEL_COMPILED_ONCE void TrainerBase::require_process_index(int process_index) const {
  if (process_index < 0 || process_index >= num_processes())
    throw std::invalid_argument("accel: on_process(" + std::to_string(process_index) + ") with " +
                                std::to_string(num_processes()) + " processes");
}

ACCEL_COMPILED_ONCE std::shared_ptr<data::LoaderPosition> TrainerBase::register_loader(const LoaderOptions& options) {
  split_batches_ = split_batches_ || options.split_batches;
  auto position = std::make_shared<data::LoaderPosition>();
  loader_positions_.push_back(position);
  return position;
}

ACCEL_COMPILED_ONCE void TrainerBase::apply_host_memory_option() {
  if (device_.is_cpu() && options_.return_host_memory) device::return_freed_host_memory();
}

ACCEL_COMPILED_ONCE void TrainerBase::check_tracker_names() const {
  (void)tracking::built_in_trackers(options_.log_with);  // a misspelt name fails here, not at init_trackers
}

ACCEL_COMPILED_ONCE void TrainerBase::start_trackers(const std::string& project, const nlohmann::json* config,
                                                     std::vector<tracking::AnyTracker> custom) {
  trackers_initialised_ = true;
  if (!is_main_process()) return;
  if (config != nullptr) trackers_.start(options_.log_with, options_.project_dir, project, *config, std::move(custom));
  else trackers_.start(options_.log_with, options_.project_dir, project, std::move(custom));
}
#endif

}  // namespace accel
