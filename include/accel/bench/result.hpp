#pragma once
// What a strategy comparison reports (bench/compare.hpp): per strategy, the
// step time of the slowest rank, throughput, the ratio to the first
// strategy per round, and per rank the time blocked on communication, the
// model state, the peak memory and the bytes moved per kind of collective
// beside the formula's. As a table for people and JSON lines for programs.
// Torch-free.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "accel/bench/traffic_model.hpp"
#include "accel/comm/traffic.hpp"

namespace accel::bench {

/// One rank's figures for one strategy (the last round's).
struct RankFigures {
  int rank = 0;
  /// Bytes and calls per kind of collective over the timed steps of a round.
  TrafficBytes bytes{};
  TrafficBytes calls{};
  double blocked_ms_per_step = 0;      ///< waiting on collectives (comm/traffic.hpp)
  std::int64_t model_state_bytes = 0;  ///< Trainer::model_state_bytes(): the sum of the four below
  std::int64_t parameter_bytes = 0;
  std::int64_t gradient_bytes = 0;
  std::int64_t optimizer_state_bytes = 0;
  std::int64_t offloaded_bytes = 0;  ///< cpu_offload's host copies
  std::int64_t peak_memory_bytes = 0;  ///< device/peak_memory.hpp, highest of the rounds
};

struct CaseResult {
  std::string name;
  bool ok = true;
  std::string error;  ///< why it failed, as the failing rank said it
  int world = 1;
  int data_world = 1;                  ///< ranks reading different data
  std::int64_t samples_per_step = 0;   ///< global batch: per-rank batch x data_world
  int steps = 0;                       ///< timed steps per round
  std::vector<double> step_ms;         ///< every timed step of every round, slowest rank's time
  double median_ms = 0, p90_ms = 0;
  double samples_per_s = 0;            ///< samples_per_step / median step
  std::vector<double> ratio_by_round;  ///< median step / the first strategy's, per round
  double ratio = 0;                    ///< median of ratio_by_round
  std::vector<RankFigures> ranks;
  std::optional<TrafficBytes> predicted;  ///< the formula's bytes per step (bench/traffic_model.hpp)
  /// A sharded engine's buckets as it built them, in bucket order (elements
  /// before padding; this rank's, the same on every rank); empty for the others.
  std::vector<std::int64_t> bucket_numels;

  /// Bytes per step of `kind` measured on `rank`.
  double bytes_per_step(comm::Collective kind, int rank = 0) const {
    return steps > 0 ? static_cast<double>(ranks.at(rank).bytes[static_cast<std::size_t>(kind)]) / steps : 0.0;
  }
};

inline double median_of(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

/// The nearest-rank percentile (p in [0, 100]).
inline double percentile_of(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(values.size())));
  return values[std::clamp<std::size_t>(rank, 1, values.size()) - 1];
}

// ---------------------------------------------------------------- JSON

namespace detail {
inline nlohmann::json per_kind(const TrafficBytes& values, double divisor) {
  nlohmann::json out = nlohmann::json::object();
  for (std::size_t k = 0; k < comm::collective_kinds; ++k)
    if (values[k]) out[std::string(comm::collective_name(static_cast<comm::Collective>(k)))] = values[k] / divisor;
  return out;
}
inline TrafficBytes from_per_kind(const nlohmann::json& j, double multiplier) {
  TrafficBytes out{};
  for (std::size_t k = 0; k < comm::collective_kinds; ++k) {
    const std::string name(comm::collective_name(static_cast<comm::Collective>(k)));
    if (j.contains(name)) out[k] = static_cast<std::uint64_t>(std::llround(j.at(name).get<double>() * multiplier));
  }
  return out;
}
}  // namespace detail

/// One JSON object per strategy (a JSON line): bytes are per step.
inline nlohmann::json to_json(const CaseResult& r) {
  nlohmann::json j{{"name", r.name}, {"ok", r.ok}, {"world", r.world}, {"data_world", r.data_world},
                   {"samples_per_step", r.samples_per_step}, {"steps", r.steps}};
  if (!r.ok) j["error"] = r.error;
  j["step_ms"] = r.step_ms;
  j["median_ms"] = r.median_ms;
  j["p90_ms"] = r.p90_ms;
  j["samples_per_s"] = r.samples_per_s;
  j["ratio_by_round"] = r.ratio_by_round;
  j["ratio"] = r.ratio;
  const double steps = r.steps > 0 ? r.steps : 1;
  j["ranks"] = nlohmann::json::array();
  for (const auto& f : r.ranks)
    j["ranks"].push_back({{"rank", f.rank},
                          {"bytes_per_step", detail::per_kind(f.bytes, steps)},
                          {"calls_per_step", detail::per_kind(f.calls, steps)},
                          {"blocked_ms_per_step", f.blocked_ms_per_step},
                          {"model_state_bytes", f.model_state_bytes},
                          {"parameter_bytes", f.parameter_bytes},
                          {"gradient_bytes", f.gradient_bytes},
                          {"optimizer_state_bytes", f.optimizer_state_bytes},
                          {"offloaded_bytes", f.offloaded_bytes},
                          {"peak_memory_bytes", f.peak_memory_bytes}});
  j["predicted_bytes_per_step"] = r.predicted ? detail::per_kind(*r.predicted, 1) : nlohmann::json(nullptr);
  j["bucket_numels"] = r.bucket_numels;
  return j;
}

