#pragma once
// The bucket plan of NOTE [Gradient buckets] as a pure function (the c10d
// Reducer's compute_bucket_assignment_by_size): which parameters share a
// flat gradient buffer, at which offsets, padded to what. Torch-free, so it
// is unit-tested without processes (tests/core).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "accel/core/compiled_once.hpp"

namespace accel::strategy {

/// What the plan needs to know of one parameter.
struct ParameterSlot {
  std::int64_t numel = 0;
  std::int64_t element_size = 4;
  /// Parameters of different kinds (dtype and device) never share a bucket.
  int kind = 0;
  /// Nor of different keys: the optimizer parameter group (ZeRO steps a
  /// bucket's shard as one tensor of one group), and ZeRO-3's unit.
  int group = 0;
  int unit = 0;
};

struct BucketCaps {
  double first_mb = 1.0;  ///< small, so that communication starts early
  double rest_mb = 25.0;
};

struct PlanSettings {
  /// Size caps; none: one bucket per (kind, group, unit) run (ZeRO-3, whose
  /// unit of gathering is the unit anyway).
  std::optional<BucketCaps> caps = BucketCaps{};
  /// Each bucket is padded to a multiple of this (ZeRO: the shard count).
  std::int64_t pad_to_multiple = 1;
};

struct PlannedBucket {
  std::vector<std::size_t> params{};  ///< indices into the slots, in the order assigned
  std::vector<std::int64_t> offsets{};  ///< of each parameter in the flat buffer
  std::int64_t numel = 0;             ///< real elements
  std::int64_t padded = 0;            ///< numel rounded up to pad_to_multiple
  int group = 0;
  int unit = 0;
};

/// Parameters in reverse registration order (roughly the order backward
/// produces their gradients) join the open bucket, which closes once it holds
/// at least its cap, or when the next parameter is of another kind, group or unit.
std::vector<PlannedBucket> plan_buckets(const std::vector<ParameterSlot>& slots, const PlanSettings& settings);

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE std::vector<PlannedBucket> plan_buckets(const std::vector<ParameterSlot>& slots, const PlanSettings& settings) {
  constexpr double mib = 1024.0 * 1024.0;
  std::vector<PlannedBucket> planned;
  double bytes = 0;
  bool open = false;
  int open_kind = 0;
  for (std::size_t k = slots.size(); k-- > 0;) {
    const auto& p = slots[k];
    if (!open || open_kind != p.kind || planned.back().group != p.group || planned.back().unit != p.unit) {
      planned.push_back({.group = p.group, .unit = p.unit});
      open_kind = p.kind;
      bytes = 0;
      open = true;
    }
    auto& bucket = planned.back();
    bucket.params.push_back(k);
    bucket.offsets.push_back(bucket.numel);
    bucket.numel += p.numel;
    bytes += static_cast<double>(p.numel * p.element_size);
    if (settings.caps && bytes >= (planned.size() == 1 ? settings.caps->first_mb : settings.caps->rest_mb) * mib)
      open = false;
  }
  const std::int64_t pad = settings.pad_to_multiple;
  for (auto& bucket : planned) bucket.padded = (bucket.numel + pad - 1) / pad * pad;
  return planned;
}

#endif

}  // namespace accel::strategy
