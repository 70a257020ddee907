#pragma once
// A named range in LibTorch's profiler (at::RecordFunction, user scope):
// what accel's collectives and their waits appear as in a trace
// (profiling/profiler.hpp). When no profiler runs it costs one check of a
// thread-local flag, and the name is never built.

#include <ATen/record_function.h>

#include <optional>
#include <string>
#include <string_view>

#include "accel/compat/torch_compat.hpp"

namespace accel::profiling {

class Range {
 public:
  /// "<kind> <what>", e.g. "accel::wait all-reduce of DDP gradient bucket 0".
  Range(std::string_view kind, const std::string& what) {
    if (!at::hasCallbacks()) return;
    guard_.emplace(at::RecordScope::USER_SCOPE);
    if (!guard_->isActive()) return;
    name_.reserve(kind.size() + 1 + what.size());
    name_.append(kind).append(" ").append(what);
    compat::begin_record_function(*guard_, name_);
  }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  std::string name_;  // before guard_: it must outlive the range (destroyed after it)
  std::optional<at::RecordFunction> guard_;
};

}  // namespace accel::profiling