inline CaseResult case_from_json(const nlohmann::json& j) {
  CaseResult r;
  r.name = j.at("name").get<std::string>();
  r.ok = j.at("ok").get<bool>();
  r.error = j.value("error", "");
  r.world = j.at("world").get<int>();
  r.data_world = j.at("data_world").get<int>();
  r.samples_per_step = j.at("samples_per_step").get<std::int64_t>();
  r.steps = j.at("steps").get<int>();
  r.step_ms = j.at("step_ms").get<std::vector<double>>();
  r.median_ms = j.at("median_ms").get<double>();
  r.p90_ms = j.at("p90_ms").get<double>();
  r.samples_per_s = j.at("samples_per_s").get<double>();
  r.ratio_by_round = j.at("ratio_by_round").get<std::vector<double>>();
  r.ratio = j.at("ratio").get<double>();
  const double steps = r.steps > 0 ? r.steps : 1;
  for (const auto& f : j.at("ranks"))
    r.ranks.push_back({.rank = f.at("rank").get<int>(),
                       .bytes = detail::from_per_kind(f.at("bytes_per_step"), steps),
                       .calls = detail::from_per_kind(f.at("calls_per_step"), steps),
                       .blocked_ms_per_step = f.at("blocked_ms_per_step").get<double>(),
                       .model_state_bytes = f.at("model_state_bytes").get<std::int64_t>(),
                       .parameter_bytes = f.at("parameter_bytes").get<std::int64_t>(),
                       .gradient_bytes = f.at("gradient_bytes").get<std::int64_t>(),
                       .optimizer_state_bytes = f.at("optimizer_state_bytes").get<std::int64_t>(),
                       .offloaded_bytes = f.at("offloaded_bytes").get<std::int64_t>(),
                       .peak_memory_bytes = f.at("peak_memory_bytes").get<std::int64_t>()});
  if (!j.at("predicted_bytes_per_step").is_null())
    r.predicted = detail::from_per_kind(j.at("predicted_bytes_per_step"), 1);
  r.bucket_numels = j.value("bucket_numels", std::vector<std::int64_t>{});  // absent in files before it
  return r;
}

// ---------------------------------------------------------------- table

namespace detail {
inline std::string megabytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, bytes == 0 ? "0" : bytes < 1e5 ? "%.4f" : "%.2f", bytes / 1e6);
  return text;
}
// The highest figure over the ranks: what bounds a job.
template <class Field>
double most(const CaseResult& r, Field field) {
  double m = 0;
  for (const auto& f : r.ranks) m = std::max(m, static_cast<double>(field(f)));
  return m;
}
}  // namespace detail

/// The comparison as a table: one row per strategy; memory and traffic are
/// the highest rank's, traffic as "measured (formula)" MB per step.
inline std::string format_table(const std::vector<CaseResult>& results) {
  using comm::Collective;
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-22s %5s %17s %10s %8s %9s %10s %9s  %s\n", "strategy", "ranks",
                "step ms p50/p90", "samples/s", "vs first", "blocked", "state MB", "peak MB",
                "MB per step: measured (formula)");
  out += line;
  for (const auto& r : results) {
    if (!r.ok) {
      std::string error = r.error.substr(0, r.error.find('\n'));
      std::snprintf(line, sizeof line, "%-22s %5d  failed: %s\n", r.name.c_str(), r.world, error.c_str());
      out += line;
      continue;
    }
    std::string traffic;
    for (auto kind : {Collective::all_reduce, Collective::reduce_scatter, Collective::all_gather,
                      Collective::broadcast, Collective::all_to_all, Collective::send, Collective::recv}) {
      const auto k = static_cast<std::size_t>(kind);
      const double measured = detail::most(r, [&](const RankFigures& f) { return f.bytes[k]; }) / std::max(r.steps, 1);
      const double formula = r.predicted ? static_cast<double>((*r.predicted)[k]) : 0;
      if (measured == 0 && formula == 0) continue;
      traffic += std::string(traffic.empty() ? "" : ", ") + std::string(comm::collective_name(kind)) + " " +
                 detail::megabytes(measured) + (r.predicted ? " (" + detail::megabytes(formula) + ")" : "");
    }
    std::snprintf(line, sizeof line, "%-22s %5d %8.2f /%7.2f %10.0f %8.2f %9.2f %10s %9s  %s\n", r.name.c_str(),
                  r.world, r.median_ms, r.p90_ms, r.samples_per_s, r.ratio,
                  detail::most(r, [](const RankFigures& f) { return f.blocked_ms_per_step; }),
                  detail::megabytes(detail::most(r, [](const RankFigures& f) { return f.model_state_bytes; })).c_str(),
                  detail::megabytes(detail::most(r, [](const RankFigures& f) { return f.peak_memory_bytes; })).c_str(),
                  traffic.empty() ? "none" : traffic.c_str());
    out += line;
  }
  return out;
}

}  // namespace accel::bench
