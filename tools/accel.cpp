// The `accel` command line: Accelerate's `launch`, `config` and `env` for
// LibTorch programs. Torch-free on purpose: it only starts processes and
// writes files, so it builds in seconds and works where LibTorch is absent.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/args.hpp"
#include "cli/config.hpp"
#include "cli/env_report.hpp"
#include "cli/launch.hpp"
#include "accel/checkpoint/files.hpp"
#include "cli/estimate.hpp"
#include "cli/plan.hpp"
#include "cli/settings.hpp"
#include "cli/wizard.hpp"

namespace {

using namespace accel::cli;

const char* const main_usage =
    "usage: accel <command> [flags]\n"
    "\n"
    "HuggingFace Accelerate's workflow for LibTorch programs.\n"
    "\n"
    "commands:\n"
    "  launch   run a program as this machine's processes of a distributed job\n"
    "  config   write a JSON config file for accel launch (accel config default: defaults only)\n"
    "  env      show accel's version, the machine, the default config and launcher variables\n"
    "  export   a checkpoint's full model as <out dir>/model.safetensors: accel export <checkpoint dir> <out dir>\n"
    "  merge-weights  the same, a sharded model's shards joined offline: accel merge-weights <dir> <out dir>\n"
    "  test     launch the bundled self-test on this set-up (rendezvous, collectives, RNG, data sharding)\n"
    "  estimate-memory  per-rank memory of a model shape under each strategy: accel estimate-memory gpt|mlp\n"
    "\n"
    "Run accel <command> --help for its flags. accel --version prints the version.\n";

std::string launch_usage() {
  return "usage: accel launch [flags] <program> [program args...]\n"
         "\n"
         "Starts num_processes / num_machines copies of <program> on this machine with torchrun's\n"
         "variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
         "MASTER_PORT, OMP_NUM_THREADS) and Accelerate's (ACCELERATE_MIXED_PRECISION, ...).\n"
         "Everything after <program> is passed to it. Each line a rank prints comes out prefixed\n"
         "\"[rank N] \" (N = global rank) on accel's stdout or stderr. Values come from the config\n"
         "file, and flags override it. When a rank fails, the others are terminated (SIGTERM, then\n"
         "SIGKILL after 3 s), as they are on a --timeout or when accel launch gets SIGINT/SIGTERM.\n" +
         flags_help(true) +
         "\n"
         "Exit status:\n"
         "  0      every rank exited with status 0\n"
         "  S      the first rank to fail exited with status S (S > 0)\n"
         "  1      the first rank to fail was killed by a signal, or a rank could not be started\n"
         "  2      bad flags, config file or program\n"
         "  124    --timeout passed; all ranks were killed\n"
         "  128+N  accel launch itself got signal N (SIGINT, SIGTERM, SIGHUP)\n";
}

std::string config_usage() {
  return "usage: accel config [default|update] [flags]\n"
         "\n"
         "Writes a JSON config file with Accelerate's keys for accel launch. On a terminal and\n"
         "without flags, it asks Accelerate's questions (machines, processes, CPU/GPU, FSDP,\n"
         "mixed precision, ...); with flags, it writes the given values and defaults for the rest.\n"
         "It goes to --config_file, else to $HF_HOME/accelerate/default_config.json (else\n"
         "~/.cache/huggingface/accelerate/...). accel config replaces an existing file;\n"
         "accel config default, as in Accelerate, does not; accel config update rewrites an\n"
         "existing file with every key this version writes (and the flags given).\n" +
         flags_help(false);
}

// The config file that applies: the one given, else the default if it exists.
LaunchSettings settings_from_files(const ParsedCommand& parsed, bool quiet) {
  if (parsed.config_file) return load_config_file(*parsed.config_file);
  const auto path = default_config_path();
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec)) return load_config_file(path);
  auto yaml = path;
  yaml.replace_extension(".yaml");
  if (!quiet && std::filesystem::is_regular_file(yaml, ec))
    std::fprintf(stderr,
                 "accel launch: ignoring %s: accel reads JSON config files (%s); write one with accel config\n",
                 yaml.c_str(), path.c_str());
  return {};
}

