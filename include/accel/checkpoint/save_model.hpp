#pragma once
// trainer.save_model and trainer.load_safetensors: a prepared model written
// as safetensors by every rank at once, and loaded by every rank into what it
// holds (NOTE [safetensors]).
//
// NOTE [Writing a model from its shards]
// Every rank knows every tensor's name, dtype and whole shape (a sharded
// engine's plan holds them; a tensor-parallel layer says how its slices are
// cut, nn::ParameterCut), so every rank computes the same layout of the
// files; they check that they agree. Rank 0 creates the files, header
// written and sized in full; then each rank writes, at their offsets, the
// bytes it holds and no other rank writes: under ZeRO-3 and HybridShard (one
// replica group) its flat shard of each bucket, a contiguous run of each
// parameter it touches; under tensor parallelism its slice of each split
// parameter, a run per block and row of the cut (the replicated tensors from
// tensor rank 0); the tensors every data rank holds alike, from the first.
// No rank holds the whole model. The ranks then sum the bytes each wrote per
// tensor; only if every tensor is covered exactly does rank 0 rename the
// files into place and write the index. A tensor whose layout the options
// transform (a transpose) is first assembled alone from the same pieces, one
// tensor at a time. Loading is the reverse: each rank copies into what it
// holds the runs it holds, from the mapped files (only those pages are
// read). Files lie on a filesystem every rank sees (as save_state's do).

#include <torch/nn/module.h>

#include <filesystem>

#include "accel/checkpoint/safetensors.hpp"
#include "accel/checkpoint/state.hpp"
#include "accel/comm/communicator.hpp"
#include "accel/core/compiled_once.hpp"

namespace accel::checkpoint {

/// Every rank calls it, with the model's engine (NOTE [Writing a model from its shards]).
ACCEL_COMPILED_ONCE void save_model(comm::Communicator& world, EngineHooks& engine, torch::nn::Module& module,
                                    const std::filesystem::path& dir, const SaveModelOptions& options);

/// Every rank calls it: each fills what it holds (under ZeRO-3 and
/// HybridShard its shard, under tensor parallelism its slices, reading only
/// those bytes of the files); all of them load, or all throw.
ACCEL_COMPILED_ONCE LoadReport load_model(comm::Communicator& world, EngineHooks& engine, torch::nn::Module& module,
                                          const std::filesystem::path& path, const LoadOptions& options);

}  // namespace accel::checkpoint

#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <functional>
#include <map>
#include <optional>
#include <unordered_map>

#include "accel/nn/tensor_parallel_layer.hpp"

namespace accel::checkpoint {

namespace detail {

// Elements [local, local + count) of this rank's tensor are the whole
// tensor's [whole, whole + count) (flat, row-major).
struct Run {
  std::int64_t local = 0, whole = 0, count = 0;
};

inline std::int64_t product(const std::vector<std::int64_t>& shape, std::size_t begin, std::size_t end) {
  std::int64_t n = 1;
  for (std::size_t i = begin; i < end; ++i) n *= shape[i];
  return n;
}

// The runs of a tensor-parallel slice of shape `local` (nn::ParameterCut):
// per index before the cut dimension and per block, one run.
inline std::vector<Run> runs_of(const nn::ParameterCut& cut, const std::vector<std::int64_t>& local) {
  const auto dim = static_cast<std::size_t>(cut.dim);
  const std::int64_t outer = product(local, 0, dim), inner = product(local, dim + 1, local.size());
  const std::int64_t here = local[dim], rows = here / cut.stride, block = rows * cut.parts, whole = block * cut.stride;
  std::vector<Run> out;
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t b = 0; b < cut.stride; ++b) {
      const Run run{(o * here + b * rows) * inner, (o * whole + b * block + cut.index * rows) * inner, rows * inner};
      if (!out.empty() && out.back().local + out.back().count == run.local &&
          out.back().whole + out.back().count == run.whole)
        out.back().count += run.count;  // dimension 0 with one block: one run
      else
        out.push_back(run);
    }
  return out;
}

// One tensor of the model as this rank holds it.
struct HeldTensor {
  std::string name;  // the module's
  std::vector<std::int64_t> whole_shape;
  at::ScalarType dtype = at::kFloat;
  at::Tensor held;              // what this rank holds of it, flat: a view of the engine's or the module's tensor
  std::int64_t first = 0;       // held's first element within this rank's tensor
  std::vector<Run> runs;        // this rank's tensor within the whole one
  bool writer = false;          // whether this rank writes what it holds (one rank per element)

