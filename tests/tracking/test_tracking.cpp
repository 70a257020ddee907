// Trackers and the progress bar (torch-free): what each built-in tracker
// writes, read back; the TensorBoard event file read back by TensorBoard's
// own reader (ACCEL_TEST_PYTHON with the tensorboard package; skipped where
// it is absent); a user's tracker through the concept.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "../support/doctest.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "accel/tracking/progress.hpp"
#include "accel/tracking/trackers.hpp"

namespace fs = std::filesystem;
using accel::tracking::Values;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    char name[] = "/tmp/accel_tracking_XXXXXX";
    path = ::mkdtemp(name);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string read(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> lines(const fs::path& file) {
  std::vector<std::string> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// A user's own tracker: everything it is given, kept.
struct Recorder {
  std::vector<std::string>* seen;
  std::string name() const { return "recorder"; }
  void store_init_configuration(const Values& config) { seen->push_back("config " + config.dump()); }
  void log(const Values& values, std::int64_t step) { seen->push_back(std::to_string(step) + " " + values.dump()); }
  void finish() { seen->push_back("finish"); }
};
static_assert(accel::tracking::tracker<Recorder>);
static_assert(accel::tracking::tracker<accel::tracking::JsonlTracker>);
static_assert(accel::tracking::tracker<accel::tracking::CsvTracker>);
static_assert(accel::tracking::tracker<accel::tracking::TensorBoardTracker>);
static_assert(!accel::tracking::tracker<int>);

}  // namespace

TEST_CASE("CRC-32C and its TFRecord mask match the published check values") {
  // The CRC-32C check value (RFC 3720, B.4: "123456789" -> 0xE3069283) and 32 zero bytes -> 0x8A9136AA.
  CHECK(accel::tracking::crc32c("123456789") == 0xE3069283u);
  CHECK(accel::tracking::crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  const std::uint32_t crc = 0xE3069283u;
  CHECK(accel::tracking::masked_crc32c("123456789") == ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST_CASE("jsonl: one object per log with step, time and the flattened values; config beside it") {
  TempDir dir;
  accel::tracking::Trackers trackers;
  trackers.start({"jsonl"}, dir.path, "run", Values{{"lr", 0.1}, {"model", "mlp"}}, {});
  trackers.log(Values{{"loss", 0.5}, {"eval", {{"accuracy", 0.75}, {"note", "ok"}}}}, 3);
  trackers.log(Values{{"loss", 0.25}}, 4);
  trackers.finish();
  auto rows = lines(dir.path / "run" / "metrics.jsonl");
  REQUIRE(rows.size() == 2);
  auto first = Values::parse(rows[0]);
  CHECK(first["step"] == 3);
  CHECK(first["loss"] == 0.5);
  CHECK(first["eval/accuracy"] == 0.75);
  CHECK(first["eval/note"] == "ok");
  CHECK(first["time"].get<double>() > 1.7e9);  // seconds since 1970, not since start
  CHECK(Values::parse(rows[1])["step"] == 4);
  auto config = Values::parse(read(dir.path / "run" / "config.json"));
  CHECK(config == Values{{"lr", 0.1}, {"model", "mlp"}});
}

TEST_CASE("csv: a column per value; a new value widens the header and earlier rows keep their cells; a resumed run continues the file") {
  TempDir dir;
  {
    accel::tracking::Trackers trackers;
    trackers.start({"csv"}, dir.path, "run", {}, {});
    trackers.log(Values{{"loss", 0.5}}, 1);
    trackers.log(Values{{"loss", 0.25}, {"note", "a, \"quoted\" text"}}, 2);
  }
  auto rows = lines(dir.path / "run" / "metrics.csv");
  REQUIRE(rows.size() == 3);
  CHECK(rows[0] == "step,time,loss,note");
  CHECK(rows[1].starts_with("1,"));
  CHECK(rows[1].ends_with(",0.5,"));
  CHECK(rows[2].starts_with("2,"));
  CHECK(rows[2].ends_with(",0.25,\"a, \"\"quoted\"\" text\""));
  {  // resumed into the same folder: the old rows stay, the new ones follow
    accel::tracking::Trackers trackers;
    trackers.start({"csv"}, dir.path, "run", {}, {});
    trackers.log(Values{{"loss", 0.125}, {"lr", 0.01}}, 3);
  }
  rows = lines(dir.path / "run" / "metrics.csv");
  REQUIRE(rows.size() == 4);
  CHECK(rows[0] == "step,time,loss,note,lr");
  CHECK(rows[1].ends_with(",0.5,,"));
  CHECK(rows[2].ends_with(",0.25,\"a, \"\"quoted\"\" text\","));
  CHECK(rows[3].starts_with("3,"));
  CHECK(rows[3].ends_with(",0.125,,0.01"));
}

TEST_CASE("log_with: built-in names checked, all, and a user's tracker gets every call") {
  CHECK(accel::tracking::built_in_trackers({}) == std::vector<std::string>{"jsonl"});
  CHECK(accel::tracking::built_in_trackers({"all"}) == std::vector<std::string>{"jsonl", "csv", "tensorboard"});
  CHECK_THROWS_WITH_AS(accel::tracking::built_in_trackers({"wandb"}), doctest::Contains("log_with 'wandb'"),
                       accel::ConfigurationError);
  TempDir dir;
  std::vector<std::string> seen;
  accel::tracking::Trackers trackers;
  std::vector<accel::tracking::AnyTracker> custom;
  custom.emplace_back(Recorder{&seen});
  trackers.start({"csv"}, dir.path, "run", Values{{"seed", 7}}, std::move(custom));
  REQUIRE(trackers.get<Recorder>() != nullptr);
  CHECK(trackers.get<accel::tracking::CsvTracker>() != nullptr);
  CHECK(trackers.get<accel::tracking::JsonlTracker>() == nullptr);
  trackers.log(Values{{"loss", 1}}, 5);
  trackers.finish();
  CHECK(seen == std::vector<std::string>{"config {\"seed\":7}", "5 {\"loss\":1}", "finish"});
  CHECK_THROWS_WITH(trackers.start({}, dir.path, "a/b", {}, {}), doctest::Contains("one folder name"));
}

TEST_CASE("tensorboard: TensorBoard's own reader reads the scalars, texts and config back") {
  TempDir dir;
  fs::path event_file;
  {
    accel::tracking::Trackers trackers;
    trackers.start({"tensorboard"}, dir.path, "run", Values{{"lr", 0.1}}, {});
    event_file = trackers.get<accel::tracking::TensorBoardTracker>()->event_file();
    for (int step = 1; step <= 3; ++step)
      trackers.log(Values{{"loss", 1.0 / step}, {"eval", {{"accuracy", 0.5 + 0.1 * step}}}, {"phase", "train"}}, step);
  }
  CHECK(event_file.parent_path() == dir.path / "run");
  CHECK(event_file.filename().string().starts_with("events.out.tfevents."));
  // The records frame themselves: length, masked CRC of the length, data, masked CRC of the data.
  const std::string bytes = read(event_file);
  std::size_t at = 0, records = 0;
  while (at + 12 <= bytes.size()) {
    std::uint64_t length;
    std::memcpy(&length, bytes.data() + at, 8);
    std::uint32_t length_crc, data_crc;
    std::memcpy(&length_crc, bytes.data() + at + 8, 4);
    CHECK(length_crc == accel::tracking::masked_crc32c(bytes.substr(at, 8)));
    std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
    CHECK(data_crc == accel::tracking::masked_crc32c(bytes.substr(at + 12, length)));
    at += 16 + length;
    ++records;
  }
  CHECK(at == bytes.size());
  CHECK(records == 5);  // file version, config, three steps

  const char* python = std::getenv("ACCEL_TEST_PYTHON");
  const std::string py = python && *python ? python : "python3";
  if (std::system((py + " -c 'import tensorboard' 2>/dev/null").c_str()) != 0) {
    MESSAGE("skipped the TensorBoard read-back: " << py << " has no tensorboard package (pip install tensorboard)");
    return;
  }
  const fs::path script = dir.path / "read.py";
  std::ofstream(script) << R"(import sys, json
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0, 'tensors': 0})
acc.Reload()
tags = acc.Tags()
out = {'scalars': {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags['scalars']},
       'texts': {t: [[e.step, e.tensor_proto.string_val[0].decode()] for e in acc.Tensors(t)] for t in tags['tensors']}}
print(json.dumps(out))
)";
  const fs::path result = dir.path / "read.json";
  const std::string command = py + " " + script.string() + " " + (dir.path / "run").string() + " > " + result.string();
  REQUIRE(std::system(command.c_str()) == 0);
  const auto read_back = Values::parse(read(result));
  INFO(read_back.dump());
  const auto& loss = read_back["scalars"]["loss"];
  REQUIRE(loss.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(loss[i][0] == i + 1);
    CHECK(loss[i][1].get<double>() == doctest::Approx(1.0 / (i + 1)).epsilon(1e-6));
  }
  CHECK(read_back["scalars"]["eval/accuracy"][2][1].get<double>() == doctest::Approx(0.8).epsilon(1e-6));
  CHECK(read_back["texts"]["phase"][0][1] == "train");
  CHECK(Values::parse(read_back["texts"]["config"][0][1].get<std::string>()) == Values{{"lr", 0.1}});
}

TEST_CASE("progress bar: tqdm's line, drawn only where asked or on a terminal, one line per close") {
  using Clock = accel::tracking::ProgressBar::Clock;
  std::ostringstream out;
  accel::tracking::ProgressBar bar(100, {.description = "train", .force = true, .min_interval = std::chrono::milliseconds(0)},
                                   &out);
  CHECK(bar.enabled());
  bar.update(42, 0.12345);
  const std::string drawn = out.str();
  CHECK(drawn.starts_with("\rtrain  42%|"));
  CHECK(drawn.find("| 42/100 [") != std::string::npos);
  CHECK(drawn.find("it/s, loss=0.1235]") != std::string::npos);
  // 42% of 20 cells: 8 full blocks and 3 eighths (U+258D), then spaces to the width.
  CHECK(drawn.find("\u2588\u2588\u2588\u2588\u2588\u2588\u2588\u2588\u258D" + std::string(11, ' ') + "|") != std::string::npos);
  // Rate and ETA: 42 steps in 10 s -> 4.20 it/s, 58 left -> 14 s.
  CHECK(bar.line(Clock::now() + std::chrono::seconds(10)).find("[00:10<00:14, 4.20 it/s") != std::string::npos);
  bar.close();
  CHECK(out.str().ends_with("]\n"));
  bar.close();
  CHECK(out.str().ends_with("]\n"));

  CHECK(accel::tracking::format_duration(3725) == "1:02:05");
  CHECK(accel::tracking::format_duration(-1) == "?");

  std::ostringstream quiet;  // not a terminal, not forced: nothing, as tqdm with disable=None
  {
    accel::tracking::ProgressBar off(10, {}, &quiet);
    CHECK_FALSE(off.enabled());
    off.update(10);
  }
  CHECK(quiet.str().empty());
  std::ostringstream disabled;
  {
    accel::tracking::ProgressBar off(10, {.force = true, .disable = true}, &disabled);
    off.update(10);
  }
  CHECK(disabled.str().empty());

  std::ostringstream throttled;  // within the interval only the first and the last update draw
  {
    accel::tracking::ProgressBar slow(5, {.force = true, .min_interval = std::chrono::hours(1)}, &throttled);
    for (int i = 0; i < 5; ++i) slow.update();
  }
  const std::string t = throttled.str();
  CHECK(std::count(t.begin(), t.end(), '\r') == 3);  // step 1, step 5, and the close
  CHECK(t.find(" 5/5 [") != std::string::npos);
  CHECK(t.find(" 2/5 [") == std::string::npos);
}
