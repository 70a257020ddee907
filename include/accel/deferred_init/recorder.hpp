#pragma once
// The recorder and replayer behind deferred_init/meta.hpp (NOTE [Models
// built on meta] there): the Fake dispatch key's fallback that writes down
// each storage's operators during a build on meta, and the replay that
// computes them again. Included only where deferred_init's functions are
// defined (its compiled-once section); nothing else calls into it.

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/Device.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <algorithm>

namespace accel::deferred_init::detail {

struct Recipe;

// Where an operator's meta input sits in its argument list, and what it was
// then: a view of `recipe`'s storage after its first `steps_done` steps.
struct Source {
  std::size_t argument = 0;
  std::optional<std::size_t> list_index;  // an element of a Tensor[] argument
  std::shared_ptr<const Recipe> recipe;
  std::size_t steps_done = 0;
  std::vector<std::int64_t> sizes, strides;
  std::int64_t offset = 0;
};

struct Step {
  c10::OperatorHandle op;
  std::vector<c10::IValue> arguments;  // as the build passed them; meta inputs are the sources'
  std::vector<Source> sources;
  std::optional<std::size_t> written;  // in-place: the argument that is a view of the storage
  std::size_t result = 0;              // the creating step: which return is the storage
  std::vector<std::int64_t> sizes, strides;  // the written view, or the created tensor
  std::int64_t offset = 0;
  std::optional<at::Generator> generator;  // a random operator: its generator and state before it
  at::Tensor generator_state;
};

// Everything that happened to one storage during the build.
struct Recipe {
  c10::Storage storage;  // the meta storage (kept alive while listed, so its address stays unique)
  at::Device device{at::kCPU};
  at::ScalarType dtype = at::kFloat;
  std::int64_t numel = 0;  // of the storage
  std::vector<Step> steps;
  std::string refused;  // why it cannot be replayed
};

struct RecipeBook {
  std::mutex mutex;
  std::unordered_map<const c10::StorageImpl*, std::shared_ptr<Recipe>> by_storage;

