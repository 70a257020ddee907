#pragma once
// `accel estimate-memory`: per-rank bytes of a common model shape under each
// strategy and number of processes, at the user's batch size, as a table or
// JSON lines (NOTE [Memory estimate]). Accelerate's estimate-memory counts
// parameters at batch 1; this counts gradients, the optimizer state as each
// strategy shards it, and the activations of a training step.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "accel/estimate/report.hpp"
#include "accel/estimate/shapes.hpp"
#include "cli/args.hpp"

namespace accel::cli {

struct EstimateRequest {
  std::string model;  ///< "gpt" or "mlp"
  estimate::GptShape gpt{.vocab = 50257, .context = 1024, .width = 768, .heads = 12, .layers = 12};  // GPT-2 small
  estimate::MlpShape mlp{};
  std::int64_t batch_size = 8;
  std::string mixed_precision = "no";
  std::string optimizer = "adam";
  estimate::ReportOptions report{};
  bool json = false;
};

namespace detail {

inline std::vector<std::int64_t> parse_int_list(const std::string& flag, const std::string& text) {
  std::vector<std::int64_t> values;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) values.push_back(parse_int_flag(flag, item));
  if (values.empty()) throw UsageError(flag + " expects a comma-separated list of integers, got '" + text + "'");
  return values;
}

struct EstimateFlag {
  std::string_view name, metavar, help;
  std::function<void(EstimateRequest&, const std::string& flag, const std::string& value)> apply;
};

inline const std::vector<EstimateFlag>& estimate_flags() {
  static const std::vector<EstimateFlag> flags = {
      {"--layers", "N", "gpt: transformer blocks (default 12)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) { r.gpt.layers = parse_int_flag(f, v); }},
      {"--width", "N", "gpt: hidden size (default 768)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) { r.gpt.width = parse_int_flag(f, v); }},
      {"--heads", "N", "gpt: attention heads (default 12)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) { r.gpt.heads = parse_int_flag(f, v); }},
      {"--vocab", "N", "gpt: vocabulary size (default 50257)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) { r.gpt.vocab = parse_int_flag(f, v); }},
      {"--context", "N", "gpt: tokens per sequence (default 1024)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) { r.gpt.context = parse_int_flag(f, v); }},
      {"--widths", "A,B,...", "mlp: layer widths, input first, classes last (e.g. 64,256,256,10)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) { r.mlp.widths = parse_int_list(f, v); }},
      {"--batch_size", "N", "samples (gpt: sequences) per process and step (default 8)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) { r.batch_size = parse_int_flag(f, v); }},
      {"--num_processes", "N,M,...", "process counts to compare (default 1,2,4,8)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) {
         r.report.num_processes.clear();
         for (auto n : parse_int_list(f, v)) {
           if (n < 1) throw UsageError(f + " expects counts of at least 1, got " + std::to_string(n));
           r.report.num_processes.push_back(static_cast<int>(n));
         }
       }},
      {"--optimizer", "NAME", "adam, adamw, sgd, sgd_momentum, rmsprop or adagrad (default adam)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) {
         const std::vector<std::pair<std::string, int>> known = {{"adam", 2},    {"adamw", 2},   {"sgd", 0},
                                                                 {"sgd_momentum", 1}, {"rmsprop", 1}, {"adagrad", 1}};
         for (const auto& [name, states] : known)
           if (v == name) {
             r.optimizer = v;
             r.report.optimizer.states_per_parameter = states;
             return;
           }
         throw UsageError(f + " expects adam, adamw, sgd, sgd_momentum, rmsprop or adagrad, got '" + v + "'");
       }},
      {"--mixed_precision", "no|bf16|fp16", "the step's precision: model state stays fp32; activations are estimated for no",
       [](EstimateRequest& r, const std::string& f, const std::string& v) {
         if (v != "no" && v != "bf16" && v != "fp16") throw UsageError(f + " expects no, bf16 or fp16, got '" + v + "'");
         r.mixed_precision = v;
       }},
      {"--fsdp_auto_wrap_policy", "NAME", "ZeRO-3 units: NO_WRAP (default), SIZE_BASED_WRAP or TRANSFORMER_BASED_WRAP",
       [](EstimateRequest& r, const std::string& f, const std::string& v) {
         const auto policy = auto_wrap_policy_named(v);
         if (!policy) throw UsageError(f + " expects " + one_of(auto_wrap_policy_names) + ", got '" + v + "'");
         r.report.auto_wrap_policy = *policy;
       }},
      {"--fsdp_min_num_params", "N", "SIZE_BASED_WRAP: elements per unit at least",
       [](EstimateRequest& r, const std::string& f, const std::string& v) { r.report.min_num_params = parse_int_flag(f, v); }},
      {"--fsdp_transformer_layer_cls_to_wrap", "A,B", "TRANSFORMER_BASED_WRAP: classes (the gpt's blocks: BlockImpl)",
       [](EstimateRequest& r, const std::string&, const std::string& v) {
         std::stringstream list(v);
         for (std::string name; std::getline(list, name, ',');)
           if (!name.empty()) r.report.transformer_layer_cls_to_wrap.push_back(name);
       }},
      {"--bucket_cap_mb", "MB", "ZeRO-1/2 gradient bucket size (default 25)",
       [](EstimateRequest& r, const std::string& f, const std::string& v) {
         r.report.bucket_cap_mb = parse_seconds_flag(f, v);
         if (r.report.bucket_cap_mb <= 0) throw UsageError(f + " expects a positive size, got '" + v + "'");
       }},
      {"--shard_group_size", "N", "add HybridShard rows with shard groups of N ranks",
       [](EstimateRequest& r, const std::string& f, const std::string& v) {
         r.report.shard_group_size = parse_int_flag(f, v);
       }},
      {"--json", "", "one JSON object per row instead of the table",
       [](EstimateRequest& r, const std::string&, const std::string&) { r.json = true; }},
  };
  return flags;
}

}  // namespace detail

inline std::string estimate_usage() {
  std::string out =
      "usage: accel estimate-memory gpt|mlp [flags]\n"
      "\n"
      "Per-rank memory of training a model of this shape under each strategy (DDP, ZeRO-1/2/3, with and\n"
      "without cpu_offload), for each number of processes: parameters, gradients and optimizer state as\n"
      "each strategy holds them between steps (exact: padding and ZeRO-3 units included), and the\n"
      "activations of one step at --batch_size per process. gpt is the decoder of examples/gpt_model.hpp\n"
      "(defaults: GPT-2 small); mlp is Linear layers with ReLU between (examples/mlp.cpp). For your own\n"
      "LibTorch model, call accel::estimate from C++ (README, \"Estimating memory\").\n"
      "\nflags:\n";
  for (const auto& f : detail::estimate_flags()) {
    std::string left = std::string(f.name) + (f.metavar.empty() ? "" : " " + std::string(f.metavar));
    left.resize(std::max<std::size_t>(left.size() + 1, 44), ' ');
    out += "  " + left + std::string(f.help) + "\n";
  }
  return out;
}

inline EstimateRequest parse_estimate(const std::vector<std::string>& args) {
  EstimateRequest request;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string word = args[i], value;
    if (word.rfind("--", 0) != 0) {
      if (!request.model.empty()) throw UsageError("unexpected argument '" + word + "' (the model is " + request.model + ")");
      if (word != "gpt" && word != "mlp") throw UsageError("unknown model '" + word + "': give gpt or mlp");
      request.model = word;
      continue;
    }
    const auto equals = word.find('=');
    const bool inline_value = equals != std::string::npos;
    if (inline_value) {
      value = word.substr(equals + 1);
      word = word.substr(0, equals);
    }
    const auto& flags = detail::estimate_flags();
    auto it = std::find_if(flags.begin(), flags.end(), [&](const auto& f) { return f.name == word; });
    if (it == flags.end()) throw UsageError("unknown flag " + word + " (see accel estimate-memory --help)");
    if (!it->metavar.empty() && !inline_value) {
      if (i + 1 >= args.size()) throw UsageError(word + " expects a value (" + std::string(it->metavar) + ")");
      value = args[++i];
    }
    it->apply(request, word, value);
  }
  if (request.model.empty()) throw UsageError("which model? accel estimate-memory gpt|mlp [flags]");
  if (request.model == "mlp" && request.mlp.widths.empty())
    throw UsageError("mlp needs --widths (input first, classes last), e.g. --widths 64,256,256,10");
  return request;
}

inline int estimate_memory(const EstimateRequest& request) {
  const bool gpt = request.model == "gpt";
  estimate::ModelShape shape;
  std::optional<std::int64_t> activations;
  std::vector<estimate::ReportRow> rows;
  try {  // a shape or setting the estimate refuses is the user's flags
    shape = gpt ? estimate::model_shape(request.gpt) : estimate::model_shape(request.mlp);
    if (request.mixed_precision == "no")
      activations = gpt ? estimate::activation_bytes(request.gpt, request.batch_size)
                        : estimate::activation_bytes(request.mlp, request.batch_size);
    rows = estimate::report(shape, activations, request.report);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (request.json) {
    for (const auto& r : rows) {
      nlohmann::json line = {{"strategy", r.strategy},
                             {"num_processes", r.processes},
                             {"parameters", r.state.parameters},
                             {"gradients", r.state.gradients},
                             {"optimizer_state", r.state.optimizer_state},
                             {"offloaded_parameters", r.state.offloaded_parameters},
                             {"offloaded_gradients", r.state.offloaded_gradients},
                             {"offloaded_optimizer_state", r.state.offloaded_optimizer_state},
                             {"step_buffers", r.step_buffers},
                             {"activations", r.activations ? nlohmann::json(*r.activations) : nlohmann::json(nullptr)},
                             {"per_rank", r.device_bytes()}};
      std::printf("%s\n", line.dump().c_str());
    }
    return 0;
  }
  if (gpt)
    std::printf("gpt: %lld layers, width %lld, %lld heads, vocab %lld, context %lld: %lld parameters\n",
                static_cast<long long>(request.gpt.layers), static_cast<long long>(request.gpt.width),
                static_cast<long long>(request.gpt.heads), static_cast<long long>(request.gpt.vocab),
                static_cast<long long>(request.gpt.context), static_cast<long long>(shape.numel()));
  else
    std::printf("mlp: %zu layers: %lld parameters\n", request.mlp.widths.size() - 1, static_cast<long long>(shape.numel()));
  std::printf("batch %lld per process, optimizer %s, mixed_precision %s\n\n", static_cast<long long>(request.batch_size),
              request.optimizer.c_str(), request.mixed_precision.c_str());
  std::fputs(estimate::format_report(rows).c_str(), stdout);
  std::printf(
      "\nper rank: parameters + gradients + optimizer + step buffers + activations on the training device; host:\n"
      "what cpu_offload keeps in host memory. Model state is as held between steps; within a step ZeRO-2 also\n"
      "holds full-size gradient buckets during backward, and the optimizer its temporaries. Step buffers: what\n"
      "ZeRO-3 and HybridShard keep for the next step: gathered, the root unit (what no wrapped module took) and\n"
      "the two largest others, the one computing and the one prefetched (with reshard_after_forward false,\n"
      "FSDP2's SHARD_GRAD_OP, every unit); as gradients, the largest two adjacent buckets. Units of very different\n"
      "sizes can keep more (a buffer each), Gloo's reduce-scatter a receive buffer; on CUDA the caching allocator\n"
      "keeps them reserved.\n");
  if (!activations)
    std::printf("Activations (-): estimated for fp32 only; under %s autocast measure one step with\n"
                "accel::estimate::peak_bytes_during.\n",
                request.mixed_precision.c_str());
  return 0;
}

}  // namespace accel::cli
