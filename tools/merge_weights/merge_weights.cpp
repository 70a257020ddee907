// accel-merge-weights: what `accel merge-weights` (and `accel export` of a
// sharded checkpoint) runs. It links LibTorch, which the `accel` command line
// does not: it joins a checkpoint's model shards into one LibTorch file,
// offline, without starting a job (NOTE [Sharded checkpoints]).
//   accel-merge-weights <checkpoint dir> <model.pt> [--model N]

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "accel/checkpoint/sharded.hpp"

int main(int argc, char** argv) {
  std::vector<std::string> positional;
  int model = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs("usage: accel merge-weights <checkpoint dir> <model.pt> [--model N]\n\n"
                 "Writes the checkpoint's full model (model N, default 0) to one LibTorch file, loadable with\n"
                 "torch::load into the unsharded model: a sharded checkpoint (SHARDED_STATE_DICT) has its\n"
                 "shards joined offline, a whole one is copied.\n",
                 stdout);
      return 0;
    }
    if (arg == "--model" && i + 1 < argc) {
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
    std::fputs("accel merge-weights: expected <checkpoint dir> <model.pt> (usage: accel merge-weights --help)\n", stderr);
    return 2;
  }
  try {
    accel::checkpoint::consolidate_model(positional[0], positional[1], model);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::printf("accel merge-weights: wrote %s\n", positional[1].c_str());
  return 0;
}
