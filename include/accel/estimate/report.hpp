#pragma once
// The table `accel estimate-memory` prints: per-rank bytes of each strategy
// on each number of processes. Torch-free.

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "accel/estimate/model_state.hpp"

namespace accel::estimate {

/// Which strategies the table compares, with the settings that change their
/// figures (the same fields, and defaults, as the policies).
struct ReportOptions {
  std::vector<int> num_processes{1, 2, 4, 8};
  OptimizerShape optimizer{};
  double bucket_cap_mb = 25.0;  ///< ZeRO-1/2
  double first_bucket_cap_mb = 1.0;
  AutoWrapPolicy auto_wrap_policy = AutoWrapPolicy::NO_WRAP;  ///< ZeRO-3
  std::int64_t min_num_params = 100'000'000;
  std::vector<std::string> transformer_layer_cls_to_wrap{};
  bool cpu_offload = true;     ///< add the ZeRO rows with cpu_offload
  int shard_group_size = 0;    ///< > 0: add HybridShard rows (where it divides)
};

struct ReportRow {
  std::string strategy;
  int processes = 1;
  ModelStateBytes state{};
  std::optional<std::int64_t> activations{};  ///< per rank, at its own batch
  std::int64_t step_buffers = 0;  ///< kept between steps (ZeRO-3, HybridShard): NOTE [Step buffers in the estimate]
  /// What the training device holds: model state, the kept step buffers and the activations.
  std::int64_t device_bytes() const { return state.total() + step_buffers + activations.value_or(0); }
};

/// The rows for `shape`; `activations` (per rank, at the per-process batch)
/// is the same for every strategy, as each rank runs its own batch whole.
inline std::vector<ReportRow> report(const ModelShape& shape, std::optional<std::int64_t> activations,
                                     const ReportOptions& options = {}) {
  const ZeRO<3> zero3{.auto_wrap_policy = options.auto_wrap_policy, .min_num_params = options.min_num_params,
                      .transformer_layer_cls_to_wrap = options.transformer_layer_cls_to_wrap};
  std::vector<ReportRow> rows;
  auto add = [&](std::string name, int world, const ModelStateBytes& state, std::int64_t kept_buffers = 0) {
    rows.push_back({std::move(name), world, state, activations, kept_buffers});
  };
  for (int world : options.num_processes) {
    add(world == 1 ? "single process" : "DDP", world, model_state(shape, DDP{}, world, options.optimizer));
    if (world == 1) continue;
    for (bool offload : {false, true}) {
      if (offload && !options.cpu_offload) continue;
      const std::string suffix = offload ? " + cpu_offload" : "";
      add("ZeRO-1" + suffix, world,
          model_state(shape, ZeRO<1>{.bucket_cap_mb = options.bucket_cap_mb, .first_bucket_cap_mb = options.first_bucket_cap_mb, .cpu_offload = offload},
                      world, options.optimizer));
      add("ZeRO-2" + suffix, world,
          model_state(shape, ZeRO<2>{.bucket_cap_mb = options.bucket_cap_mb, .first_bucket_cap_mb = options.first_bucket_cap_mb, .cpu_offload = offload},
                      world, options.optimizer));
      auto z3 = zero3;
      z3.cpu_offload = offload;
      const auto z3_estimate = sharded_estimate(shape, z3, world, options.optimizer);
      add("ZeRO-3" + suffix, world, z3_estimate.state, z3_estimate.buffers.bytes);
    }
    const int shards = options.shard_group_size;
    if (shards > 0 && shards < world && world % shards == 0) {
      const HybridShard hybrid{.zero = zero3, .shard_group_size = shards};
      const auto hybrid_estimate = sharded_estimate(shape, hybrid, world, options.optimizer);
      add("HybridShard (" + std::to_string(shards) + " per group)", world, hybrid_estimate.state,
          hybrid_estimate.buffers.bytes);
    }
  }
  return rows;
}

/// Bytes for people: 1024-based units, three significant digits.
inline std::string human_bytes(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : value < 10 ? "%.2f %s" : value < 100 ? "%.1f %s" : "%.0f %s", value,
                units[unit]);
  return text;
}

/// The rows as an aligned table, one line per row, with a header.
inline std::string format_report(const std::vector<ReportRow>& rows) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-30s %5s %11s %11s %11s %12s %11s %11s %11s\n", "strategy", "procs", "parameters",
                "gradients", "optimizer", "step buffers", "activations", "per rank", "host");
  out += line;
  for (const auto& r : rows) {
    std::snprintf(line, sizeof line, "%-30s %5d %11s %11s %11s %12s %11s %11s %11s\n", r.strategy.c_str(), r.processes,
                  human_bytes(r.state.parameters).c_str(), human_bytes(r.state.gradients).c_str(),
                  human_bytes(r.state.optimizer_state).c_str(), r.step_buffers > 0 ? human_bytes(r.step_buffers).c_str() : "-",
                  r.activations ? human_bytes(*r.activations).c_str() : "-", human_bytes(r.device_bytes()).c_str(),
                  r.state.offloaded_total() > 0 ? human_bytes(r.state.offloaded_total()).c_str() : "-");
    out += line;
  }
  return out;
}

}  // namespace accel::estimate
