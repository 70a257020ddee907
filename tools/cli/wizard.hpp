#pragma once
// `accel config` on a terminal with no flags: Accelerate's questionnaire,
// for what applies to accel (one machine or several, CPU or GPU, processes,
// FSDP/ZeRO settings, mixed precision, gradient accumulation, debug). Each
// question shows its default, takes an option's number or name, and asks
// again on an answer it cannot use. The answers become the same
// LaunchSettings the flags make, so the file written is the one
// `accel config --flags` would write. Not asked: DeepSpeed, Megatron-LM,
// dynamo, fp8 and the TPU/NPU/MPS paths, which accel does not have.

#include <cctype>
#include <istream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "accel/core/policies.hpp"
#include "cli/settings.hpp"

namespace accel::cli {

class Questions {
 public:
  Questions(std::istream& in, std::ostream& out) : in_(in), out_(out) {}

  /// One of `options` (by number or by name); `fallback` is the default's index.
  std::string choice(const std::string& question, const std::vector<std::string>& options, std::size_t fallback) {
    out_ << question << '\n';
    for (std::size_t i = 0; i < options.size(); ++i) out_ << "  [" << i << "] " << options[i] << '\n';
    while (true) {
      const std::string answer = ask("Your choice [" + std::to_string(fallback) + "]: ");
      if (answer.empty()) return options[fallback];
      for (std::size_t i = 0; i < options.size(); ++i)
        if (answer == std::to_string(i) || answer == options[i]) return options[i];
      out_ << "Please enter a number from 0 to " << options.size() - 1 << ", or one of the names.\n";
    }
  }