int launch_command(const std::vector<std::string>& args) {
  ParsedCommand parsed = parse_command_line(args, /*program_follows=*/true);
  if (parsed.help) {
    std::fputs(launch_usage().c_str(), stdout);
    return 0;
  }
  LaunchSettings settings = settings_from_files(parsed, parsed.flags.quiet);
  settings.override_with(parsed.flags);
  JobPlan plan = resolve_plan(settings);  // checks the values before complaining about a missing program
  if (parsed.positional.empty())
    throw UsageError("no program given (usage: accel launch [flags] <program> [program args...])");
  return run_launch(std::move(plan), parsed.positional);
}

int config_command(const std::vector<std::string>& args) {
  ParsedCommand parsed = parse_command_line(args, /*program_follows=*/false);
  if (parsed.help) {
    std::fputs(config_usage().c_str(), stdout);
    return 0;
  }
  std::string mode;  // "", "default" or "update"
  for (const auto& word : parsed.positional) {
    if ((word == "default" || word == "update") && mode.empty()) mode = word;
    else throw UsageError("unexpected argument '" + word + "' (usage: accel config [default|update] [flags])");
  }
  const std::filesystem::path path = parsed.config_file ? std::filesystem::path(*parsed.config_file)
                                                        : default_config_path();
  if (is_yaml_path(path))
    throw UsageError("--config_file " + path.string() + ": accel writes JSON config files; use a .json name");
  std::error_code ec;
  LaunchSettings settings = parsed.flags;
  if (mode == "update") {
    // Accelerate's `config update`: the file read (and checked) as launch reads it, written back with
    // every key the current version writes; flags given change their keys.
    if (!std::filesystem::is_regular_file(path, ec))
      throw UsageError(path.string() + " does not exist: there is no config to update (write one with accel config)");
    settings = load_config_file(path);
    settings.override_with(parsed.flags);
  } else if (mode.empty() && parsed.flags.origin.empty()) {
    if (::isatty(STDIN_FILENO) != 1)
      throw UsageError("no flags given and no terminal to ask on: give the settings as flags (accel config "
                       "--num_processes 2 ...), or write the defaults with accel config default");
    std::printf("accel config: a few questions (Enter takes the default in brackets); the answers go to %s\n",
                path.c_str());
    Questions questions(std::cin, std::cout);
    settings = ask_config(questions, detail::has_nvidia_gpus());
  }
  resolve_plan(settings);  // refuse what accel launch would refuse
  if (mode == "default" && std::filesystem::exists(path, ec)) {
    std::fprintf(stderr,
                 "accel config: %s already exists; not replacing it (run accel config to replace it, or "
                 "pass --config_file to write elsewhere)\n",
                 path.c_str());
    return 1;
  }
  write_config_file(path, config_to_json(settings, default_distributed_type(settings)));
  if (!parsed.flags.quiet) std::printf("accel config: %s %s\n", mode == "update" ? "updated" : "wrote", path.c_str());
  return 0;
}

// A companion program that links LibTorch (accel-selftest, accel-merge-weights):
// $<variable>, else beside this executable (the build folder, or the installed bin/).
std::filesystem::path companion_program(const char* name, const char* variable) {
  if (const char* given = std::getenv(variable); given && *given) return given;
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return (ec ? std::filesystem::path(".") : self.parent_path()) / name;
}
std::filesystem::path selftest_program() { return companion_program("accel-selftest", "ACCEL_SELFTEST"); }

// Runs accel-merge-weights with `args` in place of this process.
[[noreturn]] void run_merge_weights(const std::vector<std::string>& args) {
  const auto program = companion_program("accel-merge-weights", "ACCEL_MERGE_WEIGHTS");
  std::error_code ec;
  if (!std::filesystem::is_regular_file(program, ec))
    throw UsageError("the merge program " + program.string() + " is missing: build it (ninja -C build " +
                     "tools/accel-merge-weights) or point ACCEL_MERGE_WEIGHTS at it");
  std::vector<char*> argv{const_cast<char*>(program.c_str())};
  for (const auto& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::fflush(nullptr);
  ::execv(program.c_str(), argv.data());
  throw std::runtime_error("could not run " + program.string());
}

int test_command(const std::vector<std::string>& args) {
  ParsedCommand parsed = parse_command_line(args, /*program_follows=*/true);  // launch's flags, --timeout too
  if (parsed.help) {
    std::fputs(("usage: accel test [flags]\n"
                "\n"
                "Launches the bundled self-test (accel-selftest) as accel launch would launch a program,\n"
                "with the same config file and flags, as accelerate test does. Every rank checks the\n"
                "rendezvous, each collective on Gloo (and NCCL where every rank has a GPU), RNG agreement\n"
                "after set_seed, data sharding and a DDP step; rank 0 prints PASS or FAIL per check.\n" +
                flags_help(true))
                   .c_str(),
               stdout);
    return 0;
  }
  if (!parsed.positional.empty())
    throw UsageError("unexpected argument '" + parsed.positional.front() + "' (usage: accel test [flags])");
  LaunchSettings settings = settings_from_files(parsed, parsed.flags.quiet);
  settings.override_with(parsed.flags);
  JobPlan plan = resolve_plan(settings);
  const auto program = selftest_program();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(program, ec))
    throw UsageError("the self-test program " + program.string() + " is missing: build it (ninja -C build " +
                     "tools/accel-selftest) or point ACCEL_SELFTEST at it");
  return run_launch(std::move(plan), {program.string()});
}

