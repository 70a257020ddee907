// Tutorial: an image classifier (a small CNN) trained from PNG files on
// disk, as Accelerate's cv_example trains a ResNet on the Oxford pets. The
// images are drawn here once (circles, squares, triangles and crosses of
// random size, place and colour on a noisy background), written as PNG files
// in the usual one-folder-per-class layout, and then read back and decoded
// like any image set a user has: point --data at your own folders of PNG or
// JPEG files (root/train/<class>/*.png, root/test/<class>/*.png) and nothing
// else changes.
//
//   ./build/tools/accel launch --num_processes 2 ./build/examples/vision --strategy ddp
//   ./build/tools/accel launch --num_processes 2 --mixed_precision bf16 ./build/examples/vision --strategy zero2
//
// The precision is the launcher's (--mixed_precision, or a config file's
// mixed_precision): the program reads ACCELERATE_MIXED_PRECISION and picks
// its Trainer's Precision type from it, as an Accelerate script leaves the
// precision to `accelerate launch`. Flags: --strategy single|ddp|zero1|zero2|zero3,
// --epochs, --batch_size (per process), --data DIR, --project_dir DIR
// (trackers and checkpoints; a rerun resumes from the newest checkpoint),
// --log_with jsonl|csv|tensorboard|all, --min_accuracy A (exit 1 below it).
// Tensor and pipeline parallelism need a model built for them (see gpt.cpp).
//
// Built compiled once (NOTE [Compiled once]), as mlp.cpp: accel's headers
// then only declare nlohmann::json, and this program, which builds JSON
// values for init_trackers and log, includes <nlohmann/json.hpp> itself.

#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/stack.h>
#include <stb_image.h>
#include <stb_image_write.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/adam.h>

#include <accel/accel.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "flags.hpp"

namespace fs = std::filesystem;

namespace {

const std::vector<std::string> shapes = {"circle", "square", "triangle", "cross"};
constexpr int side = 32;

// 1. The images: one PNG per sample, drawn once by the main process.
void draw_shape(std::vector<unsigned char>& rgb, int shape, std::mt19937& rng) {
  // A bright shape on a dark, noisy background: learnable in a few epochs by a small CNN.
  std::uniform_int_distribution<int> bright(128, 255), dark(0, 90), size(7, 12), noise(-15, 15);
  const int r = size(rng);
  std::uniform_int_distribution<int> centre(r + 1, side - r - 2);
  const int cx = centre(rng), cy = centre(rng);
  const int colour[3] = {bright(rng), bright(rng), bright(rng)};
  const int background = dark(rng);
  for (int y = 0; y < side; ++y)
    for (int x = 0; x < side; ++x) {
      const int dx = x - cx, dy = y - cy;
      bool inside = false;
      if (shape == 0) inside = dx * dx + dy * dy <= r * r;
      if (shape == 1) inside = std::abs(dx) <= r * 3 / 4 && std::abs(dy) <= r * 3 / 4;
      if (shape == 2) inside = dy >= -r && dy <= r && std::abs(dx) * 2 <= (dy + r);
      if (shape == 3) inside = (std::abs(dx) <= r / 4 && std::abs(dy) <= r) || (std::abs(dy) <= r / 4 && std::abs(dx) <= r);
      for (int c = 0; c < 3; ++c)
        rgb[(y * side + x) * 3 + c] =
            static_cast<unsigned char>(std::clamp((inside ? colour[c] : background) + noise(rng), 0, 255));
    }
}

void write_image_set(const fs::path& root, int train_per_class, int test_per_class) {
  std::mt19937 rng(7);
  std::vector<unsigned char> rgb(side * side * 3);
  for (const auto& [split, count] : {std::pair{"train", train_per_class}, std::pair{"test", test_per_class}})
    for (std::size_t shape = 0; shape < shapes.size(); ++shape) {
      const fs::path folder = root / split / shapes[shape];
      fs::create_directories(folder);
      for (int i = 0; i < count; ++i) {
        draw_shape(rgb, static_cast<int>(shape), rng);
        const auto file = (folder / (std::to_string(i) + ".png")).string();
        if (!stbi_write_png(file.c_str(), side, side, 3, rgb.data(), side * 3))
          throw std::runtime_error("vision: cannot write " + file);
      }
    }
}

// 2. The dataset: files listed once, decoded (stb_image: PNG, JPEG, BMP, ...)
//    when the loader asks for them. It meets accel's batched_dataset concept.
class ImageFolder {
 public:
  explicit ImageFolder(const fs::path& root) {
    for (std::size_t label = 0; label < shapes.size(); ++label) {
      std::vector<fs::path> files;
      for (const auto& entry : fs::directory_iterator(root / shapes[label])) files.push_back(entry.path());
      std::sort(files.begin(), files.end());  // the same order on every rank
      for (auto& file : files) samples_.emplace_back(std::move(file), static_cast<std::int64_t>(label));
    }
    if (samples_.empty()) throw std::runtime_error("vision: no images under " + root.string());
  }
  std::int64_t size() const { return static_cast<std::int64_t>(samples_.size()); }
  accel::data::Batch get(const at::Tensor& indices) const {
    if (indices.numel() == 0)  // a short rank's last batch with even_batches off
      return {at::empty({0, 3, side, side}), at::empty({0}, at::TensorOptions().dtype(at::kLong))};
    std::vector<at::Tensor> images;
    std::vector<std::int64_t> labels;
    const auto* index = indices.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < indices.numel(); ++i) {
      const auto& [file, label] = samples_[static_cast<std::size_t>(index[i])];
      int width = 0, height = 0, channels = 0;
      unsigned char* pixels = stbi_load(file.c_str(), &width, &height, &channels, 3);
      if (pixels == nullptr || width != side || height != side)
        throw std::runtime_error("vision: cannot read a " + std::to_string(side) + "x" + std::to_string(side) +
                                 " image from " + file.string());
      // (H, W, 3) bytes -> (3, H, W) floats in [-1, 1]
      images.push_back(at::from_blob(pixels, {side, side, 3}, at::kByte).permute({2, 0, 1}).to(at::kFloat).div(127.5).sub(1));
      stbi_image_free(pixels);
      labels.push_back(label);
    }
    return {at::stack(images), at::tensor(labels, at::TensorOptions().dtype(at::kLong))};
  }