  int integer(const std::string& question, int fallback, int min, int max = 1 << 30) {
    while (true) {
      const std::string answer = ask(question + " [" + std::to_string(fallback) + "]: ");
      if (answer.empty()) return fallback;
      std::size_t used = 0;
      long long value = 0;
      try {
        value = std::stoll(answer, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == answer.size() && value >= min && value <= max) return static_cast<int>(value);
      out_ << "Please enter a whole number from " << min << (max == 1 << 30 ? std::string(" up") : " to " + std::to_string(max))
           << ".\n";
    }
  }

  bool yes_no(const std::string& question, bool fallback) {
    while (true) {
      std::string answer = ask(question + (fallback ? " [YES/no]: " : " [yes/NO]: "));
      for (auto& c : answer) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (answer.empty()) return fallback;
      if (answer == "yes" || answer == "y") return true;
      if (answer == "no" || answer == "n") return false;
      out_ << "Please enter yes or no.\n";
    }
  }

  /// Free text; `required`: no default, an empty answer asks again.
  std::string text(const std::string& question, const std::optional<std::string>& fallback) {
    while (true) {
      const std::string answer = ask(question + (fallback ? " [" + *fallback + "]" : std::string()) + ": ");
      if (!answer.empty()) return answer;
      if (fallback) return *fallback;
      out_ << "Please enter a value.\n";
    }
  }

 private:
  std::string ask(const std::string& prompt) {
    out_ << prompt << std::flush;
    std::string line;
    if (!std::getline(in_, line))
      throw UsageError("the input ended before the questions did; nothing was written");
    line.erase(0, line.find_first_not_of(" \t\r"));
    line.erase(line.find_last_not_of(" \t\r") + 1);
    return line;
  }

  std::istream& in_;
  std::ostream& out_;
};

/// Accelerate's questions that apply to accel, as LaunchSettings (origin:
/// "accel config questions"). `gpus`: whether this machine has NVIDIA GPUs
/// (the multi-GPU answer is offered either way, for another machine).
inline LaunchSettings ask_config(Questions& q, bool gpus) {
  LaunchSettings s;
  auto mark = [&](const char* key) { s.origin[key] = "accel config questions"; };
  s.compute_environment = "LOCAL_MACHINE";
  const std::string machine = q.choice("Which type of machine are you using?",
                                       {"No distributed training", "multi-CPU", "multi-GPU"}, gpus ? 2 : 0);
  s.distributed_type = machine == "multi-CPU" ? "MULTI_CPU" : machine == "multi-GPU" ? "MULTI_GPU" : "NO";
  mark("distributed_type");
  if (*s.distributed_type == "NO") {
    s.num_processes = 1, s.num_machines = 1;
    s.use_cpu = q.yes_no("Do you want to run your training on CPU only (even if a GPU is available)?", !gpus);
  } else {
    s.use_cpu = *s.distributed_type == "MULTI_CPU";
    s.num_machines = q.integer("How many different machines will you use (more than 1 for multi-node training)?", 1, 1);
    mark("num_machines");
    if (*s.num_machines > 1) {
      s.machine_rank = q.integer("What is the rank of this machine?", 0, 0, *s.num_machines - 1);
      s.main_process_ip = q.text("What is the IP address of the machine that will host the main process?", std::nullopt);
      s.main_process_port = q.integer("What is the port you will use to communicate with the main process?", 29500, 1, 65535);
      s.same_network = q.yes_no("Are all the machines on the same local network?", true);
      mark("machine_rank"), mark("main_process_ip"), mark("main_process_port");
    }
    s.debug = q.yes_no("Should distributed operations be checked while running for errors? This can avoid timeout "
                       "issues but will be slower.", false);
    if (q.yes_no("Do you want to use FullyShardedDataParallel (ZeRO)?", false)) {
      s.distributed_type = "FSDP";
      // Accelerate asks the version first (FSDP2 by default); FSDP1 names a
      // sharding strategy, FSDP2 only whether units reshard after forward.
      const bool fsdp2 = q.choice("What should be your FSDP version?", {"1", "2"}, 1) == "2";
      s.fsdp_config["fsdp_version"] = fsdp2 ? 2 : 1;
      bool has_units = true;  // ZeRO<3> / HybridShard (or FSDP2's reshard-after-forward)
      if (fsdp2) {
        const bool reshard = q.yes_no("Do you want to enable resharding after forward?", true);
        s.fsdp_config["fsdp_reshard_after_forward"] = reshard;
        has_units = reshard;
      } else {
        const std::string strategy = q.choice("What should be your sharding strategy?",
                                              accel::names_in(accel::sharding_strategy_names), 0);
        s.fsdp_config["fsdp_sharding_strategy"] = strategy;
        has_units = strategy == "FULL_SHARD" || strategy == "HYBRID_SHARD";
      }
      s.fsdp_config["fsdp_offload_params"] =
          q.yes_no("Do you want to offload parameters and gradients to CPU?", false);
      if (has_units) {
        const std::string wrap = q.choice("What should be your auto wrap policy?",
                                          accel::names_in(accel::auto_wrap_policy_names), 0);
        s.fsdp_config["fsdp_auto_wrap_policy"] = wrap;
        if (wrap == "SIZE_BASED_WRAP")
          s.fsdp_config["fsdp_min_num_params"] =
              q.integer("What should be your FSDP's minimum number of parameters for the size-based policy?",
                        100000000, 0);
        if (wrap == "TRANSFORMER_BASED_WRAP") {
          const std::string classes = q.text("Specify the comma-separated list of module class names to wrap "
                                             "(e.g. BlockImpl); empty: the strategy's default",
                                             std::string());
          if (!classes.empty()) s.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] = classes;
        }
        s.fsdp_config["fsdp_state_dict_type"] = q.choice(
            "What should be your FSDP's state dict type?", accel::names_in(accel::state_dict_type_names), 0);
        if (wrap != "NO_WRAP")  // it checkpoints the units, which NO_WRAP has none of
          s.fsdp_config["fsdp_activation_checkpointing"] =
              q.yes_no("Do you want to enable FSDP activation checkpointing?", false);
      }
    }
    const int machines = *s.num_machines;
    const std::string unit = *s.use_cpu ? "CPU processes" : "processes (one per GPU)";
    while (true) {
      s.num_processes = q.integer("How many " + unit + " in total, over all machines, will you use?", machines, 1);
      if (*s.num_processes % machines == 0) break;
      q.text("That does not divide by the " + std::to_string(machines) + " machines; press Enter to answer again",
             std::string());
    }
    mark("num_processes");
    if (!*s.use_cpu)
      s.gpu_ids = q.text("What GPU(s) (by id) should be used for training on this machine, as a comma-separated list?",
                         std::string("all"));
  }
  s.mixed_precision = q.choice("Do you wish to use mixed precision? (It must match the Precision of your program's "
                               "Trainer.)",
                               {"no", "fp16", "bf16"}, 0);
  mark("mixed_precision");
  s.gradient_accumulation_steps = q.integer("How many gradient accumulation steps?", 1, 1);
  return s;
}

}  // namespace accel::cli