int estimate_command(const std::vector<std::string>& args) {
  for (const auto& arg : args)
    if (arg == "-h" || arg == "--help") {
      std::fputs(estimate_usage().c_str(), stdout);
      return 0;
    }
  return estimate_memory(parse_estimate(args));
}

int env_command(const std::vector<std::string>& args) {
  for (const auto& arg : args) {
    if (arg == "-h" || arg == "--help") {
      std::fputs("usage: accel env\n\nPrints accel's version, the platform, the CPUs, the default config file\n"
                 "and the launcher-related environment variables set in this shell.\n",
                 stdout);
      return 0;
    }
    throw UsageError("unexpected argument '" + arg + "' (usage: accel env)");
  }
  std::fputs(environment_report().c_str(), stdout);
  return 0;
}

int export_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "-h" || args[0] == "--help")) {
    std::fputs("usage: accel export <checkpoint dir> <out dir> [--model N] [--unsafe_serialization]\n\n"
               "Checks the checkpoint (complete, sizes as its manifest says) and writes its full model (model N,\n"
               "default 0) as <out dir>/model.safetensors, whatever strategy saved it (Accelerate's merge-weights\n"
               "layout). --unsafe_serialization: one LibTorch file <out> instead, loadable with torch::load into\n"
               "the unsharded model. A copy where the checkpoint holds the model so; else accel-merge-weights\n"
               "(which links LibTorch) joins the shards or converts the file.\n",
               stdout);
    return 0;
  }
  int model = 0;
  bool safe = true;
  std::vector<std::string> positional;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--model" && i + 1 < args.size()) model = std::stoi(args[++i]);
    else if (args[i] == "--unsafe_serialization") safe = false;
    else positional.push_back(args[i]);
  }
  if (positional.size() != 2) throw UsageError("expected <checkpoint dir> <out dir> (usage: accel export --help)");
  if (!accel::checkpoint::export_is_a_copy(positional[0], model, safe)) run_merge_weights(args);
  accel::checkpoint::export_model(positional[0], positional[1], model, safe);
  std::printf("accel export: wrote %s\n",
              (safe ? std::filesystem::path(positional[1]) / "model.safetensors" : std::filesystem::path(positional[1]))
                  .c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::fputs(main_usage, stderr);
    return exit_usage;
  }
  const std::string command = args.front();
  args.erase(args.begin());
  if (command == "-h" || command == "--help" || command == "help") {
    std::fputs(main_usage, stdout);
    return 0;
  }
  if (command == "-V" || command == "--version") {
    std::printf("accel %s\n", ACCEL_VERSION);
    return 0;
  }
  try {
    if (command == "launch") return launch_command(args);
    if (command == "config") return config_command(args);
    if (command == "env") return env_command(args);
    if (command == "export") return export_command(args);
    if (command == "merge-weights") run_merge_weights(args);
    if (command == "test") return test_command(args);
    if (command == "estimate-memory") return estimate_command(args);
    std::fprintf(stderr, "accel: unknown command '%s' (commands: launch, config, env, export, merge-weights, test, estimate-memory; see accel --help)\n",
                 command.c_str());
    return exit_usage;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "accel %s: %s\n", command.c_str(), e.what());
    return exit_usage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel %s: %s\n", command.c_str(), e.what());
    return 1;
  }
}