  std::shared_ptr<Recipe> find(const at::Tensor& t) {
    if (!t.defined() || !t.is_meta() || !t.has_storage()) return nullptr;
    std::lock_guard lock(mutex);
    auto it = by_storage.find(t.storage().unsafeGetStorageImpl());
    return it == by_storage.end() ? nullptr : it->second;
  }
  // Storages only the book still holds belong to no tensor any more.
  void prune() {
    std::lock_guard lock(mutex);
    std::erase_if(by_storage, [](const auto& entry) { return entry.second->storage.use_count() == 1; });
  }
};
inline RecipeBook& recipe_book() {
  static RecipeBook book;
  return book;
}

inline bool is_meta_tensor(const c10::IValue& v) { return v.isTensor() && v.toTensor().defined() && v.toTensor().is_meta(); }

inline std::optional<std::size_t> argument_named(const c10::FunctionSchema& schema, const char* name) {
  const auto& arguments = schema.arguments();
  for (std::size_t i = 0; i < arguments.size(); ++i)
    if (arguments[i].name() == name) return i;
  return std::nullopt;
}

inline bool writes(const c10::Argument& argument) {
  return argument.alias_info() != nullptr && argument.alias_info()->isWrite();
}

// empty_like(meta, device=cpu) and new_zeros read only their input's shape
// and dtype: such factories keep their meta inputs; every other operator's
// meta inputs are sources, computed again when it is replayed.
inline bool reads_only_shapes(const c10::FunctionSchema& schema) {
  const auto& name = schema.name();
  return name.starts_with("aten::new_") || name.ends_with("_like");
}

// Whether the operator draws from a random generator: those with a generator
// argument, and the overloads of the random factories that have none (they
// draw from the default generator).
inline bool draws_random_numbers(const c10::FunctionSchema& schema) {
  if (argument_named(schema, "generator")) return true;
  static const char* const factories[] = {"aten::rand",      "aten::randn",      "aten::randint",     "aten::randperm",
                                          "aten::rand_like", "aten::randn_like", "aten::randint_like"};
  for (const char* name : factories)
    if (schema.name() == name) return true;
  return false;
}

// The view of `buffer` (a storage's elements, 1-D) with a recorded geometry.
inline at::Tensor view_of(const at::Tensor& buffer, const std::vector<std::int64_t>& sizes,
                          const std::vector<std::int64_t>& strides, std::int64_t offset) {
  return buffer.as_strided(sizes, strides, offset);
}

// What one materialisation has replayed already: a storage read by several
// steps (or by a step that writes it, w.div_(w.norm())) is computed once.
using ReplayCache = std::map<std::pair<const Recipe*, std::size_t>, at::Tensor>;

inline at::Tensor replay(const Recipe& recipe, std::size_t steps, ReplayCache& cache);

// Puts real tensors where the step's meta inputs were.
inline std::vector<c10::IValue> real_arguments(const Step& step, ReplayCache& cache) {
  auto stack = step.arguments;
  for (const auto& source : step.sources) {
    auto real = view_of(replay(*source.recipe, source.steps_done, cache), source.sizes, source.strides, source.offset);
    if (!source.list_index) {
      stack[source.argument] = real;
      continue;
    }
    auto list = stack[source.argument].toTensorVector();
    list[*source.list_index] = real;
    stack[source.argument] = list;
  }
  return stack;
}

// Sets the generators the replayed steps draw from, and gives them back
// their states afterwards: materialising leaves the program's streams as
// they were. (The default generators are the process's: materialise while
// no other thread draws from them.)
class GeneratorStates {
 public:
  void set(at::Generator generator, const at::Tensor& state) {
    bool known = false;
    for (auto& [g, _] : saved_) known = known || g == generator;
    std::lock_guard lock(generator.mutex());
    if (!known) saved_.emplace_back(generator, generator.get_state());
    generator.set_state(state);
  }
  ~GeneratorStates() {
    for (auto& [generator, state] : saved_) {
      std::lock_guard lock(generator.mutex());
      generator.set_state(state);
    }
  }

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

/// The storage's elements (1-D, on the device a real build used) after its
/// first `steps` steps, computed again (read-only when it comes from `cache`).
inline at::Tensor replay(const Recipe& recipe, std::size_t steps, ReplayCache& cache) {
  const auto key = std::make_pair(&recipe, steps);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  c10::NoGradGuard no_grad;
  GeneratorStates generators;
  at::Tensor buffer;
  for (std::size_t i = 0; i < steps; ++i) {
    const auto& step = recipe.steps[i];
    auto stack = real_arguments(step, cache);
    if (step.generator) generators.set(*step.generator, step.generator_state);
    if (step.written) {
      stack[*step.written] = view_of(buffer, step.sizes, step.strides, step.offset);
      step.op.callBoxed(&stack);
      continue;
    }
    step.op.callBoxed(&stack);
    const auto made = stack.at(step.result).toTensor();
    buffer = at::empty({recipe.numel}, made.options());
    view_of(buffer, step.sizes, step.strides, step.offset).copy_(made);
  }
  cache.emplace(key, buffer);
  return buffer;
}

// Runs a random operator once on real, throw-away tensors, so that the
// generator advances as in a real build.
inline void advance_generator(const Step& step, const std::shared_ptr<Recipe>& written_recipe) {
  c10::NoGradGuard no_grad;
  ReplayCache cache;
  auto stack = real_arguments(step, cache);
  if (step.written) {
    const auto& r = *written_recipe;
    auto scratch = at::empty({r.numel}, at::TensorOptions().dtype(r.dtype).device(r.device));
    stack[*step.written] = view_of(scratch, step.sizes, step.strides, step.offset);
  }
  step.op.callBoxed(&stack);
}

// The first reason found why `recipe`, or a recipe it reads, cannot be replayed.
inline std::string refusal_of(const Recipe& recipe) {
  if (!recipe.refused.empty()) return recipe.refused;
  for (const auto& step : recipe.steps)
    for (const auto& source : step.sources)
      if (auto why = refusal_of(*source.recipe); !why.empty()) return why;
  return {};
}

inline std::vector<std::int64_t> vec(c10::IntArrayRef a) { return a.vec(); }

// A meta tensor of the same geometry and a storage of its own: a factory's
// input that only lends its shape, without keeping the build's storage alive.
inline at::Tensor shape_only(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::Fake);
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

inline void record_and_run(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const auto first = stack->size() - arguments.size();
  const auto device_argument = argument_named(schema, "device");
  const auto generator_argument = argument_named(schema, "generator");
  const bool factory = device_argument.has_value() && reads_only_shapes(schema);
  auto& book = recipe_book();

  // An operator on real tensors only (a tensor from outside the build): not the model's, run as it is.
  bool touches_meta = device_argument.has_value();
  for (std::size_t i = first; i < stack->size() && !touches_meta; ++i) {
    const auto& v = (*stack)[i];
    if (is_meta_tensor(v)) touches_meta = true;
    else if (v.isList())
      for (const auto& element : v.toListRef()) touches_meta = touches_meta || is_meta_tensor(element);
  }
  if (!touches_meta) {
    c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::Fake);
    return op.callBoxed(stack);
  }

