#pragma once
// Deferred initialisation: building a model without allocating its weights,
// and giving it its weights later, a piece at a time. This header is its
// whole interface, small and compiled once: the user's build_on_meta /
// materialize (accel::device, as documented), and what a sharding engine
// calls to give a unit its values and take them back (accel::deferred_init).
// The recorder and replayer are deferred_init/recorder.hpp, reached only
// from the definitions below.
//// Building a model without allocating its weights, and giving it its weights
// later, a piece at a time. LibTorch's C++ modules create their parameters
// with the default options (host memory) and initialise them at once; there
// is no torch.device("meta") context in C++, and no to_empty().
//
// NOTE [Models built on meta]
// build_on_meta runs the constructor with one more dispatch key enabled for
// the thread (Fake, the out-of-tree key torchdistx's fake tensors used),
// whose fallback sends every operator's `device` argument to the meta
// device. Parameters come out as meta tensors: shapes, dtypes and module
// structure without storage. The fallback also writes down, per storage, the
// operators that made and wrote it (torchdistx's deferred_init, in C++): the
// creating operator (a factory such as empty or randn, or one computing the
// tensor from others, such as TP layers' narrow().clone() of a full Linear)
// and each in-place operator on a view of it (kaiming_uniform_'s uniform_,
// fill_, copy_ from another tensor), with the view's geometry and, for a
// random operator, the generator's state just before it. A random operator is
// also run once on a throw-away tensor of the same layout, so the generator
// leaves the build where a real build leaves it and the next operator's
// recorded state is the one a real build would have used.
// materialized(t) replays t's storage: the same operators, on the device a
// real build would have used, from the same generator states; the values are
// bitwise those of a real build. ZeRO-3 replays one parameter at a time into
// its shard (strategy/deferred_init.hpp); materialize(model) replays all.
// An operator on real tensors only runs as it is (it is not the model's);
// options taken from a meta tensor stand for the device the model lives on;
// real tensors an operator reads (a constant copied in) are kept as they were.
// Refused with a sentence when materialised: a tensor not made inside
// build_on_meta (or made over again outside it, e.g. by model->to(dtype)),
// resize_/set_, Tensor?[] arguments, an operator writing two recorded tensors
// or a list of them.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

#include "accel/core/compiled_once.hpp"

namespace accel::deferred_init {

/// Tensors by name (a module's named_parameters, a unit's).
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// While alive, the thread builds on meta: every tensor made goes to the meta
/// device and, with `record`, its recipe is written down (build_on_meta).
class BuildScope {
 public:
  explicit BuildScope(bool record) : mode_(record), fake_(c10::DispatchKey::Fake) {}
  BuildScope(const BuildScope&) = delete;
  BuildScope& operator=(const BuildScope&) = delete;

 private:
  // Entered before the dispatch key, left after it: the recorder's mode, and
  // the recipes of storages no tensor holds any more dropped on the way out.
  struct Mode {
    explicit Mode(bool record);
    ~Mode();
    bool previous;
  } mode_;
  c10::impl::IncludeDispatchKeyGuard fake_;
};

/// See accel::device::materialized.
ACCEL_COMPILED_ONCE at::Tensor materialized(const at::Tensor& t, const std::string& name);
/// See accel::device::check_materializable.
ACCEL_COMPILED_ONCE void check_materializable(const torch::nn::Module& model);
/// See accel::device::materialize.
ACCEL_COMPILED_ONCE void materialize(torch::nn::Module& model, at::Device device);

// ---- for a sharding engine (ZeRO-3, HybridShard): a unit at a time

/// The model's meta parameters, then its meta buffers, by name.
ACCEL_COMPILED_ONCE NamedTensors meta_tensors_of(const torch::nn::Module& model);
/// Gives the meta tensors among `tensors` their values on `device`, one at a
/// time (each replayed where a real build made it, then moved), in place:
/// the module's members see the new storage.
ACCEL_COMPILED_ONCE void materialize_each(const NamedTensors& tensors, at::Device device);
/// Makes `tensor` (materialised, or real) a meta tensor of its geometry
/// again, its storage freed (a unit's parameters between uses).
ACCEL_COMPILED_ONCE void return_to_meta(const at::Tensor& tensor);
/// Drops the recipes of storages no tensor holds any more (after a model's
/// meta tensors were given values).
ACCEL_COMPILED_ONCE void forget_replaced();
/// The generator states the initialisers of `tensors` replay, each recipe
/// once, in the order the tensors come (the same on every rank for the same
/// model): what ranks agree on instead of broadcasting weights. Their
/// contents can be overwritten; replays read them.
ACCEL_COMPILED_ONCE std::vector<at::Tensor> initialiser_states(const NamedTensors& tensors);

}  // namespace accel::deferred_init

