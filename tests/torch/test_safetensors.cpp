// safetensors in and out (NOTE [safetensors]): files read back exactly, a
// model saved as Hugging Face lays it out and loaded by name, the Trainer's
// save_model writing from what each rank holds, and the files Python's
// safetensors writes and reads.
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <accel/deferred_init/meta.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <typeinfo>

#include "../../examples/gpt_model.hpp"
#include "doctest_torch.hpp"

using namespace accel::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

at::Tensor cross_entropy(const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); }

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// One tensor of every dtype safetensors and LibTorch share, plus a scalar, an
// empty tensor and a transposed (non-contiguous) one.
std::vector<std::pair<std::string, at::Tensor>> every_dtype() {
  at::manual_seed(3);
  const auto range = at::arange(-6, 6);
  return {{"f64", at::randn({2, 3}, at::kDouble)},
          {"f32", at::randn({4})},
          {"f16", at::randn({3, 2}).to(at::kHalf)},
          {"bf16", at::randn({5}).to(at::kBFloat16)},
          {"i64", range * 1'000'000'000'000},
          {"i32", range.to(at::kInt) * 100'000},
          {"i16", range.to(at::kShort) * 1000},
          {"i8", range.to(at::kChar)},
          {"u8", (range + 200).to(at::kByte)},
          {"bool", range.gt(0)},
          {"scalar", at::scalar_tensor(2.5, at::kDouble)},
          {"empty", at::randn({0, 7})},
          {"transposed", at::randn({3, 4}).t()}};
}

torch::nn::Sequential net_with_buffers(std::uint64_t seed) {
  at::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::Tanh(),
                            torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  // Moved buffers, so a load that skipped them would show.
  net->eval();
  for (auto& b : net->named_buffers()) b.value().add_(seed % 2 ? 3 : 5);
  return net;
}

// Whether two modules' parameters and buffers are bitwise equal.
bool same_state(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  auto ba = a.named_buffers(), bb = b.named_buffers();
  if (pa.size() != pb.size() || ba.size() != bb.size()) return false;
  for (const auto& item : pa)
    if (!item.value().equal(pb[item.key()])) return false;
  for (const auto& item : ba)
    if (!item.value().equal(bb[item.key()])) return false;
  return true;
}

std::vector<std::string> file_names(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& item : fs::directory_iterator(dir)) out.push_back(item.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Trains `net` two steps on the global batch under `settings` on this rank,
// then writes it with trainer.save_model to `dir`, cut into files of at most
// `max` bytes; the whole model, gathered afterwards, goes to `reference`
// through the one-process writer.
template <class Settings>
void train_and_save(Settings settings, int rank, int world, const fs::path& dir, const fs::path& reference,
                    std::uint64_t max) {
  accel::Trainer<Settings> trainer(settings);
  auto net = tiny_mlp(0, 8, 24, 4, 3);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  trainer.prepare(net, opt);
  const std::int64_t per_rank = 12 / world;
  for (int step = 0; step < 2; ++step) {
    auto batch = global_batch(step, 12);
    trainer.step([&] {
      return loss_of(net, batch.x.narrow(0, rank * per_rank, per_rank), batch.y.narrow(0, rank * per_rank, per_rank));
    });
  }
  trainer.save_model(net, dir, {.max_shard_size = max});
  trainer.unwrap_model();
  if (trainer.is_main_process()) accel::save_model(*net, reference, {.max_shard_size = max});
}

// Under `settings`, a fresh model (another seed, or built on meta) prepared
// and loaded from `dir` with trainer.load_safetensors; gathered, it must be
// bitwise the model in `reference`.
template <class Settings>
void load_and_compare(Settings settings, const fs::path& dir, const fs::path& reference, bool on_meta) {
  accel::Trainer<Settings> trainer(settings);
  auto build = [] { return tiny_mlp(9, 8, 24, 4, 3); };
  auto net = on_meta ? accel::device::build_on_meta(build) : build();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  trainer.prepare(net, opt);
  const auto report = trainer.load_safetensors(net, dir);
  require(report.loaded == 8 && report.missing.empty() && report.unexpected.empty(), "every tensor loaded");
  trainer.unwrap_model();
  auto expected = tiny_mlp(1, 8, 24, 4, 3);
  accel::load_safetensors(*expected, reference);
  require(max_param_diff(*net, *expected) == 0.0, "loaded bitwise");
}

}  // namespace

TEST_SUITE("safetensors") {
  TEST_CASE("save_file and load_file: every dtype back bitwise, shapes and metadata kept; the mapped tensors are "
            "private copies") {
    const auto dir = fresh_dir("dtypes");
    RemoveOnExit cleanup{dir};
    fs::create_directories(dir);
    const auto path = dir / "all.safetensors";
    const auto tensors = every_dtype();
    accel::safetensors::save_file(path, tensors, {{"origin", "accel test"}});
    const accel::safetensors::File file(path);
    CHECK(file.header().metadata.at("origin") == "accel test");
    CHECK(file.header().data_start % 8 == 0);
    auto loaded = accel::safetensors::load_file(path);
    REQUIRE(loaded.size() == tensors.size());
    for (const auto& [name, t] : tensors) {
      CAPTURE(name);
      REQUIRE(loaded.count(name));
      CHECK(loaded[name].dtype() == t.dtype());
      CHECK(loaded[name].sizes() == t.sizes());
      CHECK(loaded[name].equal(t));
    }
    loaded["f32"].fill_(7);  // changes the mapping's private pages, not the file
    CHECK(accel::safetensors::load_file(path)["f32"].equal(tensors[1].second));
    CHECK_THROWS_WITH_AS(accel::safetensors::save_file(dir / "c.safetensors", {{"c", at::randn({2}, at::kComplexFloat)}}),
                         doctest::Contains("safetensors cannot hold tensor \"c\" of type ComplexFloat"),
                         accel::safetensors::FormatError);
  }

  TEST_CASE("save_model cuts a model into files with an index as transformers does; load_safetensors loads it back "
            "by name; a later save removes the files it does not replace") {
    const auto dir = fresh_dir("model");
    RemoveOnExit cleanup{dir};
    auto net = net_with_buffers(1);
    // Parameters in bytes: 512, 64 | 64, 64 (BatchNorm) | 1024 | 64, 256, 16; then the buffers.
    accel::save_model(*net, dir, {.max_shard_size = 700});
    const auto names = file_names(dir);
    // Files of at most 700 bytes of tensors: [0.*, 1.weight] [1.bias] [3.weight] [3.bias, 5.*, the buffers].
    REQUIRE(names.size() == 5);
    CHECK(names.back() == "model.safetensors.index.json");
    CHECK(names.front() == "model-00001-of-00004.safetensors");
    const auto index = nlohmann::json::parse(bytes_of(dir / "model.safetensors.index.json"));
    std::uint64_t total = 0;
    for (const auto& item : net->named_parameters()) total += item.value().numel() * 4;
    for (const auto& item : net->named_buffers()) total += item.value().numel() * item.value().element_size();
    CHECK(index["metadata"]["total_size"].get<std::uint64_t>() == total);
    CHECK(index["weight_map"]["1.weight"] == "model-00001-of-00004.safetensors");
    CHECK(index["weight_map"]["3.weight"] == "model-00003-of-00004.safetensors");
    CHECK(index["weight_map"]["1.num_batches_tracked"] == "model-00004-of-00004.safetensors");
    CHECK(index["weight_map"].size() == net->named_parameters().size() + net->named_buffers().size());
    auto other = net_with_buffers(2);
    REQUIRE_FALSE(same_state(*net, *other));
    const auto report = accel::load_safetensors(*other, dir);
    CHECK(report.loaded == index["weight_map"].size());
    CHECK(same_state(*net, *other));
    CHECK(other->named_buffers()["1.num_batches_tracked"].dtype() == at::kLong);

    accel::save_model(*net, dir);  // one file now: the index and the shards go
    CHECK(file_names(dir) == std::vector<std::string>{"model.safetensors"});
    auto third = net_with_buffers(4);
    accel::load_safetensors(*third, dir / "model.safetensors");
    CHECK(same_state(*net, *third));
  }

  TEST_CASE("load_safetensors: missing and unexpected names listed (strict) or returned; name_map renames and skips; "
            "a wrong shape or a damaged file is refused, naming it") {
    const auto dir = fresh_dir("strict");
    RemoveOnExit cleanup{dir};
    auto net = net_with_buffers(1);
    accel::save_model(*net, dir);
    auto smaller = tiny_mlp(5, 8, 16, 4, 2);  // "0.*", "2.*", "4.*": no BatchNorm at 1
    auto before = tiny_mlp(5, 8, 16, 4, 2);
    CHECK_THROWS_WITH_AS(accel::load_safetensors(*smaller, dir),
                         doctest::Contains("loaded nothing: missing 2.bias, 2.weight, 4.bias, 4.weight; unexpected"),
                         accel::safetensors::FormatError);
    CHECK(same_state(*smaller, *before));  // strict: nothing changed
    // The file's "3.*" and "5.*" are the small model's "2.*" and "4.*"; the rest skipped.
    auto map = [](const std::string& name) -> std::string {
      if (name.rfind("0.", 0) == 0) return name;
      if (name.rfind("3.", 0) == 0) return "2." + name.substr(2);
      if (name.rfind("5.", 0) == 0) return "4." + name.substr(2);
      return "";
    };
    const auto mapped = accel::load_safetensors(*smaller, dir, {.name_map = map});
    CHECK(mapped.loaded == 6);
    CHECK(smaller->named_parameters()["4.weight"].equal(net->named_parameters()["5.weight"]));
    const auto loose = accel::load_safetensors(*before, dir, {.strict = false});
    CHECK(loose.missing == std::vector<std::string>{"2.bias", "2.weight", "4.bias", "4.weight"});
    CHECK(loose.unexpected.size() == 4 + 5);  // 1.* (2 parameters, 3 buffers), 3.*, 5.*
    CHECK(before->named_parameters()["0.weight"].equal(net->named_parameters()["0.weight"]));

    auto on_meta = accel::device::build_on_meta([] { return net_with_buffers(1); });
    CHECK_THROWS_WITH_AS(accel::load_safetensors(*on_meta, dir),
                         doctest::Contains("is on the meta device (build_on_meta): prepare the model under ZeRO<3>"),
                         std::invalid_argument);
    auto wider = tiny_mlp(5, 8, 16, 4, 2);
    auto last_onto_middle = [](const std::string& n) { return n == "5.weight" ? std::string("2.weight") : std::string(); };
    CHECK_THROWS_WITH_AS(accel::load_safetensors(*wider, dir, {.strict = false, .name_map = last_onto_middle}),
                         doctest::Contains("\"2.weight\" has shape [16, 16] in the module and [4, 16] in"),
                         accel::safetensors::FormatError);

    const auto file = dir / "model.safetensors";
    fs::resize_file(file, fs::file_size(file) - 4);
    CHECK_THROWS_WITH_AS(accel::load_safetensors(*wider, dir, {.strict = false}),
                         doctest::Contains("run past the data's end"), accel::safetensors::FormatError);
    {
      std::ofstream out(file, std::ios::binary | std::ios::trunc);
      const unsigned char huge[8] = {0, 0, 0, 0, 0, 1, 0, 0};
      out.write(reinterpret_cast<const char*>(huge), 8);
      out << "{}";
    }
    CHECK_THROWS_WITH_AS(accel::load_safetensors(*wider, file), doctest::Contains("its header claims 1099511627776 bytes"),
                         accel::safetensors::FormatError);
    CHECK_THROWS_WITH_AS(accel::load_safetensors(*wider, dir / "nothing"), doctest::Contains("does not exist"),
                         accel::safetensors::FormatError);
  }

  TEST_CASE("trainer.save_model writes the same files under one process and every data-parallel strategy, each "
            "rank writing what it holds") {
    auto check = [](auto settings, int world) {
      using Settings = decltype(settings);
      CAPTURE(typeid(Settings).name());
      CAPTURE(world);
      const auto dir = fresh_dir("strategy"), reference = fresh_dir("reference");
      RemoveOnExit cleanup{dir, reference};
      accel::spawn(world, [&](int rank) { train_and_save(settings, rank, world, dir, reference, 1500); }, bounded(120s));
      const auto names = file_names(dir);
      REQUIRE(names == file_names(reference));
      REQUIRE(names.size() >= 3);  // cut into files: parameters span them, and ZeRO-3's shards span parameters
      for (const auto& name : names) {
        CAPTURE(name);
        CHECK(bytes_of(dir / name) == bytes_of(reference / name));
      }
      // Trained: not the model it started as.
      auto start = tiny_mlp(0, 8, 24, 4, 3), saved = tiny_mlp(9, 8, 24, 4, 3);
      accel::load_safetensors(*saved, dir);
      CHECK(max_param_diff(*saved, *start) > 1e-3);
      // And back in, into what each rank holds.
      accel::spawn(world, [&](int) { load_and_compare(settings, dir, reference, false); }, bounded(120s));
    };
    check(accel::SingleProcess{}, 1);
    each_data_parallel_strategy(check);
    const accel::ZeRO<3> wrapped{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 100};
    check(wrapped, 3);
    check(accel::ZeRO<1>{.cpu_offload = true}, 2);  // the offloaded strategy each_data_parallel_strategy leaves out
    {
      // A model built on meta loads straight into its shards.
      const auto dir = fresh_dir("meta"), reference = fresh_dir("meta_reference");
      RemoveOnExit cleanup{dir, reference};
      accel::spawn(3, [&](int rank) { train_and_save(wrapped, rank, 3, dir, reference, 1500); }, bounded(120s));
      accel::spawn(3, [&](int) { load_and_compare(wrapped, dir, reference, true); }, bounded(120s));
      // A strict load that cannot match throws on every rank, naming what is missing, and changes nothing.
      auto without_last = [](const std::string& name) { return name.rfind("6.", 0) == 0 ? std::string() : name; };
      accel::spawn(
          3,
          [&](int) {
            accel::Trainer<accel::ZeRO<3>> trainer(wrapped);
            auto net = tiny_mlp(9, 8, 24, 4, 3);
            auto before = tiny_mlp(9, 8, 24, 4, 3);
            torch::optim::Adam opt(net->parameters());
            trainer.prepare(net, opt);
            try {
              trainer.load_safetensors(net, dir, {.name_map = without_last});
              require(false, "a load with missing tensors must throw");
            } catch (const accel::checkpoint::CheckpointError& e) {
              require(std::string(e.what()).find("missing 6.bias, 6.weight") != std::string::npos, e.what());
            }
            trainer.unwrap_model();
            require(max_param_diff(*net, *before) == 0.0, "nothing changed");
          },
          bounded(120s));
    }
  }

  TEST_CASE("under a pipeline each stage loads and writes its own layers (ZeRO-3's shards of them too): one "
            "process's file loads and is written back byte for byte, and a trained pipeline saves the model one "
            "process trains on the global batch") {
    const auto dir = fresh_dir("pipeline");
    RemoveOnExit cleanup{dir};
    const int steps = 2;
    const std::int64_t batch = 8;
    accel::save_model(*tiny_mlp(0, 8, 24, 4, 3), dir / "reference", {.max_shard_size = 1500});
    {
      accel::Trainer<> trainer;
      auto net = tiny_mlp(0, 8, 24, 4, 3);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      trainer.prepare(net, opt);
      for (int step = 0; step < steps; ++step) {
        const auto b = global_batch(step, batch);
        trainer.step(b.x, b.y, cross_entropy);
      }
      accel::save_model(*net, dir / "trained_reference");
    }
    auto check = [&](auto settings, int world, const std::string& name) {
      using Settings = decltype(settings);
      CAPTURE(name);
      accel::spawn(
          world,
          [&](int) {
            accel::Trainer<Settings> trainer(settings);
            auto net = tiny_mlp(9, 8, 24, 4, 3);  // other weights: the file's must replace them on every stage
            torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
            trainer.prepare(net, opt);
            const auto report = trainer.load_safetensors(net, dir / "reference");
            require(report.loaded == 8 && report.missing.empty() && report.unexpected.empty(), "every tensor loaded");
            trainer.save_model(net, dir / name / "loaded", {.max_shard_size = 1500});
          },
          bounded(120s));
      const auto names = file_names(dir / name / "loaded");
      REQUIRE(names == file_names(dir / "reference"));
      for (const auto& file : names) {
        CAPTURE(file);
        CHECK(bytes_of(dir / name / "loaded" / file) == bytes_of(dir / "reference" / file));
      }
      accel::spawn(
          world,
          [&](int) {
            accel::Trainer<Settings> trainer(settings);
            auto net = tiny_mlp(0, 8, 24, 4, 3);
            torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
            trainer.prepare(net, opt);
            auto& data = trainer.data_group();
            const std::int64_t per_rank = batch / data.size();
            for (int step = 0; step < steps; ++step) {
              const auto b = global_batch(step, batch);
              trainer.step(b.x.narrow(0, data.rank() * per_rank, per_rank), b.y.narrow(0, data.rank() * per_rank, per_rank),
                           cross_entropy);
            }
            trainer.save_model(net, dir / name / "trained");
          },
          bounded(120s));
      auto saved = tiny_mlp(5, 8, 24, 4, 3), expected = tiny_mlp(5, 8, 24, 4, 3), start = tiny_mlp(0, 8, 24, 4, 3);
      accel::load_safetensors(*saved, dir / name / "trained");
      accel::load_safetensors(*expected, dir / "trained_reference");
      // Every layer moved, so a stage that wrote its untrained copy of another's layers would show.
      for (const auto& item : expected->named_parameters()) {
        CAPTURE(item.key());
        CHECK((item.value() - start->named_parameters()[item.key()]).abs().max().item<double>() > 1e-3);
      }
      const double error = max_param_diff(*saved, *expected);
      MESSAGE(name << ": saved against one process's model, max |difference| " << sci(error));
      CHECK(error < 1e-6);  // measured 1.5e-8 under each (the micro-batches' sums in another order)
    };
    check(accel::Parallel<accel::DDP>{.pipeline = 2, .micro_batches = 2}, 2, "pipeline2");
    check(accel::Parallel<accel::ZeRO<3>>{.pipeline = 2, .micro_batches = 2}, 4, "data2_pipeline2_zero3");
    check(accel::Parallel<accel::ZeRO<1>>{.pipeline = 2,
                                          .micro_batches = 4,
                                          .schedule = accel::PipelineSchedule::interleaved_one_f_one_b,
                                          .virtual_stages = 2},
          2, "pipeline2_interleaved_zero1");
  }

  TEST_CASE("under tensor parallelism each rank loads and writes its slices: the GPT example (vocabulary, fused "
            "QKV with its three blocks, row- and column-parallel layers) on tensor 2 and on data 2 x tensor 2 "
            "under ZeRO-3 loads one process's file, gives its logits, and writes that file back byte for byte") {
    const auto dir = fresh_dir("tensor_parallel");
    RemoveOnExit cleanup{dir};
    const gpt::Config config;
    at::manual_seed(11);
    const at::Tensor tokens = at::randint(0, config.vocab, {2, config.context});
    at::Tensor reference_logits;
    {
      accel::comm::Communicator one_rank;
      at::manual_seed(3);
      auto model = gpt::make_gpt(config, one_rank);
      accel::save_model(*model, dir / "reference", {.max_shard_size = 20'000});
      c10::NoGradGuard no_grad;
      model->eval();
      reference_logits = model->forward(tokens);
    }
    auto check = [&](auto settings, int world, const std::string& name) {
      using Settings = decltype(settings);
      CAPTURE(name);
      const auto out = dir / name;
      const std::string measured = temp_path("tp_logits_" + name);
      accel::spawn(
          world,
          [&](int) {
            accel::Trainer<Settings> trainer(settings);
            at::manual_seed(4);  // other weights: the file's must replace them
            auto model = gpt::make_gpt(config, trainer.tensor_group());
            torch::optim::Adam opt(model->parameters());
            trainer.prepare(model, opt);
            const auto report = trainer.load_safetensors(model, dir / "reference");
            require(report.loaded == 29 && report.missing.empty(), "every weight loaded");
            model->eval();
            c10::NoGradGuard no_grad;
            const at::Tensor logits = model->forward(tokens);  // this tensor rank's vocabulary slice
            const auto& tp = trainer.tensor_group();
            const std::int64_t slice = config.vocab / tp.size();
            const at::Tensor difference = (logits - reference_logits.narrow(-1, tp.rank() * slice, slice)).abs().max();
            const double error = difference.item<double>();
            if (trainer.process_index() == 0) std::ofstream(measured) << sci(error);
            // Measured 6.0e-7 (the tensor ranks sum the row-parallel products in another order).
            require(error < 5e-6, "the logits of one process (max |difference| " + sci(error) + ")");
            trainer.save_model(model, out, {.max_shard_size = 20'000});
          },
          bounded(120s));
      MESSAGE(name << ": logits against one process's, max |difference| " << take_file(measured));
      const auto names = file_names(out);
      REQUIRE(names == file_names(dir / "reference"));
      for (const auto& file : names) {
        CAPTURE(file);
        CHECK(bytes_of(out / file) == bytes_of(dir / "reference" / file));
      }
    };
    check(accel::Parallel<accel::DDP>{.tensor = 2}, 2, "tensor2");
    check(accel::Parallel<accel::ZeRO<3>>{.tensor = 2}, 4, "data2_tensor2_zero3");
  }
}

// Python's safetensors (ACCEL_TEST_PYTHON: the PyPI build's venv) reads what
// accel writes and accel reads what it writes.
TEST_SUITE("safetensors_python") {
  TEST_CASE("Python's safetensors reads accel's files, and accel reads Python's, every dtype bitwise") {
    require_python_module("safetensors.torch");
    const auto dir = fresh_dir("python");
    RemoveOnExit cleanup{dir};
    fs::create_directories(dir);
    accel::safetensors::save_file(dir / "accel.safetensors", every_dtype(), {{"origin", "accel"}});
    // Python checks accel's file against the same values made there, then writes its own.
    const std::string script = R"(
import sys, torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
d = sys.argv[1]
got = load_file(d + "/accel.safetensors")
with safe_open(d + "/accel.safetensors", "pt") as f:
    assert f.metadata()["origin"] == "accel", f.metadata()
for name, t in got.items():
    assert t.is_contiguous(), name
out = {k: v.clone() for k, v in got.items()}
out["python_only"] = torch.arange(10, dtype=torch.int16).reshape(2, 5) * 7
save_file(out, d + "/python.safetensors", metadata={"origin": "python"})
print(" ".join(sorted(f"{k}:{str(v.dtype).split('.')[1]}:{list(v.shape)}" for k, v in got.items())))
)";
    {
      std::ofstream(dir / "check.py") << script;
    }
    const std::string seen = output_of(test_python() + " " + (dir / "check.py").string() + " " + dir.string());
    CHECK(seen.find("bf16:bfloat16:[5]") != std::string::npos);
    CHECK(seen.find("bool:bool:[12]") != std::string::npos);
    CHECK(seen.find("scalar:float64:[]") != std::string::npos);
    CHECK(seen.find("transposed:float32:[4, 3]") != std::string::npos);
    const accel::safetensors::File theirs(dir / "python.safetensors");
    CHECK(theirs.header().metadata.at("origin") == "python");
    auto loaded = accel::safetensors::load_file(dir / "python.safetensors");
    for (const auto& [name, t] : every_dtype()) {
      CAPTURE(name);
      REQUIRE(loaded.count(name));
      CHECK(loaded[name].equal(t));
    }
    CHECK(loaded["python_only"].equal(at::arange(10, at::kShort).reshape({2, 5}) * 7));
  }
}

// transformers' GPT2LMHeadModel (ACCEL_TEST_PYTHON: the PyPI build's venv):
// its weights in the GPT example, and the example's back in it.
TEST_SUITE("transformers") {
  TEST_CASE("a transformers GPT-2 loads into the GPT example (logits within 1e-5), fine-tunes under DDP and ZeRO-3 on "
            "2 ranks, and saves for GPT2LMHeadModel.from_pretrained (logits within 1e-5), in one file and cut into "
            "files") {
    const std::string script = test_python() + " " ACCEL_SOURCE_ROOT "/tests/torch/transformers_gpt2.py";
    require_python_module("transformers");
    const auto dir = fresh_dir("gpt2");
    RemoveOnExit cleanup{dir};
    fs::create_directories(dir);
    REQUIRE(std::system((script + " make " + dir.string()).c_str()) == 0);
    const gpt::Config config;  // vocab 64, context 16, width 32, 4 heads, 2 layers: the script's GPT2Config
    auto reference = accel::safetensors::load_file(dir / "hf_logits.safetensors");
    const at::Tensor tokens = reference.at("tokens"), hf_logits = reference.at("logits");
    {
      accel::comm::Communicator one_rank;
      auto model = gpt::make_gpt(config, one_rank);
      const auto report = accel::load_safetensors(*model, dir / "hf", gpt::from_transformers(config));
      CHECK(report.loaded == 29);
      model->eval();
      c10::NoGradGuard no_grad;
      const double error = (model->forward(tokens) - hf_logits).abs().max().item<double>();
      MESSAGE("accel's logits from transformers' weights: max |difference| " << sci(error));
      CHECK(error < 2e-6);  // measured 8.9e-8 (the issue asks 1e-5)
    }
    auto fine_tune = [&](auto settings, const fs::path& out, std::uint64_t max_shard_size) {
      using Settings = decltype(settings);
      accel::spawn(
          2,
          [&](int rank) {
            accel::Trainer<Settings> trainer(settings);
            auto model = gpt::make_gpt(config, trainer.tensor_group());
            torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
            trainer.prepare(model, opt);
            const auto report = trainer.load_safetensors(model, dir / "hf", gpt::from_transformers(config));
            require(report.loaded == 29, "every weight loaded");
            at::manual_seed(5);
            const at::Tensor data = at::randint(0, config.vocab, {4, config.context + 1});
            const at::Tensor mine = data.narrow(0, rank * 2, 2);
            for (int step = 0; step < 3; ++step)
              trainer.step([&] {
                const at::Tensor logits = model->forward(mine.narrow(1, 0, config.context));
                return torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}),
                                                            mine.narrow(1, 1, config.context).reshape({-1}));
              });
            trainer.save_model(model, out, gpt::to_transformers(config, max_shard_size));
            model->eval();
            c10::NoGradGuard no_grad;
            const at::Tensor logits = model->forward(tokens);
            if (rank == 0) {
              accel::safetensors::save_file(out / "accel_logits.safetensors", {{"logits", logits.contiguous()}});
              fs::copy_file(dir / "hf" / "config.json", out / "config.json");
              require((logits - hf_logits).abs().max().item<double>() > 1e-3, "fine-tuning moved the model");
            }
          },
          bounded(180s));
      const double error = std::stod(output_of(script + " check " + out.string()));
      MESSAGE("GPT2LMHeadModel.from_pretrained(" << out.filename().string() << ") against accel: max |difference| "
                                                 << sci(error));
      CHECK(error < 2e-6);  // measured 1.8e-7 under DDP and ZeRO-3 (the issue asks 1e-5)
    };
    fine_tune(accel::DDP{}, dir / "ddp", 10'000'000'000);
    CHECK(fs::exists(dir / "ddp" / "model.safetensors"));
    fine_tune(accel::ZeRO<3>{.auto_wrap_policy = accel::AutoWrapPolicy::SIZE_BASED_WRAP, .min_num_params = 1000},
              dir / "zero3", 20'000);
    CHECK(fs::exists(dir / "zero3" / "model.safetensors.index.json"));
    CHECK(file_names(dir / "zero3").size() > 4);
  }
}

// A run started in Python Accelerate goes on in C++ (NOTE [Resuming a Python
// Accelerate run]): tests/torch/accelerate_resume.py trains and saves on 2
// processes, then trains on; accel loads its save_state directory and trains
// the same steps.
TEST_SUITE("accelerate_resume") {
  TEST_CASE("load_state resumes a Python Accelerate save_state (DDP, Adam, StepLR, 2 ranks): the C++ run continued "
            "from its directory ends where the Python run did") {
    require_accelerate();
    const auto dir = fresh_dir("accelerate_resume");
    RemoveOnExit cleanup{dir};
    fs::create_directories(dir);
    const auto log = dir / "python.log";
    const std::string command = test_python() + " -m torch.distributed.run --standalone --nproc_per_node 2 " +
                                ACCEL_SOURCE_ROOT "/tests/torch/accelerate_resume.py " + dir.string() + " > " +
                                log.string() + " 2>&1";
    const int status = std::system(command.c_str());
    REQUIRE_MESSAGE(status == 0, "the Python Accelerate run failed:\n" << bytes_of(log));
    for (const char* file : {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_1.pkl"}) {
      CAPTURE(file);
      REQUIRE(fs::exists(dir / "state" / file));
    }
    const auto data = accel::safetensors::load_file(dir / "data.safetensors");
    const at::Tensor x = data.at("x"), y = data.at("y");
    const std::string measured = temp_path("accelerate_resume_error");
    accel::spawn(
        2,
        [&](int rank) {
          accel::Trainer<accel::DDP> trainer;
          auto net = tiny_mlp(9, 8, 16, 4, 2);  // other weights, learning rate and betas: the saved ones replace them
          torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(0.5).betas({0.5, 0.5}));
          torch::optim::StepLR scheduler(opt, 2, 0.5);
          trainer.prepare(net, opt, scheduler);
          trainer.load_state(dir / "state");
          require(trainer.completed_steps() == 3, "the step count is Adam's: " + std::to_string(trainer.completed_steps()));
          for (std::int64_t step = 3; step < x.size(0); ++step)
            trainer.step([&] { return loss_of(net, x[step].narrow(0, rank * 4, 4), y[step].narrow(0, rank * 4, 4)); });
          auto python = tiny_mlp(5, 8, 16, 4, 2), saved = tiny_mlp(5, 8, 16, 4, 2);
          accel::load_safetensors(*python, dir / "python_final.safetensors");
          accel::load_safetensors(*saved, dir / "state" / "model.safetensors");
          require(max_param_diff(*python, *saved) > 1e-3, "the Python run moved after its save: the bound could fail");
          const double error = max_param_diff(*net, *python);
          if (rank == 0) std::ofstream(measured) << sci(error);
          require(error < 1e-6, "the Python run's weights (max |difference| " + sci(error) + ")");
        },
        bounded(120s));
    MESSAGE("continued in C++ against continued in Python, max |difference| " << take_file(measured));
    // ZeRO's optimizer steps flat shards: whole-parameter state is refused on every rank, naming what to do.
    accel::spawn(
        2,
        [&](int) {
          accel::Trainer<accel::ZeRO<1>> trainer;
          auto net = tiny_mlp(9, 8, 16, 4, 2), before = tiny_mlp(9, 8, 16, 4, 2);
          torch::optim::Adam opt(net->parameters());
          trainer.prepare(net, opt);
          try {
            trainer.load_state(dir / "state");
            require(false, "ZeRO-1 must refuse Accelerate's whole-parameter optimizer state");
          } catch (const accel::checkpoint::CheckpointError& e) {
            require(std::string(e.what()).find("optimizer steps ZeRO shards: resume it under DDP") != std::string::npos,
                    e.what());
          }
          trainer.unwrap_model();
          require(max_param_diff(*net, *before) == 0.0, "nothing changed");
        },
        bounded(120s));
  }
}