  Step step{op, std::vector<c10::IValue>(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end()), {}, {}, 0, {}, {}, 0, {}, {}};
  std::string refused;
  const auto& name = schema.name();
  if (name == "aten::resize_" || name == "aten::set_" || name == "aten::resize_as_")
    refused = name + " changed its storage";

  // The meta inputs: written (in-place), shape-only (factories), or read (sources).
  std::shared_ptr<Recipe> written_recipe, shape_recipe;
  auto refuse = [&](const at::Tensor& t, const std::string& why) {
    if (auto recipe = book.find(t)) {
      std::lock_guard lock(book.mutex);
      if (recipe->refused.empty()) recipe->refused = why;
    }
  };
  std::vector<const c10::StorageImpl*> input_storages;
  for (std::size_t i = 0; i < arguments.size(); ++i) {
    auto add_source = [&](const at::Tensor& t, std::optional<std::size_t> list_index) {
      input_storages.push_back(t.storage().unsafeGetStorageImpl());
      auto recipe = book.find(t);
      if (!recipe) {
        refused = "it read a meta tensor made outside build_on_meta";
        return;
      }
      step.sources.push_back({i, list_index, recipe, recipe->steps.size(), vec(t.sizes()), vec(t.strides()),
                              t.storage_offset()});
    };
    auto& value = step.arguments[i];
    if (is_meta_tensor(value)) {
      const auto t = value.toTensor();
      if (writes(arguments[i]) && !step.written) {
        input_storages.push_back(t.storage().unsafeGetStorageImpl());
        written_recipe = book.find(t);
        step.written = i;
        step.sizes = vec(t.sizes());
        step.strides = vec(t.strides());
        step.offset = t.storage_offset();
        value = c10::IValue();  // replaced by the storage's view when replayed
      } else if (writes(arguments[i])) {  // a second output written: not replayed, so refused
        refuse(t, name + " wrote it together with another tensor");
        add_source(t, std::nullopt);
        value = c10::IValue();
      } else if (factory) {
        if (!shape_recipe) shape_recipe = book.find(t);
        value = shape_only(t);
      } else {
        add_source(t, std::nullopt);
        value = c10::IValue();
      }
    } else if (value.isTensorList()) {
      auto list = value.toTensorVector();
      for (std::size_t k = 0; k < list.size(); ++k) {
        if (!list[k].defined() || !list[k].is_meta()) continue;
        if (writes(arguments[i])) refuse(list[k], name + " wrote it in a list of tensors");
        add_source(list[k], k);
      }
    } else if (value.isList()) {  // Tensor?[] (index_put_'s indices): not replayed
      for (const auto& element : value.toListRef())
        if (is_meta_tensor(element)) refused = name + " read meta tensors in a list of optional tensors";
    } else if (value.isTensor() && value.toTensor().defined()) {
      // A real tensor (a constant copied in): kept as it is now, not as it may be later.
      c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::Fake);
      value = value.toTensor().clone();
    }
  }
  for (auto& source : step.sources)
    if (source.list_index) {  // the list keeps its other (real) tensors; meta ones come from sources
      auto list = step.arguments[source.argument].toTensorVector();
      list[*source.list_index] = at::Tensor();
      step.arguments[source.argument] = list;
    }

  // Where a real build would have run it: the device asked for, else its
  // inputs'. A meta device asked for (options taken from a meta tensor,
  // torch::ones(n, weight.options())) stands for the inputs' too.
  at::Device where = at::kCPU;
  auto& asked = device_argument ? step.arguments[*device_argument] : step.arguments.front();
  if (device_argument && !asked.isNone() && asked.toDevice().is_meta()) asked = c10::IValue();
  if (device_argument && !asked.isNone()) where = asked.toDevice();
  else if (written_recipe) where = written_recipe->device;
  else if (shape_recipe) where = shape_recipe->device;
  else if (!step.sources.empty()) where = step.sources.front().recipe->device;
  if (!where.is_cpu() && !where.has_index())  // the device current now, not when it is replayed
    where = c10::impl::getDeviceGuardImpl(where.type())->getDevice();
  if (device_argument) asked = c10::IValue(where);

