#pragma once
// Experiment trackers, Accelerate's `log_with`: `Trainer::init_trackers`
// starts them on the main process, `log` hands each the same values, and
// `end_training` finishes them. Built in (TrainerOptions::log_with):
//   "jsonl"        project_dir/<project>/metrics.jsonl, one JSON object per log (the default)
//   "csv"          project_dir/<project>/metrics.csv, a column per value
//   "tensorboard"  project_dir/<project>/events.out.tfevents.*, scalars and texts TensorBoard reads
//   "all"          all three
// A user's own tracker is any type meeting `accel::tracking::tracker`
// (Accelerate's GeneralTracker) passed to init_trackers. Torch-free.
//
// Values are a JSON object: numbers (and booleans, as 0/1) are scalars,
// strings are texts, nested objects are flattened to "outer/inner" tags
// (Accelerate's add_scalars). The run's configuration goes to config.json
// beside the metrics, and to TensorBoard as the text "config".

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "accel/core/compiled_once.hpp"
#include "accel/core/errors.hpp"
#include "accel/core/json.hpp"
#include "accel/tracking/tensorboard.hpp"

namespace accel::tracking {

using Values = nlohmann::json;

/// What a tracker provides (Accelerate's GeneralTracker): a name,
/// the run's configuration once, values at a step, and an end.
template <class T>
concept tracker = requires(T& t, const Values& values, std::int64_t step) {
  { t.name() } -> std::convertible_to<std::string>;
  t.store_init_configuration(values);
  t.log(values, step);
  t.finish();
};

/// `values` with nested objects flattened to "outer/inner" keys, in key order.
ACCEL_COMPILED_ONCE std::vector<std::pair<std::string, Values>> flatten(const Values& values, const std::string& prefix = "");

namespace detail {
void write_config(const std::filesystem::path& run_dir, const Values& config);
}  // namespace detail

/// One JSON object per line: {"step": s, "time": unix seconds, ...values}.
class JsonlTracker {
 public:
  explicit JsonlTracker(std::filesystem::path run_dir);
  std::string name() const { return "jsonl"; }
  void store_init_configuration(const Values& config) { detail::write_config(dir_, config); }
  void log(const Values& values, std::int64_t step);
  void finish() { out_.close(); }

 private:
  std::filesystem::path dir_;
  std::ofstream out_;
};

/// metrics.csv: step, time, then a column per value in order of first
/// appearance. A log with a new value rewrites the file with the wider
/// header (earlier rows get empty cells), so every row has every column.
/// A run that resumes into the same folder continues the file.
class CsvTracker {
 public:
  explicit CsvTracker(std::filesystem::path run_dir) : dir_(std::move(run_dir)) {
    std::filesystem::create_directories(dir_);
    read_existing();
  }
  std::string name() const { return "csv"; }
  void store_init_configuration(const Values& config) { detail::write_config(dir_, config); }
  void log(const Values& values, std::int64_t step);
  void finish() {}

 private:
  static std::string quoted(const std::string& text) {
    if (text.find_first_of(",\"\n") == std::string::npos) return text;
    std::string out = "\"";
    for (char c : text) out += c == '"' ? std::string("\"\"") : std::string(1, c);
    return out + "\"";
  }
  static std::string cell(const Values& value);
  std::filesystem::path file() const { return dir_ / "metrics.csv"; }
  // Cells of one line as written by quoted() (quotes kept, so rows rewrite unchanged).
  static std::vector<std::string> cells(const std::string& text) {
    std::vector<std::string> out(1);
    bool quoting = false;
    for (char c : text) {
      if (c == '"') quoting = !quoting;
      if (c == ',' && !quoting) out.emplace_back();
      else out.back() += c;
    }
    return out;
  }
  static std::string unquoted(const std::string& cell) {
    if (cell.size() < 2 || cell.front() != '"') return cell;
    std::string out;
    for (std::size_t i = 1; i + 1 < cell.size(); ++i) {
      out += cell[i];
      if (cell[i] == '"') ++i;  // "" is one quote
    }
    return out;
  }
  void read_existing() {
    std::ifstream in(file());
    std::string header;
    if (!in || !std::getline(in, header)) return;
    auto names = cells(header);
    if (names.size() < 2 || names[0] != "step" || names[1] != "time")
      throw std::runtime_error("accel: " + file().string() + " is not a metrics file accel wrote (its header is '" +
                               header + "'): move it away or log to another project");
    for (std::size_t i = 2; i < names.size(); ++i) columns_.push_back(unquoted(names[i]));
    // A row may hold newlines inside quotes: join lines until the quotes balance.
    for (std::string text, line; std::getline(in, line);) {
      text += text.empty() ? line : "\n" + line;
      if (std::count(text.begin(), text.end(), '"') % 2 != 0) continue;
      auto values = cells(text);
      std::map<std::string, std::string> row;
      for (std::size_t i = 0; i < values.size() && i < names.size(); ++i)
        if (!values[i].empty()) row[i < 2 ? names[i] : unquoted(names[i])] = values[i];
      if (row.count("step") && row.count("time")) rows_.push_back(std::move(row));
      text.clear();
    }
  }
  std::string line(const std::map<std::string, std::string>& row) const {
    std::string out;
    for (const char* fixed : {"step", "time"}) out += row.at(fixed) + ",";
    for (const auto& column : columns_) {
      auto it = row.find(column);
      out += (it == row.end() ? "" : it->second) + ",";
    }
    out.back() = '\n';
    return out;
  }
  void append(const std::map<std::string, std::string>& row) {
    std::ofstream out(file(), std::ios::app);
    out << line(row);
    if (!out) throw std::runtime_error("accel: cannot write " + file().string());
  }
  void rewrite() {  // through a rename, so a reader never sees half a file
    const auto tmp = std::filesystem::path(file().string() + ".tmp");
    {
      std::ofstream out(tmp);
      out << "step,time";
      for (const auto& column : columns_) out << ',' << quoted(column);
      out << '\n';
      for (const auto& row : rows_) out << line(row);
      if (!out) throw std::runtime_error("accel: cannot write " + tmp.string());
    }
    std::filesystem::rename(tmp, file());
  }