 private:
  std::vector<std::pair<fs::path, std::int64_t>> samples_;
};

// 3. The model: a plain LibTorch CNN.
torch::nn::Sequential make_cnn() {
  using namespace torch::nn;
  return Sequential(Conv2d(Conv2dOptions(3, 16, 3).padding(1)), ReLU(), MaxPool2d(2),
                    Conv2d(Conv2dOptions(16, 32, 3).padding(1)), ReLU(), MaxPool2d(2), Flatten(),
                    Linear(32 * 8 * 8, 64), ReLU(), Linear(64, static_cast<std::int64_t>(shapes.size())));
}

struct Settings {
  int epochs = 3;
  std::int64_t batch_size = 16;
  fs::path data, project_dir;
  std::string log_with;
  double min_accuracy = 0;
};

// 4. The loop: the same for every strategy and precision.
template <class Strategy, class Precision>
int train(Strategy strategy, const Settings& s) {
  std::vector<std::string> log_with{s.log_with};
  accel::Trainer<Strategy, Precision> trainer(strategy, Precision{}, accel::CPU{},
                                              {.project_dir = s.project_dir, .log_with = log_with});
  {  // the main process draws the images once; the others wait for it, then read them
    auto first = trainer.main_process_first();
    if (!fs::exists(s.data / "test")) write_image_set(s.data, 400, 50);
  }
  trainer.set_seed(0);
  auto model = make_cnn();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(2e-3));
  trainer.prepare(model, optimizer);
  auto train_loader = trainer.prepare(ImageFolder(s.data / "train"), {.batch_size = s.batch_size, .shuffle = true});
  auto test_loader = trainer.prepare(ImageFolder(s.data / "test"), {.batch_size = s.batch_size});
  if (auto resumed = trainer.load_latest_state()) trainer.print("resumed from", resumed->string());
  trainer.init_trackers("vision", {{"batch_size", s.batch_size}, {"processes", trainer.num_processes()},
                                   {"precision", Precision::name}, {"lr", 2e-3}});

  double accuracy = 0;
  for (int epoch = static_cast<int>(train_loader.epoch()); epoch < s.epochs; ++epoch) {
    train_loader.set_epoch(epoch);
    auto bar = trainer.progress_bar(train_loader.size(), {.description = "epoch " + std::to_string(epoch)});
    for (auto batch : train_loader) {
      auto loss = trainer.step([&] { return torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target); });
      trainer.log({{"train_loss", loss.template item<double>()}});
      bar.update(1, loss.template item<double>());
    }
    bar.close();
    // Accuracy over the test images, every image counted once on any number of ranks.
    std::int64_t correct = 0, seen = 0;
    for (auto batch : test_loader) {
      at::Tensor predicted;
      {
        [[maybe_unused]] auto scope = trainer.autocast();
        predicted = model->forward(batch.data).argmax(1);
      }
      const auto right = trainer.gather_for_metrics(predicted.eq(batch.target));
      correct += right.sum().template item<std::int64_t>();
      seen += right.size(0);
    }
    accuracy = static_cast<double>(correct) / static_cast<double>(seen);
    trainer.log({{"epoch", epoch}, {"accuracy", accuracy}});
    trainer.print("epoch", epoch, "accuracy", accuracy, "on", seen, "test images");
    trainer.save_state();  // project_dir/checkpoints/checkpoint_<n>: a rerun resumes here
  }
  trainer.end_training();
  if (accuracy < s.min_accuracy) {
    trainer.print("accuracy", accuracy, "is below --min_accuracy", s.min_accuracy);
    return 1;
  }
  return 0;
}

template <class Precision>
int with_strategy(const std::string& name, const Settings& s) {
  if (name == "single") return train<accel::SingleProcess, Precision>({}, s);
  if (name == "ddp") return train<accel::DDP, Precision>({}, s);
  if (name == "zero1") return train<accel::ZeRO<1>, Precision>({}, s);
  if (name == "zero2") return train<accel::ZeRO<2>, Precision>({}, s);
  if (name == "zero3") return train<accel::ZeRO<3>, Precision>({}, s);
  std::fprintf(stderr, "vision: --strategy is single, ddp, zero1, zero2 or zero3\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using example::flag;
  Settings s;
  s.epochs = std::stoi(flag(argc, argv, "epochs", "5"));
  s.batch_size = std::stoll(flag(argc, argv, "batch_size", "16"));
  s.data = flag(argc, argv, "data", "data/shapes");
  s.project_dir = flag(argc, argv, "project_dir", "runs/vision");
  s.log_with = flag(argc, argv, "log_with", "jsonl");
  s.min_accuracy = std::stod(flag(argc, argv, "min_accuracy", "0"));
  const std::string strategy = flag(argc, argv, "strategy", "ddp");
  const std::string precision =
      accel::comm::process_environment(accel::launch::variables::mixed_precision).value_or("no");
  if (precision == "no") return with_strategy<accel::FP32>(strategy, s);
  if (precision == "bf16") return with_strategy<accel::BF16>(strategy, s);
  std::fprintf(stderr, "vision: mixed_precision %s: this example runs no or bf16 (fp16 needs a GPU)\n",
               precision.c_str());
  return 2;
}
