// accel-merge-weights: what `accel merge-weights` (and `accel export` where
// it is not a copy) runs. It links LibTorch, which the `accel` command line
// does not: it joins a checkpoint's model shards, or converts its model file,
// offline, without starting a job (NOTE [Sharded checkpoints]).
//   accel-merge-weights <checkpoint dir> <out dir> [--model N] [--unsafe_serialization]

#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "accel/checkpoint/sharded.hpp"

int main(int argc, char** argv) {
  std::vector<std::string> positional;
  int model = 0;
  bool safe = true;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs("usage: accel merge-weights <checkpoint dir> <out dir> [--model N] [--unsafe_serialization]\n\n"
                 "Writes the checkpoint's full model (model N, default 0) as <out dir>/model.safetensors, as\n"
                 "Accelerate's merge-weights does: a sharded checkpoint (SHARDED_STATE_DICT) has its shards\n"
                 "joined offline, a whole one is copied (or converted, if an older accel wrote it as model_N.pt).\n"
                 "--unsafe_serialization: one LibTorch file <out> instead, loadable with torch::load into the\n"
                 "unsharded model.\n",
                 stdout);
      return 0;
    }
    if (arg == "--unsafe_serialization") {
      safe = false;
    } else if (arg == "--model" && i + 1 < argc) {
      try {
        model = std::stoi(argv[++i]);
      } catch (const std::exception&) {
        std::fprintf(stderr, "accel merge-weights: --model wants a number, not '%s'\n", argv[i]);
        return 2;
      }
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2) {
    std::fputs("accel merge-weights: expected <checkpoint dir> <out dir> (usage: accel merge-weights --help)\n", stderr);
    return 2;
  }
  try {
    accel::checkpoint::consolidate_model(positional[0], positional[1], model, safe);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  const std::filesystem::path out = positional[1];
  std::printf("accel merge-weights: wrote %s\n", (safe ? out / "model.safetensors" : out).c_str());
  return 0;
}