  std::filesystem::path dir_;
  std::vector<std::string> columns_;
  std::vector<std::map<std::string, std::string>> rows_;
};

/// Scalars and texts in a TensorBoard event file (`tensorboard --logdir project_dir`).
class TensorBoardTracker {
 public:
  explicit TensorBoardTracker(const std::filesystem::path& run_dir) : writer_(run_dir) {}
  std::string name() const { return "tensorboard"; }
  void store_init_configuration(const Values& config);
  void log(const Values& values, std::int64_t step);
  void finish() {}
  const std::filesystem::path& event_file() const { return writer_.path(); }

 private:
  EventFileWriter writer_;
};

/// Any tracker, by value (type-erased).
class AnyTracker {
 public:
  template <tracker T>
  explicit AnyTracker(T t) : self_(std::make_unique<Model<T>>(std::move(t))) {}

  std::string name() const { return self_->name(); }
  void store_init_configuration(const Values& config) { self_->store_init_configuration(config); }
  void log(const Values& values, std::int64_t step) { self_->log(values, step); }
  void finish() { self_->finish(); }
  /// The tracker itself if it is a T, else nullptr (Accelerate's get_tracker(..., unwrap=True)).
  template <class T>
  T* get() {
    auto* model = dynamic_cast<Model<T>*>(self_.get());
    return model ? &model->tracker : nullptr;
  }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual std::string name() const = 0;
    virtual void store_init_configuration(const Values&) = 0;
    virtual void log(const Values&, std::int64_t) = 0;
    virtual void finish() = 0;
  };
  template <class T>
  struct Model final : Base {
    explicit Model(T t) : tracker(std::move(t)) {}
    std::string name() const override { return tracker.name(); }
    void store_init_configuration(const Values& c) override { tracker.store_init_configuration(c); }
    void log(const Values& v, std::int64_t s) override { tracker.log(v, s); }
    void finish() override { tracker.finish(); }
    T tracker;
  };
  std::unique_ptr<Base> self_;
};

/// The built-in names TrainerOptions::log_with takes, checked before any
/// rank connects ("all" is every built-in one; empty: "jsonl").
std::vector<std::string> built_in_trackers(const std::vector<std::string>& log_with);

/// The trackers of one run, each given every call.
class Trackers {
 public:
  /// Starts the built-in trackers named by `log_with` in project_dir/project,
  /// then `custom`, and stores `config` with each (null: an empty object).
  void start(const std::vector<std::string>& log_with, const std::filesystem::path& project_dir,
             const std::string& project, const Values& config, std::vector<AnyTracker> custom);
  /// The same with an empty configuration.
  void start(const std::vector<std::string>& log_with, const std::filesystem::path& project_dir,
             const std::string& project, std::vector<AnyTracker> custom);
  void log(const Values& values, std::int64_t step) {
    for (auto& t : trackers_) t.log(values, step);
  }
  void finish() {
    for (auto& t : trackers_) t.finish();
    trackers_.clear();
  }
  bool started() const { return !trackers_.empty(); }
  /// The first tracker of type T, or nullptr.
  template <class T>
  T* get() {
    for (auto& t : trackers_)
      if (T* found = t.get<T>()) return found;
    return nullptr;
  }

 private:
  std::vector<AnyTracker> trackers_;
};

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE std::vector<std::pair<std::string, Values>> flatten(const Values& values, const std::string& prefix) {
  if (!values.is_object()) throw std::invalid_argument("accel: log values must be a JSON object, got " + values.dump());
  std::vector<std::pair<std::string, Values>> out;
  for (const auto& [key, value] : values.items()) {
    const std::string tag = prefix.empty() ? key : prefix + "/" + key;
    if (value.is_object()) {
      auto inner = flatten(value, tag);
      out.insert(out.end(), inner.begin(), inner.end());
    } else {
      out.emplace_back(tag, value);
    }
  }
  return out;
}


