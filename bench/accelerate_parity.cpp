// accel's half of the side-by-side with the Python Accelerate
// (bench/accelerate_side_by_side.sh runs both halves and compares them).
//
// Reads the initial weights and the data that bench/accelerate_parity.py
// wrote (raw little-endian files described by <dir>/meta.json), trains the
// same MLP with the same loop as the Python side's Accelerator, writes the
// final parameters to <dir>/<out>/param_<i>.f32, and prints
//   RESULT side=accel global_samples_per_s=X steps=N
//
//   accel launch --num_processes 2 build/bench/accelerate_parity --dir D [flags]
//
// Flags: --strategy ddp|zero3|single   --precision fp32|bf16   --device cpu|cuda
//        --optimizer sgd|adam  --accumulation K  --clip MAX_NORM (0: none)
//        --epochs E  --out NAME (default final_accel)

#include <ATen/ops/from_blob.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <accel/accel.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

namespace fs = std::filesystem;

struct Flags {
  fs::path dir;
  std::string strategy = "ddp", precision = "fp32", device = "cpu", optimizer = "sgd", out = "final_accel";
  int accumulation = 1;
  double clip = 0;
  std::int64_t epochs = 1;
};

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i], value = argv[i + 1];
    if (name == "--dir") f.dir = value;
    else if (name == "--strategy") f.strategy = value;
    else if (name == "--precision") f.precision = value;
    else if (name == "--device") f.device = value;
    else if (name == "--optimizer") f.optimizer = value;
    else if (name == "--out") f.out = value;
    else if (name == "--accumulation") f.accumulation = std::stoi(value);
    else if (name == "--clip") f.clip = std::stod(value);
    else if (name == "--epochs") f.epochs = std::stoll(value);
    else throw std::invalid_argument("accelerate_parity: unknown flag " + name);
  }
  if (f.dir.empty()) throw std::invalid_argument("accelerate_parity: --dir is required");
  return f;
}

// A raw little-endian file of `shape` elements of `dtype`, as numpy's tofile writes it.
at::Tensor read_raw(const fs::path& file, const std::vector<std::int64_t>& shape, at::ScalarType dtype) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("accelerate_parity: cannot read " + file.string());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto tensor = at::from_blob(bytes.data(), shape, at::TensorOptions().dtype(dtype)).clone();
  if (static_cast<std::size_t>(tensor.nbytes()) != bytes.size())
    throw std::runtime_error("accelerate_parity: " + file.string() + " does not hold the shape meta.json gives");
  return tensor;
}

void write_raw(const fs::path& file, const at::Tensor& tensor) {
  auto host = tensor.detach().to(at::kCPU, at::kFloat).contiguous();
  std::ofstream out(file, std::ios::binary);
  out.write(static_cast<const char*>(host.data_ptr()), static_cast<std::streamsize>(host.nbytes()));
}

template <class Strategy, class Precision, class Device>
int train(const Flags& flags) {
  std::ifstream meta_file(flags.dir / "meta.json");
  const auto meta = nlohmann::json::parse(meta_file);
  const auto widths = meta.at("widths").get<std::vector<std::int64_t>>();
  const std::int64_t batch_size = meta.at("batch_size");

  accel::Trainer<Strategy, Precision, Device> trainer{
      Strategy{}, accel::TrainerOptions{.gradient_accumulation_steps = flags.accumulation}};
  bench::MLP model(widths);
  {  // the initial weights the Python side wrote, in parameters() order
    c10::NoGradGuard no_grad;
    auto params = model->parameters();
    const auto shapes = meta.at("param_shapes").get<std::vector<std::vector<std::int64_t>>>();
    for (std::size_t i = 0; i < params.size(); ++i)
      params[i].copy_(read_raw(flags.dir / ("init_" + std::to_string(i) + ".f32"), shapes.at(i), at::kFloat));
  }
  const double lr = meta.at("lr");
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (flags.optimizer == "adam") optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(lr));
  else optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(lr));
  trainer.prepare(model, *optimizer);

  const std::int64_t samples = meta.at("samples");
  auto x = read_raw(flags.dir / "data_x.f32", {samples, widths.front()}, at::kFloat);
  auto y = read_raw(flags.dir / "data_y.i64", {samples}, at::kLong);
  auto loader = trainer.prepare(accel::data::TensorDataset(x, y), {.batch_size = batch_size});

  std::int64_t steps = 0, timed_samples = 0;
  std::chrono::steady_clock::time_point start;
  for (std::int64_t epoch = 0; epoch < flags.epochs; ++epoch) {
    loader.set_epoch(epoch);
    for (auto batch : loader) {
      if (steps == 2) {  // the first steps warm up allocators and connections
        trainer.wait_for_everyone();
        start = std::chrono::steady_clock::now();
      }
      {
        [[maybe_unused]] auto micro = trainer.accumulate();
        at::Tensor loss;
        {
          [[maybe_unused]] auto scope = trainer.autocast();
          loss = torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
        }
        trainer.backward(loss);
        if (flags.clip > 0 && trainer.sync_gradients()) trainer.clip_grad_norm(flags.clip);
        trainer.optimizer_step();
        trainer.zero_grad();
      }
      if (steps >= 2) timed_samples += batch.data.size(0) * trainer.num_processes();
      ++steps;
    }
  }
  trainer.wait_for_everyone();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  trainer.unwrap_model();  // under ZeRO-3 the whole parameters again, on every rank
  auto params = model->parameters();
  if (trainer.is_main_process()) {
    fs::create_directories(flags.dir / flags.out);
    for (std::size_t i = 0; i < params.size(); ++i)
      write_raw(flags.dir / flags.out / ("param_" + std::to_string(i) + ".f32"), params[i]);
    std::printf("RESULT side=accel global_samples_per_s=%.1f steps=%lld\n", timed_samples / seconds,
                static_cast<long long>(steps));
  }
  return EXIT_SUCCESS;
}

template <class Strategy>
int with_precision_and_device(const Flags& flags) {
  if (flags.device == "cuda") {
    if (flags.precision == "bf16") return train<Strategy, accel::BF16, accel::CUDA>(flags);
    return train<Strategy, accel::FP32, accel::CUDA>(flags);
  }
  if (flags.precision == "bf16") return train<Strategy, accel::BF16, accel::CPU>(flags);
  return train<Strategy, accel::FP32, accel::CPU>(flags);
}

}  // namespace

int main(int argc, char** argv) {
  bench::one_thread();
  const Flags flags = parse(argc, argv);
  if (flags.strategy == "zero3") return with_precision_and_device<accel::ZeRO<3>>(flags);
  if (flags.strategy == "single") return with_precision_and_device<accel::SingleProcess>(flags);
  return with_precision_and_device<accel::DDP>(flags);
}
