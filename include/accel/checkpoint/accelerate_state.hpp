#pragma once
// trainer.load_state on a directory the Python Accelerate's save_state wrote:
// a run started in Python goes on in C++.
//
// NOTE [Resuming a Python Accelerate run]
// Accelerate's save_state writes, per prepared object in prepare order (the
// first object's file named plainly, the i-th's with _<i>):
//   model.safetensors, model_<i>.safetensors  the unwrapped models' state dicts
//                                             (safe_serialization, its default)
//   optimizer.bin, optimizer_<k>.bin          torch.save(optimizer.state_dict())
//   scheduler.bin, scheduler_<k>.bin          torch.save(scheduler.state_dict())
//   scaler.pt                                 the GradScaler's (fp16)
//   random_states_<rank>.pkl                  Python, NumPy and torch generators
// torch.save writes a zip of a pickle and its tensors, which LibTorch's
// pickle_load reads into IValues. The models load as trainer.load_safetensors
// loads them (each rank its shard or slice). An optimizer's state is keyed
// by each parameter's position in its param_groups, the order that
// torch.nn.Module.parameters() and LibTorch's Module::parameters() share for
// the same layers; its hyperparameters (the scheduled learning rate too)
// replace the C++ optimizer's, as torch's load_state_dict does. A scheduler
// replays its last_epoch steps (LibTorch's schedulers hold no other state).
// The random states are Python objects C++ cannot rebuild: skipped, with a
// warning. Everything is read and checked on every rank before anything
// changes; then all ranks load, or all throw.

#include <filesystem>

#include "accel/checkpoint/save_model.hpp"
#include "accel/checkpoint/state.hpp"
#include "accel/core/compiled_once.hpp"

namespace accel::checkpoint {

/// Whether `dir` is a Python Accelerate save_state directory: its
/// model.safetensors, and no accel manifest.
ACCEL_COMPILED_ONCE bool is_accelerate_state(const std::filesystem::path& dir);

/// Restores the models, optimizers (Adam, AdamW, SGD), schedulers and FP16
/// loss scale of an Accelerate save_state directory (NOTE [Resuming a Python
/// Accelerate run]). Every rank calls it; trainer.load_state does when
/// is_accelerate_state(dir).
ACCEL_COMPILED_ONCE void load_accelerate_state(TrainerView& t, const std::filesystem::path& dir);

}  // namespace accel::checkpoint

#if ACCEL_DEFINE_COMPILED_ONCE
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <c10/core/GradMode.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "accel/compat/torch_compat.hpp"

