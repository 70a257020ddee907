#pragma once
// save_state / load_state over a view of the trainer: compiled once, not per
// Trainer<S, P, D>. The policies enter only through a few values (the
// precision's name) and the engine's checkpoint hooks (its virtual interface).
//
// NOTE [Checkpoint layout]
// One directory per checkpoint (NOTE [Checkpoint commit] for how it is
// committed). A model cut into parts by tensor or pipeline parallelism is
// written part by part, each by the part's first data replica; a sharded
// optimizer state shard by shard, each by its shard's first replica:
//   model_<i>.safetensors | model_<i>_part_<p>.safetensors
//                                              the prepared models (ZeRO-3: gathered whole), or under
//                                              SHARDED_STATE_DICT each rank's shards (NOTE [Sharded checkpoints]);
//                                              an older accel's model_<i>[_part_<p>].pt is still read
//   optimizer.pt | optimizer_part_<p>.pt       replicated optimizer state
//   optimizer_shard_<s>.pt | optimizer_part_<p>_shard_<s>.pt   sharded optimizer state
//   optimizer_<k>...                           the k-th optimizer's (k > 0), as Accelerate names them
//   random_states_<rank>.pt                    every rank's generators (CPU, and its GPU's)
//   custom_checkpoint_<k>.pt                   register_for_checkpointing objects
//   manifest.json                              the rest: steps, loaders, scaler, layout, file sizes
// A checkpoint loads into the same cut of the model only (the manifest
// names it); its optimizer shards reshard to another number of data ranks
// (NOTE [Resharding optimizer state]).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "accel/comm/communicator.hpp"
#include "accel/core/compiled_once.hpp"
#include "accel/data/loader.hpp"
#include "accel/precision/grad_scaler.hpp"
#include "accel/strategy/engine.hpp"

namespace accel::checkpoint {

/// The engine's part in a checkpoint: its CheckpointHooks, the engine
/// itself (strategy/engine.hpp).
using EngineHooks = strategy::CheckpointHooks;

/// An object registered with register_for_checkpointing.
struct CustomObject {
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
};

struct StepCounters {
  std::int64_t optimizer_steps = 0;
  int micro_steps = 0;
};

/// One prepared optimizer: the model whose engine holds its parameters, and
/// the scheduler that steps with it (with the steps it took).
struct OptimizerView {
  torch::optim::Optimizer* optimizer = nullptr;
  std::size_t model = 0;
  torch::optim::LRScheduler* scheduler = nullptr;
  std::int64_t* scheduler_steps = nullptr;
};

/// What save and load read and write, by reference.
struct TrainerView {
  at::Device device;  ///< the training device: its generator is saved too
  comm::Communicator& world;
  comm::Communicator& data_group;  ///< the ranks that read different data
  std::vector<EngineHooks*> engines;  ///< engines[i] trains models[i]; one even before any model
  const char* precision;
  std::vector<std::shared_ptr<torch::nn::Module>>& models;
  std::vector<OptimizerView> optimizers;
  StepCounters& counters;
  precision::ScalerState& scaler;
  std::vector<CustomObject>& custom;
  std::vector<std::weak_ptr<data::LoaderPosition>>& loaders;
};

/// Saves everything needed to resume exactly (NOTE [Checkpoint layout],
/// NOTE [Checkpoint commit]). Every rank calls it.
ACCEL_COMPILED_ONCE void save_state(TrainerView& t, const std::filesystem::path& dir);

/// Restores a checkpoint written by save_state (trainer.load_state reads
/// the Python Accelerate's too: accelerate_state.hpp). Every rank checks it;
/// if any rank cannot load it, all of them throw, naming the problem.
ACCEL_COMPILED_ONCE void load_state(TrainerView& t, const std::filesystem::path& dir);

}  // namespace accel::checkpoint

#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/serialize.h>

#include <sstream>
#include <string>

#include "accel/checkpoint/files.hpp"
#include "accel/checkpoint/safetensors.hpp"
#include "accel/checkpoint/sharded.hpp"
#include "accel/comm/collectives.hpp"
#include "accel/compat/torch_compat.hpp"
#include "accel/core/json.hpp"
#include "accel/device/random_state.hpp"

