#pragma once
// Building a model without allocating its weights. LibTorch's C++ modules
// create their parameters with the default options (host memory) and
// initialise them at once; there is no torch.device("meta") context in C++.
// build_on_meta runs the constructor with one more dispatch key enabled for
// the thread (Fake, the out-of-tree key torchdistx's fake tensors used),
// whose fallback sends every operator's `device` argument to the meta
// device. Parameters come out as meta tensors: shapes, dtypes and module
// structure without storage, and initialisers run as no-ops on them.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Device.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <utility>

namespace accel::device {

namespace detail {

inline void to_meta_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const auto first = stack->size() - arguments.size();
  for (std::size_t i = 0; i < arguments.size(); ++i)
    if (arguments[i].name() == "device") (*stack)[first + i] = c10::IValue(c10::Device(c10::kMeta));
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

}  // namespace detail

/// Returns what `build()` returns, every tensor it created on the meta device.
///   auto gpt = accel::device::build_on_meta([&] { return gpt::make_gpt(config, tp); });
template <class Build>
auto build_on_meta(Build&& build) -> decltype(std::forward<Build>(build)()) {
  detail::register_meta_fallback();
  c10::impl::IncludeDispatchKeyGuard meta(c10::DispatchKey::Fake);
  return std::forward<Build>(build)();
}

}  // namespace accel::device