  // What this rank holds, as pieces of the whole tensor.
  template <class Each>
  void each_piece(Each&& each) const {
    if (!held.defined()) return;
    for (const auto& run : runs) {
      const std::int64_t lo = std::max(run.local, first), hi = std::min(run.local + run.count, first + held.numel());
      if (lo < hi) each(run.whole + (lo - run.local), held.slice(0, lo - first, hi - first));
    }
  }
};

// Every tensor of the model as this rank holds it, in the module's order.
// Under a pipeline every rank describes every tensor (the files' layout is
// the whole model's) but holds only its stage's: the stage's tensors are the
// model's own (the same layer objects), found by identity, and the sharded
// engine's plan names them as the stage does.
inline std::vector<HeldTensor> held_tensors(comm::Communicator& world, EngineHooks& engine, torch::nn::Module& module) {
  const auto part = engine.model_part(world);
  std::map<std::string, nn::ParameterCut> cuts;
  for (const auto& item : module.named_modules()) {
    const auto* layer = dynamic_cast<const nn::TensorParallelLayer*>(item.value().get());
    if (layer == nullptr) continue;
    const auto said = layer->cuts();
    if (said.size() != layer->split_parameters().size())
      throw std::logic_error("the tensor-parallel layer " +
                             (item.key().empty() ? std::string("(the model)") : item.key()) +
                             " does not say how its parameters are cut (nn::TensorParallelLayer::cuts)");
    for (const auto& cut : said) cuts[item.key().empty() ? cut.name : item.key() + "." + cut.name] = cut;
  }
  std::unordered_map<const void*, std::string> in_stage;  // this rank's stage's tensors, by their stage names
  if (part.stage != nullptr)
    for (const auto& [name, tensor] : safetensors::module_tensors(*part.stage)) in_stage[tensor.unsafeGetTensorImpl()] = name;
  const auto sharded = engine.held_shards();
  const auto layout = engine.shard_layout();
  std::map<std::string, std::pair<std::size_t, const strategy::FlatParameter*>> flat;
  if (sharded)
    for (std::size_t b = 0; b < sharded->buckets.size(); ++b)
      for (const auto& p : sharded->buckets[b].parameters) flat[p.name] = {b, &p};
  std::vector<HeldTensor> out;
  for (const auto& [name, tensor] : safetensors::module_tensors(module)) {
    HeldTensor h;
    h.name = name;
    std::string engine_name = name;  // the name the engine's plan knows it by
    bool held_here = true;
    if (part.stage != nullptr) {
      const auto found = in_stage.find(tensor.unsafeGetTensorImpl());
      held_here = found != in_stage.end();
      if (held_here) engine_name = found->second;
    }
    const auto in_bucket = held_here ? flat.find(engine_name) : flat.end();
    const std::vector<std::int64_t> local =
        in_bucket == flat.end() ? tensor.sizes().vec() : in_bucket->second.second->shape;
    const std::int64_t numel = product(local, 0, local.size());
    h.whole_shape = local;
    h.runs = {{0, 0, numel}};
    const auto cut = cuts.find(name);
    if (cut != cuts.end()) {
      h.whole_shape[static_cast<std::size_t>(cut->second.dim)] *= cut->second.parts;
      h.runs = runs_of(cut->second, local);
    }
    // A tensor replicated over the tensor ranks is written from the first.
    const bool among_writers = held_here && (cut != cuts.end() || part.tensor_index() == 0);
    if (in_bucket == flat.end()) {
      h.dtype = tensor.scalar_type();
      if (held_here) {
        if (!tensor.is_contiguous()) throw std::logic_error("\"" + name + "\" is not contiguous");
        h.held = tensor.detach().view({-1});
      }
      h.writer = among_writers && part.writer;  // the data replicas hold it alike: the first writes
    } else {
      // This rank holds the bucket's elements [first, first + shard size).
      const auto& [b, p] = in_bucket->second;
      const at::Tensor shard = sharded->shards[b].detach().view({-1});
      h.dtype = shard.scalar_type();
      const std::int64_t first = static_cast<std::int64_t>(layout->rank) * shard.numel();
      const std::int64_t begin = std::max(first, p->offset), end = std::min(first + shard.numel(), p->offset + numel);
      if (begin < end) {
        h.held = shard.slice(0, begin - first, end - first);
        h.first = begin - p->offset;
      }
      h.writer = among_writers && layout->writer;
    }
    out.push_back(std::move(h));
  }
  return out;
}

// Every rank learns whether any failed; each throws, naming its own error or another rank's.
inline void agree(comm::Communicator& world, const std::string& error, const std::string& what, const std::string& step) {
  const std::string me = "accel: " + what + " on rank " + std::to_string(world.rank()) + ": ";
  at::Tensor failed = at::tensor({error.empty() ? 0.0f : 1.0f});
  world.all_reduce(failed, what + ": " + step);
  if (!error.empty()) throw CheckpointError(me + error);
  if (failed.item<float>() > 0) throw CheckpointError(me + "another rank failed to " + step + " (see its error)");
}

// Whether the options' transform changes the layout of `name` (it returns
// its argument itself where it does not), asked of a meta tensor.
inline bool transformed(const SaveModelOptions& options, const HeldTensor& h) {
  if (!options.transform) return false;
  const at::Tensor probe = at::empty(h.whole_shape, at::TensorOptions().dtype(h.dtype).device(at::kMeta));
  return options.transform(h.name, probe).unsafeGetTensorImpl() != probe.unsafeGetTensorImpl();
}

}  // namespace detail

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE void save_model(comm::Communicator& world, EngineHooks& engine, torch::nn::Module& module,
                                    const std::filesystem::path& dir, const SaveModelOptions& options) {
  std::string error;
  auto agree = [&](const std::string& step) { detail::agree(world, error, "save_model", step); };
  const auto part = engine.model_part(world);
  if (!options.safe_serialization) {
    if (part.count > 1)
      throw std::logic_error("accel: save_model: a model cut into parts (" + part.layout +
                             ") is written as safetensors only (safe_serialization = true)");
    // The LibTorch archive is one object: the model gathered whole, as save_state's FULL_STATE_DICT.
    engine.gather_full_parameters();
    try {
      if (part.writer) accel::save_model(module, dir, options);
    } catch (const std::exception& e) {
      error = e.what();
    }
    engine.release_full_parameters(strategy::FullParameters::unchanged);
    agree("write model.pt");
    return;
  }
  std::vector<detail::HeldTensor> held;
  std::vector<safetensors::Described> described;
  std::vector<safetensors::Piece> pieces;
  try {
    held = detail::held_tensors(world, engine, module);
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree("describe the model");
  // Every rank, in the module's order: a tensor the transform lays out anew
  // is assembled (its writers' pieces, zeros elsewhere, summed), then
  // transformed and written whole by rank 0.
  for (const auto& h : held) {
    const std::string file = options.name_map ? options.name_map(h.name) : h.name;
    if (file.empty()) continue;
    if (detail::transformed(options, h)) {
      at::Tensor whole = at::zeros({detail::product(h.whole_shape, 0, h.whole_shape.size())},
                                   h.held.defined() ? h.held.options() : at::TensorOptions().dtype(h.dtype));
      if (h.writer)
        h.each_piece([&](std::int64_t at, const at::Tensor& values) { whole.slice(0, at, at + values.numel()).copy_(values); });
      world.all_reduce(whole, "save_model: assembling " + h.name + " to transform it");
      const at::Tensor saved = options.transform(h.name, whole.view(h.whole_shape));
      described.push_back({file, safetensors::dtype_of(saved.scalar_type(), file), saved.sizes().vec()});
      if (world.rank() == 0) pieces.push_back({file, 0, saved});
      continue;
    }
    described.push_back({file, safetensors::dtype_of(h.dtype, file), h.whole_shape});
    if (h.writer)
      h.each_piece([&](std::int64_t at, const at::Tensor& values) { pieces.push_back({file, at, values}); });
  }
  const auto plan = safetensors::plan_files(described, options.max_shard_size, options.metadata);
  std::string headers;
  for (const auto& f : plan.files) headers += f.name + f.header;
  const auto hash = static_cast<std::int64_t>(std::hash<std::string>{}(headers) >> 2);
  at::Tensor bounds = at::tensor({hash, -hash});
  world.all_reduce_max(bounds, "save_model: the files' layout");
  if (bounds[0].item<std::int64_t>() != -bounds[1].item<std::int64_t>())
    error = "the ranks laid out different files (their models' names, shapes or dtypes differ)";
  if (error.empty() && world.rank() == 0) try {
      safetensors::create_files(dir, plan);
    } catch (const std::exception& e) {
      error = e.what();
    }
  agree("create the files");
  std::vector<std::int64_t> written(plan.where.size(), 0);
  try {
    written = safetensors::write_pieces(dir, plan, pieces);
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree("write its part");
  at::Tensor total = at::tensor(written);
  world.all_reduce(total, "save_model: the bytes each rank wrote");
  if (world.rank() == 0) try {
      safetensors::commit_files(dir, plan, std::vector<std::int64_t>(total.data_ptr<std::int64_t>(),
                                                                       total.data_ptr<std::int64_t>() + total.numel()));
    } catch (const std::exception& e) {
      error = e.what();
    }
  agree("put the files in place");
}

ACCEL_COMPILED_ONCE LoadReport load_model(comm::Communicator& world, EngineHooks& engine, torch::nn::Module& module,
                                          const std::filesystem::path& path, const LoadOptions& options) {
  std::string error;
  std::vector<detail::HeldTensor> held;
  std::optional<safetensors::Matched> matched;
  try {
    held = detail::held_tensors(world, engine, module);
    std::map<std::string, std::vector<std::int64_t>> targets;
    for (const auto& h : held) targets[h.name] = h.whole_shape;
    matched.emplace(safetensors::match(path, targets, options));
  } catch (const std::exception& e) {
    error = e.what();
  }
  detail::agree(world, error, "load_safetensors", "match the files to the model");
  {
    c10::NoGradGuard no_grad;
    for (const auto& h : held) {
      if (!matched->found.count(h.name) || !h.held.defined()) continue;
      // Only the runs this rank holds are read: the file is mapped, and only their pages are touched.
      const at::Tensor whole = matched->tensor(h.name, options).reshape({-1});
      h.each_piece([&](std::int64_t at, const at::Tensor& into) {
        at::Tensor target = into;
        target.copy_(whole.slice(0, at, at + into.numel()));
      });
    }
  }
  LoadReport report = matched->report;
  report.loaded = matched->found.size();
  engine.parameters_loaded();
  return report;
}

}  // namespace accel::checkpoint

#endif