ACCEL_COMPILED_ONCE JsonlTracker::JsonlTracker(std::filesystem::path run_dir) : dir_(std::move(run_dir)) {
  std::filesystem::create_directories(dir_);
  out_.open(dir_ / "metrics.jsonl", std::ios::app);
  if (!out_) throw std::runtime_error("accel: cannot write " + (dir_ / "metrics.jsonl").string());
}

ACCEL_COMPILED_ONCE void JsonlTracker::log(const Values& values, std::int64_t step) {
  Values line = Values::object();
  line["step"] = step;
  line["time"] = detail::wall_time();
  for (auto& [tag, value] : flatten(values)) line[tag] = value;
  out_ << line.dump() << '\n' << std::flush;
}

ACCEL_COMPILED_ONCE void CsvTracker::log(const Values& values, std::int64_t step) {
  std::map<std::string, std::string> row{{"step", std::to_string(step)}, {"time", cell(Values(detail::wall_time()))}};
  bool widened = false;
  for (auto& [tag, value] : flatten(values)) {
    if (std::find(columns_.begin(), columns_.end(), tag) == columns_.end()) columns_.push_back(tag), widened = true;
    row[tag] = cell(value);
  }
  rows_.push_back(std::move(row));
  if (widened || rows_.size() == 1) rewrite();
  else append(rows_.back());
}

ACCEL_COMPILED_ONCE std::string CsvTracker::cell(const Values& value) {
  if (value.is_string()) return quoted(value.get<std::string>());
  if (value.is_boolean()) return value.get<bool>() ? "1" : "0";
  return quoted(value.dump());
}

ACCEL_COMPILED_ONCE void TensorBoardTracker::store_init_configuration(const Values& config) {
  writer_.write(0, std::vector<std::string>{text_value("config", config.dump(2))});
}

ACCEL_COMPILED_ONCE void TensorBoardTracker::log(const Values& values, std::int64_t step) {
  std::vector<std::string> summary;
  for (auto& [tag, value] : flatten(values)) {
    if (value.is_number()) summary.push_back(scalar_value(tag, value.get<float>()));
    else if (value.is_boolean()) summary.push_back(scalar_value(tag, value.get<bool>() ? 1.0f : 0.0f));
    else if (value.is_string()) summary.push_back(text_value(tag, value.get<std::string>()));
    else summary.push_back(text_value(tag, value.dump()));
  }
  writer_.write(step, summary);
}

ACCEL_COMPILED_ONCE void Trackers::start(const std::vector<std::string>& log_with, const std::filesystem::path& project_dir,
                                         const std::string& project, const Values& config, std::vector<AnyTracker> custom) {
  if (project.empty() || project.find('/') != std::string::npos || project == "." || project == "..")
    throw std::invalid_argument("accel: init_trackers needs a project name that is one folder name, got '" + project +
                                "'");
  finish();
  const auto run_dir = project_dir / project;
  for (const auto& name : built_in_trackers(log_with)) {
    if (name == "jsonl") trackers_.emplace_back(JsonlTracker(run_dir));
    else if (name == "csv") trackers_.emplace_back(CsvTracker(run_dir));
    else trackers_.emplace_back(TensorBoardTracker(run_dir));
  }
  for (auto& t : custom) trackers_.push_back(std::move(t));
  for (auto& t : trackers_) t.store_init_configuration(config.is_null() ? Values::object() : config);
}

ACCEL_COMPILED_ONCE void Trackers::start(const std::vector<std::string>& log_with, const std::filesystem::path& project_dir,
                                         const std::string& project, std::vector<AnyTracker> custom) {
  start(log_with, project_dir, project, Values::object(), std::move(custom));
}

ACCEL_COMPILED_ONCE std::vector<std::string> built_in_trackers(const std::vector<std::string>& log_with) {
  static const std::vector<std::string> known = {"jsonl", "csv", "tensorboard"};
  if (log_with.empty()) return {"jsonl"};
  std::vector<std::string> out;
  for (const auto& name : log_with) {
    if (name == "all") return known;
    if (std::find(known.begin(), known.end(), name) == known.end())
      throw ConfigurationError("accel: log_with '" + name + "' is not a tracker accel has: use jsonl, csv, "
                               "tensorboard or all, or pass your own tracker to init_trackers");
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

ACCEL_COMPILED_ONCE void detail::write_config(const std::filesystem::path& run_dir, const Values& config) {
  std::filesystem::create_directories(run_dir);
  std::ofstream out(run_dir / "config.json");
  out << config.dump(2) << '\n';
  if (!out) throw std::runtime_error("accel: cannot write " + (run_dir / "config.json").string());
}

#endif

}  // namespace accel::tracking