namespace accel::checkpoint {

namespace detail {

// File names of NOTE [Checkpoint layout]; the part is left out for a whole model.
struct FileNames {
  int parts = 1, part = 0;
  std::string qualifier() const { return parts == 1 ? "" : "_part_" + std::to_string(part); }
  std::string model_stem(std::size_t i) const { return checkpoint::model_stem(static_cast<int>(i)) + qualifier(); }
  std::string model(std::size_t i) const { return model_stem(i) + ".safetensors"; }
  // The first optimizer's files keep the plain name (a checkpoint of one optimizer), the k-th's add _<k>.
  static std::string optimizer_stem(std::size_t k) { return k == 0 ? "optimizer" : "optimizer_" + std::to_string(k); }
  std::string optimizer(std::size_t k) const { return optimizer_stem(k) + qualifier() + ".pt"; }
  ShardedModelFiles sharded_model(std::size_t i) const { return {model_stem(i)}; }
  std::string optimizer_shard(std::size_t k, int s) const {
    return optimizer_stem(k) + qualifier() + "_shard_" + std::to_string(s) + ".pt";
  }
};

inline FileNames names_for(const strategy::ModelPart& part) { return {part.count, part.index}; }

// A flag as rank 0 sees it, on every rank.
inline bool main_process_says(comm::Communicator& world, bool flag) {
  if (!world.distributed()) return flag;
  auto value = at::full({1}, flag ? 1.0f : 0.0f);
  world.broadcast(value, 0, "broadcast of rank 0's decision");
  return value.item<float>() != 0.0f;
}

// Every part's bucket sizes, indexed by part (a collective: the parts' ranks
// hold different ones, rank 0 writes them all into the manifest).
inline std::vector<std::vector<std::int64_t>> bucket_numels_by_part(comm::Communicator& world,
                                                                    const strategy::ModelPart& part,
                                                                    const std::vector<std::int64_t>& mine) {
  if (part.count == 1 || !world.distributed()) return {mine};
  std::vector<std::int64_t> row{part.index};  // (part, numels...)
  row.insert(row.end(), mine.begin(), mine.end());
  std::vector<std::vector<std::int64_t>> out(part.count);
  for (const auto& r : comm::all_gather_ragged(world, at::tensor(row, at::TensorOptions().dtype(at::kLong)),
                                               "all-gather of checkpoint bucket sizes")) {
    const auto* values = r.data_ptr<std::int64_t>();
    out.at(values[0]) = std::vector<std::int64_t>(values + 1, values + r.numel());
  }
  return out;
}

// Module::load would `set_` each parameter to the loaded storage; copying
// the values in place keeps every tensor's identity (DDP's gradient hooks
// and the optimizer's state refer to them).
inline void load_in_place(torch::nn::Module& module, torch::serialize::InputArchive& archive, const std::string& prefix) {
  auto copy = [&](at::Tensor& into, const at::Tensor& saved, const std::string& name) {
    copy_saved_tensor(into, saved, prefix + name);
  };
  for (auto& item : module.named_parameters(/*recurse=*/false)) {
    at::Tensor saved;
    archive.read(item.key(), saved);
    copy(item.value(), saved, item.key());
  }
  for (auto& item : module.named_buffers(/*recurse=*/false)) {
    at::Tensor saved;
    archive.read(item.key(), saved, /*is_buffer=*/true);
    copy(item.value(), saved, item.key());
  }
  for (auto& child : module.named_children()) {
    torch::serialize::InputArchive sub;
    archive.read(child.key(), sub);
    load_in_place(*child.value(), sub, prefix + child.key() + ".");
  }
}

// The same from a safetensors file: every tensor of the module must be there.
inline void load_file_in_place(torch::nn::Module& module, const std::filesystem::path& path) {
  const safetensors::File file(path);
  auto load = [&](const std::string& name, at::Tensor& into) {
    const auto* entry = file.find(name);
    if (entry == nullptr) throw CheckpointError("the checkpoint has no tensor '" + name + "'");
    copy_saved_tensor(into, file.tensor(*entry), name);
  };
  for (auto& item : module.named_parameters()) load(item.key(), item.value());
  for (auto& item : module.named_buffers()) load(item.key(), item.value());
}

// NOTE [Resharding optimizer state]
// A ZeRO checkpoint holds one optimizer file per saved shard, each with the
// state of that shard of every bucket. To resume on another number of
// ranks, each rank loads every saved file into the user's optimizer
// (pointed for the moment at stand-in tensors of the saved shard sizes),
// reads each state back through its own serialisation, concatenates the
// per-element tensors of all saved shards, drops the old padding, pads for
// the new number of shards and keeps its own slice; other entries (Adam's
// step) are taken from saved shard 0. Any elementwise torch::optim optimizer works.
inline void reshard_optimizer_state(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& mine,
                                    const strategy::ShardLayout& now, int saved_shards,
                                    const std::function<std::filesystem::path(int)>& shard_file) {
  const auto& numels = now.bucket_numels;  // (checked equal to the saved ones)
  auto& groups = optimizer.param_groups();
  std::vector<std::vector<at::Tensor>> original;
  for (auto& group : groups) original.push_back(group.params());
  auto bucket_of = [&](const at::Tensor& t) {
    for (std::size_t b = 0; b < mine.size(); ++b)
      if (mine[b].is_same(t)) return b;
    throw std::logic_error("accel: optimizer parameter that is no ZeRO shard");
  };
  auto key = [&](const at::Tensor& t) { return compat::optimizer_state_key(optimizer, t); };
  // saved[s][b]: saved shard s's state of bucket b, serialised; proto[b]: a state object of the right type
  std::vector<std::vector<std::string>> saved(saved_shards, std::vector<std::string>(mine.size()));
  std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> proto(mine.size());
  for (int s = 0; s < saved_shards; ++s) {
    std::vector<at::Tensor> stand_in(mine.size());
    for (std::size_t b = 0; b < mine.size(); ++b) {
      const std::int64_t padded = (numels[b] + saved_shards - 1) / saved_shards * saved_shards;
      stand_in[b] = at::zeros({padded / saved_shards}, mine[b].options());
    }
    for (std::size_t g = 0; g < groups.size(); ++g) {
      groups[g].params().clear();
      for (const auto& p : original[g]) groups[g].params().push_back(stand_in[bucket_of(p)]);
    }
    optimizer.state().clear();
    torch::load(optimizer, shard_file(s).string());
    for (std::size_t b = 0; b < mine.size(); ++b) {
      auto it = optimizer.state().find(key(stand_in[b]));
      if (it == optimizer.state().end()) continue;  // never stepped
      torch::serialize::OutputArchive out;
      it->second->serialize(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      saved[s][b] = bytes.str();
      if (s == 0) proto[b] = it->second->clone();
    }
  }
  optimizer.state().clear();
  for (std::size_t g = 0; g < groups.size(); ++g) groups[g].params() = original[g];
  for (std::size_t b = 0; b < mine.size(); ++b) {
    if (!proto[b]) continue;
    std::vector<torch::serialize::InputArchive> shards(saved_shards);
    for (int s = 0; s < saved_shards; ++s) {
      std::istringstream bytes(saved[s][b]);
      shards[s].load_from(bytes);
    }
    const std::int64_t saved_shard = (numels[b] + saved_shards - 1) / saved_shards;
    const std::int64_t shard = mine[b].numel();
    torch::serialize::OutputArchive merged;
    for (const auto& name : shards[0].keys()) {
      c10::IValue first;
      shards[0].read(name, first);
      if (first.isTensor() && first.toTensor().dim() == 1 && first.toTensor().numel() == saved_shard) {
        std::vector<at::Tensor> parts;
        for (int s = 0; s < saved_shards; ++s) {
          c10::IValue part;
          shards[s].read(name, part);
          parts.push_back(part.toTensor());
        }
        // (numels[b],) the whole bucket's state, then (shard,) this rank's slice of it re-padded
        auto full = at::cat(parts).narrow(0, 0, numels[b]);
        auto padded = at::zeros({shard * now.count}, full.options());
        padded.narrow(0, 0, numels[b]).copy_(full);
        merged.write(name, padded.narrow(0, now.rank * shard, shard).clone());
      } else {
        merged.write(name, first);
      }
    }
    std::stringstream bytes;
    merged.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    proto[b]->serialize(in);
    optimizer.state()[key(mine[b])] = std::move(proto[b]);
  }
}

// Per prepared optimizer: its engine's shard layout (none: the state is
// replicated) and every model part's bucket sizes.
struct OptimizerShards {
  std::optional<strategy::ShardLayout> layout;
  std::vector<std::vector<std::int64_t>> numels_by_part;
};

inline nlohmann::json describe(TrainerView& t, const strategy::ModelPart& part,
                               const std::vector<OptimizerShards>& shards, bool model_sharded) {
  nlohmann::json m;
  m["format_version"] = format_version;
  m["world_size"] = t.world.size();
  m["data_world_size"] = t.data_group.size();
  m["model_parts"] = part.count;
  m["model_layout"] = part.layout;
  m["replicated"] = !t.engines.front()->shard_layout().has_value();
  m["model_state_dict"] = model_sharded ? "SHARDED_STATE_DICT" : "FULL_STATE_DICT";
  // The first optimizer's layout and scheduler also at the top level, as a checkpoint of one optimizer has them.
  if (!shards.empty() && shards.front().layout) {
    m["bucket_numels"] = shards.front().numels_by_part.front();
    m["bucket_numels_by_part"] = shards.front().numels_by_part;
    m["shard_count"] = shards.front().layout->count;
  }
  m["scheduler_steps"] = t.optimizers.empty() ? 0 : *t.optimizers.front().scheduler_steps;
  m["has_optimizer"] = !t.optimizers.empty();
  m["optimizers"] = nlohmann::json::array();
  for (std::size_t k = 0; k < t.optimizers.size(); ++k) {
    nlohmann::json o = {{"model", t.optimizers[k].model},
                        {"scheduler_steps", *t.optimizers[k].scheduler_steps},
                        {"replicated", !shards[k].layout.has_value()}};
    if (shards[k].layout) {
      o["bucket_numels_by_part"] = shards[k].numels_by_part;
      o["shard_count"] = shards[k].layout->count;
    }
    m["optimizers"].push_back(std::move(o));
  }
  m["mixed_precision"] = t.precision;
  m["optimizer_steps"] = t.counters.optimizer_steps;
  m["micro_steps"] = t.counters.micro_steps;
  m["loss_scale"] = t.scaler.scale;
  m["growth_tracker"] = t.scaler.growth_tracker;
  m["custom_objects"] = t.custom.size();
  m["models"] = nlohmann::json::array();
  m["model_structure"] = nlohmann::json::array();  // what a LibTorch archive of the model needs besides its tensors
  for (const auto& model : t.models) {
    nlohmann::json shapes = nlohmann::json::object();
    for (const auto& item : model->named_parameters()) shapes[item.key()] = item.value().sizes().vec();
    m["models"].push_back(shapes);
    nlohmann::json structure = {{"modules", nlohmann::json::array()}, {"buffers", nlohmann::json::array()}};
    for (const auto& item : model->named_modules("", /*include_self=*/false)) structure["modules"].push_back(item.key());
    for (const auto& item : model->named_buffers()) structure["buffers"].push_back(item.key());
    m["model_structure"].push_back(structure);
  }
  m["loaders"] = nlohmann::json::array();
  for (const auto& weak : t.loaders) {
    auto position = weak.lock();
    if (!position) continue;
    // An epoch read to its end is saved as the next one's start, so that a
    // resumed loop begins there (and a loader read again each epoch without
    // set_epoch, an evaluation loader, is read whole) instead of skipping a
    // whole epoch's batches.
    const bool finished = position->batches > 0 && position->next_batch >= position->batches;
    m["loaders"].push_back({{"epoch", position->epoch + (finished ? 1 : 0)},
                            {"next_batch", finished ? 0 : position->next_batch},
                            {"batch_size", position->batch_size}});
  }
  return m;
}

// The k-th saved optimizer's record; a checkpoint written before several
// optimizers were kept has the one's at the top level.
inline nlohmann::json saved_optimizer(const nlohmann::json& m, std::size_t k) {
  if (m.contains("optimizers")) return m.at("optimizers").at(k);
  nlohmann::json o = {{"model", 0}, {"scheduler_steps", m.at("scheduler_steps")}, {"replicated", m.at("replicated")}};
  if (m.contains("shard_count")) {
    o["bucket_numels_by_part"] = m.contains("bucket_numels_by_part") ? m.at("bucket_numels_by_part")
                                                                     : nlohmann::json::array({m.at("bucket_numels")});
    o["shard_count"] = m.at("shard_count");
  }
  return o;
}

inline std::size_t saved_optimizer_count(const nlohmann::json& m) {
  if (m.contains("optimizers")) return m.at("optimizers").size();
  return m.value("has_optimizer", false) ? 1 : 0;
}

inline void load_here(TrainerView& t, const std::filesystem::path& dir) {
  const auto m = read_manifest(dir);
  const auto where = "accel: checkpoint " + dir.string() + ": ";
  const auto part = t.engines.front()->model_part(t.world);
  const auto names = names_for(part);
  const int saved_parts = m.value("model_parts", 1);
  const std::string saved_layout = m.value("model_layout", std::string("whole"));
  if (saved_parts != part.count || saved_layout != part.layout)
    throw CheckpointError(where + "holds the model cut as " + saved_layout + " (" + std::to_string(saved_parts) +
                          " part(s)), but this trainer cuts it as " + part.layout + " (" + std::to_string(part.count) +
                          " part(s)): load it with the tensor and pipeline sizes it was saved with");
  if (m.at("models").size() != t.models.size())
    throw CheckpointError(where + "holds " + std::to_string(m.at("models").size()) + " model(s) but " +
                          std::to_string(t.models.size()) + " were prepared");
  for (std::size_t i = 0; part.count == 1 && i < t.models.size(); ++i) {  // a cut model: each part checked on load
    const auto& saved = m.at("models")[i];
    for (const auto& item : t.models[i]->named_parameters()) {
      if (!saved.contains(item.key()))
        throw CheckpointError(where + "model " + std::to_string(i) + " has no parameter '" + item.key() + "'");
      const auto shape = saved.at(item.key()).get<std::vector<std::int64_t>>();
      if (shape != item.value().sizes().vec())
        throw CheckpointError(where + "parameter '" + item.key() + "' has shape " + saved.at(item.key()).dump() +
                              " in the checkpoint but " + c10::str(item.value().sizes()) + " in the prepared model");
    }
  }
  if (m.value("mixed_precision", "") != std::string(t.precision) && std::string(t.precision) == "fp16")
    throw CheckpointError(where + "was written without FP16 loss scaling; this Trainer is FP16");
  const std::size_t saved_optimizers = saved_optimizer_count(m);
  if (!t.optimizers.empty() && saved_optimizers == 0)
    throw CheckpointError(where + "holds no optimizer state, but an optimizer was prepared");
  if (!t.optimizers.empty() && saved_optimizers != t.optimizers.size())
    throw CheckpointError(where + "holds the state of " + std::to_string(saved_optimizers) + " optimizer(s) but " +
                          std::to_string(t.optimizers.size()) + " were prepared");
  for (std::size_t k = 0; k < t.optimizers.size(); ++k)
    if (t.optimizers[k].scheduler != nullptr &&
        *t.optimizers[k].scheduler_steps > saved_optimizer(m, k).at("scheduler_steps").get<std::int64_t>())
      throw CheckpointError(where + "call load_state before training: the scheduler has already stepped");
  // Restoring must not be recorded by autograd, and must write in place
  // (DDP's gradient views and the optimizer refer to these tensors).
  c10::NoGradGuard no_grad;
  for (std::size_t i = 0; i < t.models.size(); ++i) {
    auto& engine = *t.engines[i];
    if (holds_sharded_model(m)) {
      // By parameter name: into this rank's shards if the engine saves sharded
      // too, else into the gathered whole model (NOTE [Sharded checkpoints]).
      const auto files = names.sharded_model(i);
      const auto mine = engine.sharded_parameters();
      try {
        ShardedModelReader reader(dir, files);
        if (mine) {
          load_sharded_into_shards(reader, *mine->module, *mine, *engine.shard_layout());
        } else if (part.count > 1) {
          // A part's shards are named within the module its engine prepared
          // (a pipeline stage's), not within the whole model this rank holds.
          throw CheckpointError(where + "holds each model part's shards (SHARDED_STATE_DICT): load it with a "
                                "Parallel<ZeRO<3>> trainer whose state_dict_type is SHARDED_STATE_DICT");
        } else {
          engine.gather_full_parameters();
          load_sharded_into_module(reader, *t.models[i]);
          engine.release_full_parameters(strategy::FullParameters::loaded);
        }
      } catch (const CheckpointError& e) {
        const std::string what = e.what();
        throw CheckpointError(what.rfind("accel: ", 0) == 0 ? what : where + files.stem + ": " + what);
      }
    } else {
      engine.gather_full_parameters();
      // An accel before safetensors wrote a LibTorch archive: still read.
      const std::string file = model_file_name(dir, names.model_stem(i));
      try {
        if (file.ends_with(".pt")) {
          torch::serialize::InputArchive archive;
          archive.load_from((dir / file).string());
          load_in_place(*t.models[i], archive, "");
        } else {
          load_file_in_place(*t.models[i], dir / file);
        }
      } catch (const std::exception& e) {
        throw CheckpointError(where + file + ": " + e.what());
      }
      engine.release_full_parameters(strategy::FullParameters::loaded);
    }
    engine.parameters_loaded();  // cpu_offload's host twins
  }
  for (std::size_t k = 0; k < t.optimizers.size(); ++k) {
    const auto& o = t.optimizers[k];
    const auto saved = saved_optimizer(m, k);
    // LibTorch's LRScheduler exposes no state: replay its steps (the
    // optimizer's learning rates are then overwritten by the saved ones).
    if (o.scheduler != nullptr)
      for (const auto steps = saved.at("scheduler_steps").get<std::int64_t>(); *o.scheduler_steps < steps;
           ++*o.scheduler_steps)
        o.scheduler->step();
    auto& engine = *t.engines[o.model];
    const auto shards = engine.shard_layout();
    const bool sharded = !saved.at("replicated").get<bool>();
    if (sharded != shards.has_value())
      throw CheckpointError(where + (sharded ? "holds ZeRO-sharded optimizer state; load it with a ZeRO strategy"
                                             : "holds unsharded (DDP) optimizer state; load it with DDP or "
                                               "SingleProcess"));
    if (shards) {
      const auto saved_numels = saved.at("bucket_numels_by_part").at(part.index).get<std::vector<std::int64_t>>();
      if (saved_numels != shards->bucket_numels)
        throw CheckpointError(where + "its ZeRO buckets hold " + nlohmann::json(saved_numels).dump() +
                              " elements, this trainer's a different layout: use the same bucket_cap_mb and model");
      const int saved_shards = saved.at("shard_count").get<int>();
      if (saved_shards == shards->count)
        torch::load(*o.optimizer, (dir / names.optimizer_shard(k, shards->rank)).string());
      else
        reshard_optimizer_state(*o.optimizer, engine.optimizer_parameters(), *shards, saved_shards,
                                [&](int s) { return dir / names.optimizer_shard(k, s); });
    } else {
      torch::load(*o.optimizer, (dir / names.optimizer(k)).string());
    }
  }
  if (m.at("custom_objects").get<std::size_t>() != t.custom.size())
    throw CheckpointError(where + "holds " + m.at("custom_objects").dump() + " registered object(s) but " +
                          std::to_string(t.custom.size()) + " are registered");
  for (std::size_t i = 0; i < t.custom.size(); ++i) {
    torch::serialize::InputArchive archive;
    archive.load_from((dir / ("custom_checkpoint_" + std::to_string(i) + ".pt")).string());
    t.custom[i].load(archive);
  }
  t.scaler = {m.at("loss_scale").get<double>(), m.at("growth_tracker").get<std::int64_t>()};
  // Each rank its own RNG stream; on more ranks than saved, rank r takes r mod saved.
  const int saved_world = m.at("world_size").get<int>();
  {
    std::vector<at::Tensor> rng;
    torch::load(rng, (dir / ("random_states_" + std::to_string(t.world.rank() % saved_world) + ".pt")).string());
    device::restore_random_states(t.device, rng);
  }
  // Data position: in samples read by the data ranks together, so that a
  // run resumed on another number of them skips what the whole job had read.
  const int saved_readers = m.value("data_world_size", saved_world);
  std::size_t k = 0;
  for (const auto& weak : t.loaders) {
    auto position = weak.lock();
    if (!position) continue;
    if (k >= m.at("loaders").size())
      throw CheckpointError(where + "holds the position of " + std::to_string(m.at("loaders").size()) +
                            " data loader(s) but more were prepared");
    const auto& saved = m.at("loaders")[k++];
    const std::int64_t read =
        saved.at("next_batch").get<std::int64_t>() * saved.at("batch_size").get<std::int64_t>() * saved_readers;
    position->epoch = saved.at("epoch").get<std::int64_t>();
    position->skip = read / (position->batch_size * t.data_group.size());
    position->next_batch = position->skip;
  }
  t.counters.optimizer_steps = m.at("optimizer_steps").get<std::int64_t>();
  t.counters.micro_steps = m.at("micro_steps").get<int>();
}

}  // namespace detail

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE void save_state(TrainerView& t, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const bool main = t.world.rank() == 0;
  // Rank 0 decides (another rank could see the directory rank 0 just made).
  const bool replace = detail::main_process_says(t.world, fs::exists(dir));
  const fs::path target = replace ? fs::path(dir.string() + ".staging") : dir;
  if (main) {
    fs::remove_all(target);
    fs::create_directories(target);
  }
  t.world.barrier();
  torch::save(device::random_states(t.device),
              (target / ("random_states_" + std::to_string(t.world.rank()) + ".pt")).string());
  const auto part = t.engines.front()->model_part(t.world);
  const auto names = detail::names_for(part);
  std::vector<detail::OptimizerShards> shards;
  for (std::size_t k = 0; k < t.optimizers.size(); ++k) {
    const auto& o = t.optimizers[k];
    auto layout = t.engines[o.model]->shard_layout();
    if (layout && layout->writer) torch::save(*o.optimizer, (target / names.optimizer_shard(k, layout->rank)).string());
    if (!layout && part.writer) torch::save(*o.optimizer, (target / names.optimizer(k)).string());
    shards.push_back({std::move(layout), {}});
  }
  bool model_sharded = false;
  for (std::size_t i = 0; i < t.models.size(); ++i) {
    auto& engine = *t.engines[i];
    if (const auto sharded = engine.sharded_parameters()) {
      // Each rank its own shards (NOTE [Sharded checkpoints]): the model is never whole.
      model_sharded = true;
      save_sharded_model(target, names.sharded_model(i), *sharded->module, *sharded, *engine.shard_layout());
    } else {
      // ZeRO-3 holds only shards: every rank helps gather the full model first.
      engine.gather_full_parameters();
      if (part.writer)
        safetensors::save_file(target / names.model(i), safetensors::module_tensors(*t.models[i]), {{"format", "pt"}});
      engine.release_full_parameters(strategy::FullParameters::unchanged);
    }
  }
  if (main)
    for (std::size_t i = 0; i < t.custom.size(); ++i) {
      torch::serialize::OutputArchive archive;
      t.custom[i].save(archive);
      archive.save_to((target / ("custom_checkpoint_" + std::to_string(i) + ".pt")).string());
    }
  for (auto& o : shards)  // a collective per sharded optimizer, in the same order on every rank
    if (o.layout) o.numels_by_part = detail::bucket_numels_by_part(t.world, part, o.layout->bucket_numels);
  t.world.barrier();
  if (main) {
    auto manifest = detail::describe(t, part, shards, model_sharded);
    manifest["files"] = file_sizes(target);
    write_atomically(target / manifest_name, manifest.dump(2));
    if (replace) {
      const fs::path old = dir.string() + ".old";
      fs::remove_all(old);
      fs::rename(dir, old);
      fs::rename(target, dir);
      fs::remove_all(old);
    }
  }
  t.world.barrier();
}

ACCEL_COMPILED_ONCE void load_state(TrainerView& t, const std::filesystem::path& dir) {
  std::string error;
  try {
    detail::load_here(t, dir);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (t.world.distributed()) {
    auto failed = at::full({1}, error.empty() ? 0.0f : 1.0f);
    t.world.all_reduce(failed, "agreement on load_state");
    if (error.empty() && failed.item<float>() > 0)
      error = "accel: another rank could not load checkpoint " + dir.string() + " (see its error)";
  }
  if (!error.empty()) throw CheckpointError("rank " + std::to_string(t.world.rank()) + ": " + error);
}

}  // namespace accel::checkpoint

#endif