namespace accel::checkpoint {

namespace detail {

// Accelerate's file of the i-th object of a kind.
inline std::string accelerate_file(const std::string& stem, std::size_t i, const std::string& extension) {
  return (i == 0 ? stem : stem + "_" + std::to_string(i)) + extension;
}

// A file torch.save wrote, unpickled.
inline c10::IValue read_torch_save(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError("it has no " + path.filename().string());
  std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  try {
    return torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    throw CheckpointError(path.filename().string() + " is not a torch.save file LibTorch can read (" + why + ")");
  }
}

// What a pickled state dict holds under `key`, or a sentence saying it lacks it.
inline c10::IValue value_at(const c10::IValue& dict, const std::string& key, const std::string& where) {
  if (!dict.isGenericDict()) throw CheckpointError(where + " is not a dictionary");
  const auto entries = dict.toGenericDict();
  const auto found = entries.find(c10::IValue(key));
  if (found == entries.end()) throw CheckpointError(where + " has no \"" + key + "\"");
  return found->value();
}

inline double number(const c10::IValue& value, const std::string& what) {
  if (value.isDouble()) return value.toDouble();
  if (value.isInt()) return static_cast<double>(value.toInt());
  if (value.isBool()) return value.toBool() ? 1.0 : 0.0;
  if (value.isTensor() && value.toTensor().numel() == 1) return value.toTensor().item<double>();
  throw CheckpointError(what + " is not a number");
}

// A flag a newer torch added to a state dict: false where it is absent or None.
inline bool flag_if_present(const c10::IValue& dict, const std::string& key) {
  const auto entries = dict.toGenericDict();
  const auto found = entries.find(c10::IValue(key));
  return found != entries.end() && !found->value().isNone() && number(found->value(), key) != 0;
}

// A saved per-parameter tensor, checked against the parameter it belongs to.
inline at::Tensor state_tensor(const c10::IValue& state, const std::string& key, const at::Tensor& parameter,
                               const std::string& where) {
  const auto value = value_at(state, key, where);
  if (!value.isTensor()) throw CheckpointError(where + "'s \"" + key + "\" is not a tensor");
  const at::Tensor saved = value.toTensor();
  if (saved.sizes() != parameter.sizes())
    throw CheckpointError(where + "'s \"" + key + "\" has shape " + c10::str(saved.sizes()) + ", its parameter here " +
                          c10::str(parameter.sizes()) + " (the models' parameters must be the same, in the same order)");
  return saved.to(parameter.options()).clone();
}

// Adam's and AdamW's hyperparameters and per-parameter state.
template <class Options>
void restore_adam(Options& options, const c10::IValue& group, const std::string& where) {
  const auto betas = value_at(group, "betas", where);
  if (!betas.isTuple() && !betas.isList()) throw CheckpointError(where + "'s betas are not a pair");
  const auto pair = betas.isTuple() ? betas.toTupleRef().elements().vec() : betas.toListRef().vec();
  options.lr(number(value_at(group, "lr", where), where + "'s lr"))
      .betas({number(pair.at(0), "beta1"), number(pair.at(1), "beta2")})
      .eps(number(value_at(group, "eps", where), where + "'s eps"))
      .weight_decay(number(value_at(group, "weight_decay", where), where + "'s weight_decay"))
      .amsgrad(number(value_at(group, "amsgrad", where), where + "'s amsgrad") != 0);
}
template <class State>
std::unique_ptr<torch::optim::OptimizerParamState> adam_state(const c10::IValue& saved, const at::Tensor& parameter,
                                                              bool amsgrad, const std::string& where) {
  auto state = std::make_unique<State>();
  state->step(static_cast<std::int64_t>(number(value_at(saved, "step", where), where + "'s step")));
  state->exp_avg(state_tensor(saved, "exp_avg", parameter, where));
  state->exp_avg_sq(state_tensor(saved, "exp_avg_sq", parameter, where));
  if (amsgrad) state->max_exp_avg_sq(state_tensor(saved, "max_exp_avg_sq", parameter, where));
  return state;
}

// What one optimizer becomes: every check made before anything changes.
struct RestoredOptimizer {
  std::vector<std::function<void()>> apply;
  std::int64_t steps = 0;  // Adam's step count, where it keeps one
};

inline RestoredOptimizer plan_optimizer(torch::optim::Optimizer& optimizer, const c10::IValue& saved,
                                        const std::string& file) {
  RestoredOptimizer out;
  const auto saved_groups = value_at(saved, "param_groups", file);
  const auto states = value_at(saved, "state", file);
  if (!saved_groups.isList() || !states.isGenericDict()) throw CheckpointError(file + " is not an optimizer's state_dict");
  const auto groups = saved_groups.toListRef();
  auto& mine = optimizer.param_groups();
  if (groups.size() != mine.size())
    throw CheckpointError(file + " holds " + std::to_string(groups.size()) + " parameter group(s), this optimizer " +
                          std::to_string(mine.size()));
  const auto state_of = states.toGenericDict();
  for (std::size_t g = 0; g < mine.size(); ++g) {
    const std::string where = file + " group " + std::to_string(g);
    const auto listed = value_at(groups[g], "params", where);
    if (!listed.isList()) throw CheckpointError(where + "'s params are not a list");
    const auto indices = listed.toListRef();
    auto& params = mine[g].params();
    if (indices.size() != params.size())
      throw CheckpointError(where + " holds " + std::to_string(indices.size()) + " parameters, this optimizer's " +
                            std::to_string(params.size()));
    auto* options = &mine[g].options();
    auto* adam = dynamic_cast<torch::optim::AdamOptions*>(options);
    auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(options);
    auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(options);
    if (adam == nullptr && adamw == nullptr && sgd == nullptr)
      throw CheckpointError("load_state reads Python optimizer state into Adam, AdamW and SGD; " + where +
                            " belongs to another optimizer");
    const c10::IValue group = groups[g];
    if (adam != nullptr) {
      if (flag_if_present(group, "decoupled_weight_decay"))
        throw CheckpointError(where + " is Adam with decoupled_weight_decay: prepare torch::optim::AdamW");
      auto copy = *adam;
      restore_adam(copy, group, where);
      out.apply.push_back([adam, copy] { *adam = copy; });
    } else if (adamw != nullptr) {
      auto copy = *adamw;
      restore_adam(copy, group, where);
      out.apply.push_back([adamw, copy] { *adamw = copy; });
    } else {
      auto copy = *sgd;
      copy.lr(number(value_at(group, "lr", where), where + "'s lr"))
          .momentum(number(value_at(group, "momentum", where), where + "'s momentum"))
          .dampening(number(value_at(group, "dampening", where), where + "'s dampening"))
          .weight_decay(number(value_at(group, "weight_decay", where), where + "'s weight_decay"))
          .nesterov(number(value_at(group, "nesterov", where), where + "'s nesterov") != 0);
      out.apply.push_back([sgd, copy] { *sgd = copy; });
    }
    for (std::size_t j = 0; j < params.size(); ++j) {
      const auto found = state_of.find(indices[j]);
      if (found == state_of.end()) continue;  // a parameter that never stepped
      const at::Tensor parameter = params[j];
      const std::string at = file + " parameter " + std::to_string(indices[j].toInt());
      std::shared_ptr<torch::optim::OptimizerParamState> state;
      if (adam != nullptr || adamw != nullptr) {
        const bool amsgrad = number(value_at(group, "amsgrad", where), "amsgrad") != 0;
        state = adam != nullptr ? adam_state<torch::optim::AdamParamState>(found->value(), parameter, amsgrad, at)
                                : adam_state<torch::optim::AdamWParamState>(found->value(), parameter, amsgrad, at);
        out.steps = std::max(out.steps, static_cast<std::int64_t>(number(value_at(found->value(), "step", at), "step")));
      } else {
        const auto buffer = value_at(found->value(), "momentum_buffer", at);
        if (buffer.isNone()) continue;
        auto sgd_state = std::make_unique<torch::optim::SGDParamState>();
        sgd_state->momentum_buffer(state_tensor(found->value(), "momentum_buffer", parameter, at));
        state = std::move(sgd_state);
      }
      out.apply.push_back([&optimizer, parameter, state] {
        optimizer.state()[compat::optimizer_state_key(optimizer, parameter)] = state->clone();
      });
    }
  }
  return out;
}

}  // namespace detail

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE bool is_accelerate_state(const std::filesystem::path& dir) {
  return std::filesystem::exists(dir / "model.safetensors") && !std::filesystem::exists(dir / "manifest.json");
}

ACCEL_COMPILED_ONCE void load_accelerate_state(TrainerView& t, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const std::string where = "Python Accelerate checkpoint " + dir.string() + ": ";
  std::string error;
  // Read and check everything first: nothing changes unless every rank can load it all.
  std::vector<detail::RestoredOptimizer> optimizers;
  std::vector<std::int64_t> scheduler_steps(t.optimizers.size(), -1);
  std::optional<precision::ScalerState> scaler;
  try {
    if (t.models.empty()) throw CheckpointError("prepare the models before load_state");
    if (fs::exists(dir / detail::accelerate_file("model", t.models.size(), ".safetensors")))
      throw CheckpointError("it holds more models than the " + std::to_string(t.models.size()) + " prepared");
    if (!t.custom.empty())
      throw CheckpointError("objects are registered for checkpointing, which Accelerate pickles as Python objects "
                            "(custom_checkpoint_<i>.pkl) that C++ cannot read");
    for (std::size_t k = 0; k < t.optimizers.size(); ++k) {
      const auto& o = t.optimizers[k];
      if (t.engines[o.model]->shard_layout())
        throw CheckpointError("it holds optimizer " + std::to_string(k) + "'s state for whole parameters; this "
                              "trainer's optimizer steps ZeRO shards: resume it under DDP (or one process), then "
                              "save_state, which any strategy loads");
      const std::string file = detail::accelerate_file("optimizer", k, ".bin");
      optimizers.push_back(detail::plan_optimizer(*o.optimizer, detail::read_torch_save(dir / file), file));
      if (o.scheduler != nullptr) {
        const std::string schedule = detail::accelerate_file("scheduler", k, ".bin");
        const auto saved = detail::read_torch_save(dir / schedule);
        scheduler_steps[k] =
            static_cast<std::int64_t>(detail::number(detail::value_at(saved, "last_epoch", schedule), "last_epoch"));
        if (*o.scheduler_steps > scheduler_steps[k])
          throw CheckpointError("call load_state before training: the scheduler has already stepped");
      }
    }
    if (fs::exists(dir / detail::accelerate_file("optimizer", t.optimizers.size(), ".bin")))
      throw CheckpointError("it holds the state of more optimizers than the " + std::to_string(t.optimizers.size()) +
                            " prepared");
    if (std::string(t.precision) == "fp16") {
      const auto saved = detail::read_torch_save(dir / "scaler.pt");
      scaler = precision::ScalerState{
          detail::number(detail::value_at(saved, "scale", "scaler.pt"), "scale"),
          static_cast<std::int64_t>(detail::number(detail::value_at(saved, "_growth_tracker", "scaler.pt"), "_growth_tracker"))};
    }
  } catch (const std::exception& e) {
    error = where + e.what();
  }
  detail::agree(t.world, error, "load_state", "read " + dir.string());
  for (std::size_t i = 0; i < t.models.size(); ++i)
    load_model(t.world, *t.engines[i], *t.models[i], dir / detail::accelerate_file("model", i, ".safetensors"), {});
  c10::NoGradGuard no_grad;
  for (std::size_t k = 0; k < t.optimizers.size(); ++k) {
    const auto& o = t.optimizers[k];
    // The schedule first: the saved learning rates then overwrite the replayed ones.
    for (; o.scheduler != nullptr && *o.scheduler_steps < scheduler_steps[k]; ++*o.scheduler_steps) o.scheduler->step();
    for (const auto& apply : optimizers[k].apply) apply();
  }
  t.counters = {optimizers.empty() ? 0 : optimizers.front().steps, 0};
  if (scaler) t.scaler = *scaler;
  if (t.world.rank() == 0)
    std::fprintf(stderr,
                 "accel: load_state: %s is a Python Accelerate checkpoint: its random_states_<rank>.pkl hold Python "
                 "and NumPy generators, which C++ cannot restore (the generators keep this run's seeds), and the "
                 "data loaders start at their first batch\n",
                 dir.string().c_str());
}

}  // namespace accel::checkpoint

#endif