  if (draws_random_numbers(schema) && refused.empty() && (written_recipe || !step.written)) {
    const bool given = generator_argument && !step.arguments[*generator_argument].isNone();
    at::Generator generator =
        given ? step.arguments[*generator_argument].toGenerator() : at::globalContext().defaultGenerator(where);
    {
      std::lock_guard lock(generator.mutex());
      step.generator_state = generator.get_state();
    }
    step.generator = generator;
    c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::Fake);
    advance_generator(step, written_recipe);
  }

  // The operator itself, on meta tensors.
  if (device_argument) (*stack)[first + *device_argument] = c10::IValue(c10::Device(c10::kMeta));
  {
    c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::Fake);
    op.callBoxed(stack);
  }

  if (step.written) {
    if (!written_recipe) return;  // a tensor made outside the build: refused when materialised
    std::lock_guard lock(book.mutex);
    if (!refused.empty() && written_recipe->refused.empty()) written_recipe->refused = refused;
    written_recipe->steps.push_back(std::move(step));
    return;
  }
  // New storages among the results: recipes that start here.
  const auto returns = schema.returns().size();
  for (std::size_t j = 0; j < returns; ++j) {
    const auto& out = (*stack)[stack->size() - returns + j];
    if (!is_meta_tensor(out)) continue;
    const auto t = out.toTensor();
    const auto* storage = t.storage().unsafeGetStorageImpl();
    if (std::find(input_storages.begin(), input_storages.end(), storage) != input_storages.end()) continue;  // a view
    if (book.find(t)) continue;
    auto recipe = std::make_shared<Recipe>();
    recipe->storage = t.storage();
    recipe->device = where;
    recipe->dtype = t.scalar_type();
    recipe->numel = static_cast<std::int64_t>(t.storage().nbytes() / t.element_size());
    recipe->refused = refused;
    Step created = step;
    created.result = j;
    created.sizes = vec(t.sizes());
    created.strides = vec(t.strides());
    created.offset = t.storage_offset();
    recipe->steps.push_back(std::move(created));
    std::lock_guard lock(book.mutex);
    book.by_storage[storage] = std::move(recipe);
  }
}

// build_on_meta records; build_shapes_on_meta only sends tensors to meta.
inline thread_local bool record_initialisers = true;

inline void to_meta_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (record_initialisers) return record_and_run(op, stack);
  if (const auto device = argument_named(op.schema(), "device"))
    (*stack)[stack->size() - op.schema().arguments().size() + *device] = c10::IValue(c10::Device(c10::kMeta));
  c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::Fake);
  op.callBoxed(stack);
}

// Registered once, on first use, for the life of the program.
inline void register_meta_fallback() {
  static const auto* library = [] {
    auto* lib = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::Fake, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&to_meta_fallback>());
    return lib;
  }();
  (void)library;
}

// Gives a meta parameter real data in place: its TensorImpl (which the
// module's members, e.g. LinearImpl::weight, share) takes the new tensor's
// storage and device. set_data refuses a meta -> CPU change of type, so the
// metadata is copied first and set_data then drops autograd's accumulator,
// which still expects a meta gradient.
inline void give_data(const at::Tensor& meta, const at::Tensor& data) {
  meta.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
  const_cast<at::Tensor&>(meta).set_data(data);
}


// The recipe materialized() replays for `t`, or the sentence saying why there is none.
inline std::shared_ptr<const Recipe> replayable_recipe(const at::Tensor& t, const std::string& name) {
  auto recipe = recipe_book().find(t);
  if (!recipe)
    throw std::logic_error("accel: '" + name +
                           "' is a meta tensor that build_on_meta did not make (build_shapes_on_meta keeps shapes "
                           "only; or it was made again outside it, e.g. by model->to(dtype)): build the whole model, "
                           "conversions included, inside accel::device::build_on_meta");
  if (const auto why = refusal_of(*recipe); !why.empty())
    throw std::logic_error("accel: '" + name + "' cannot be computed again: " + why +
                           " while the model was built on the meta device; initialise it with operators on its own "
                           "storage (normal_, uniform_, fill_, copy_ from another tensor)");
  return recipe;
}

}  // namespace accel::deferred_init::detail