namespace accel::device {

/// Returns what `build()` returns, every tensor it created on the meta
/// device, each with what materialized() needs to give it its values.
///   auto gpt = accel::device::build_on_meta([&] { return gpt::make_gpt(config, tp); });
/// A random initialiser allocates its tensor once, for the moment it runs
/// (NOTE above): the build holds at most one tensor at a time.
template <class Build>
auto build_on_meta(Build&& build) -> decltype(std::forward<Build>(build)()) {
  const deferred_init::BuildScope scope(true);
  return std::forward<Build>(build)();
}

/// The model's shapes and structure only, nothing allocated and nothing
/// recorded (an estimate's input): it cannot be materialised.
template <class Build>
auto build_shapes_on_meta(Build&& build) -> decltype(std::forward<Build>(build)()) {
  const deferred_init::BuildScope scope(false);
  return std::forward<Build>(build)();
}

/// The values a real build would have given `t` (a tensor of a model made by
/// build_on_meta), computed again, on the device that build would have used
/// (the host, unless the model asked for another). `name` is for errors.
/// Run it while no other thread draws from the default generators.
inline at::Tensor materialized(const at::Tensor& t, const std::string& name) {
  return deferred_init::materialized(t, name);
}

/// Throws what preparing `model` from meta would, before anything is
/// computed or communicated: every meta tensor can be replayed, and no
/// parameter is real beside them (its value would not be rank 0's).
inline void check_materializable(const torch::nn::Module& model) { deferred_init::check_materializable(model); }

/// Gives every meta parameter and buffer of `model` (built by build_on_meta)
/// the values a real build would have given it, on `device` (torch's
/// to_empty() plus the initialisation, in one): the whole model in memory, as
/// every strategy but ZeRO-3 keeps it. The generators are left as they were.
inline void materialize(torch::nn::Module& model, at::Device device = at::kCPU) {
  deferred_init::materialize(model, device);
}

}  // namespace accel::device

#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>

#include <set>
#include <stdexcept>

#include "accel/deferred_init/recorder.hpp"

namespace accel::deferred_init {
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE BuildScope::Mode::Mode(bool record) : previous(detail::record_initialisers) {
  detail::register_meta_fallback();
  detail::record_initialisers = record;
}

ACCEL_COMPILED_ONCE BuildScope::Mode::~Mode() {
  detail::record_initialisers = previous;
  detail::recipe_book().prune();
}

ACCEL_COMPILED_ONCE at::Tensor materialized(const at::Tensor& t, const std::string& name) {
  const auto recipe = detail::replayable_recipe(t, name);
  detail::ReplayCache cache;
  const auto buffer = detail::replay(*recipe, recipe->steps.size(), cache);
  return buffer.as_strided(t.sizes(), t.strides(), t.storage_offset());
}

ACCEL_COMPILED_ONCE void check_materializable(const torch::nn::Module& model) {
  for (const auto& item : model.named_parameters()) {
    if (!item.value().is_meta())
      throw std::logic_error("accel: parameter '" + item.key() +
                             "' is a real tensor in a model built on the meta device: build the whole model inside "
                             "accel::device::build_on_meta (load trained weights after prepare, with load_state)");
    (void)detail::replayable_recipe(item.value(), item.key());
  }
  for (const auto& item : model.named_buffers())
    if (item.value().is_meta()) (void)detail::replayable_recipe(item.value(), item.key());
}

ACCEL_COMPILED_ONCE NamedTensors meta_tensors_of(const torch::nn::Module& model) {
  NamedTensors out;
  for (const auto& item : model.named_parameters())
    if (item.value().is_meta()) out.emplace_back(item.key(), item.value());
  for (const auto& item : model.named_buffers())
    if (item.value().is_meta()) out.emplace_back(item.key(), item.value());
  return out;
}

ACCEL_COMPILED_ONCE void materialize_each(const NamedTensors& tensors, at::Device device) {
  c10::NoGradGuard no_grad;
  for (const auto& [name, t] : tensors)
    if (t.is_meta()) detail::give_data(t, materialized(t, name).to(device));
}

ACCEL_COMPILED_ONCE void materialize(torch::nn::Module& model, at::Device device) {
  materialize_each(meta_tensors_of(model), device);
  forget_replaced();
}

ACCEL_COMPILED_ONCE void return_to_meta(const at::Tensor& tensor) {
  detail::give_data(tensor, at::empty_strided(tensor.sizes(), tensor.strides(), tensor.options().device(at::kMeta)));
}

ACCEL_COMPILED_ONCE void forget_replaced() { detail::recipe_book().prune(); }

ACCEL_COMPILED_ONCE std::vector<at::Tensor> initialiser_states(const NamedTensors& tensors) {
  std::vector<at::Tensor> states;
  std::set<const detail::Recipe*> seen;
  auto visit = [&](auto& self, const detail::Recipe& recipe) -> void {
    if (!seen.insert(&recipe).second) return;
    for (const auto& step : recipe.steps) {
      for (const auto& source : step.sources) self(self, *source.recipe);
      if (step.generator) states.push_back(step.generator_state);
    }
  };
  for (const auto& [name, t] : tensors) visit(visit, *detail::replayable_recipe(t, name));
  return states;
}

}  // namespace accel::deferred_init
#endif
