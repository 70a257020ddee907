#pragma once
// Sharded model checkpoints: each rank writes the shard of the model it
// holds, never the whole model (FSDP's SHARDED_STATE_DICT).
//
// NOTE [Sharded checkpoints]
// A sharded engine (ZeRO-3, HybridShard) keeps rank r's elements [r*S, (r+1)*S)
// of every flat bucket (NOTE [ZeRO shards]). With state_dict_type
// SHARDED_STATE_DICT a checkpoint holds exactly that, per model part:
//   model_<i>[_part_<p>]_shard_<s>.safetensors   shard s of every bucket
//                                   ("bucket_<b>"), written by the first
//                                   replica holding it
//   model_<i>[_part_<p>]_index.json  per bucket: its size and padding, and
//                                   where each parameter lies in it (name,
//                                   shape, offset); the tensors kept whole
//                                   (buffers, frozen parameters) and their key
//   model_<i>[_part_<p>]_whole.safetensors   those tensors, by name
// (An accel before safetensors wrote the two kinds of files as LibTorch
// archives, _shard_<s>.pt and _whole.pt: still read.)
// Reading goes by parameter name, not by file: a rank asks for the element
// ranges its own buckets need, and every saved shard file that holds some of
// them is read once, one at a time. So a checkpoint loads into another number
// of ranks, another unit plan, or an unsharded strategy (which asks for every
// parameter whole), and no rank ever holds more than its own shard plus one
// saved file (of which, mapped, it reads only the pages it asks for).
// `accel merge-weights` joins the shards offline into one model.safetensors
// (or one LibTorch file, nested as Module::save writes it).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "accel/checkpoint/files.hpp"
#include "accel/checkpoint/safetensors.hpp"
#include "accel/strategy/engine.hpp"

namespace accel::checkpoint {

/// The file names of one model (part) of a sharded checkpoint.
/// The shard and whole files are named without their extension:
/// model_file_name adds it (.safetensors, or an older checkpoint's .pt).
struct ShardedModelFiles {
  std::string stem;  ///< model_<i>[_part_<p>]
  std::string shard(int s) const { return stem + "_shard_" + std::to_string(s); }
  std::string index() const { return stem + "_index.json"; }
  std::string whole() const { return stem + "_whole"; }
};

namespace detail {

inline std::string bucket_key(std::size_t b) { return "bucket_" + std::to_string(b); }

// The tensors of `module` that no bucket holds: buffers and frozen parameters.
inline std::vector<std::pair<std::string, std::pair<at::Tensor, bool>>> kept_whole(
    torch::nn::Module& module, const std::vector<strategy::FlatBucket>& buckets) {
  std::vector<std::string> flat;
  for (const auto& bucket : buckets)
    for (const auto& p : bucket.parameters) flat.push_back(p.name);
  std::sort(flat.begin(), flat.end());
  std::vector<std::pair<std::string, std::pair<at::Tensor, bool>>> out;
  for (const auto& item : module.named_parameters())
    if (!std::binary_search(flat.begin(), flat.end(), item.key())) out.push_back({item.key(), {item.value(), false}});
  for (const auto& item : module.named_buffers()) out.push_back({item.key(), {item.value(), true}});
  return out;
}

}  // namespace detail

/// Writes this rank's part of a sharded model: its shard file when
/// `layout.writer`, and the index and the tensors kept whole when it also
/// holds shard 0 (one rank per model part).
inline void save_sharded_model(const fs::path& dir, const ShardedModelFiles& files, torch::nn::Module& module,
                               const strategy::ShardedParameters& sharded, const strategy::ShardLayout& layout) {
  if (!layout.writer) return;
  std::vector<std::pair<std::string, at::Tensor>> buckets;
  for (std::size_t b = 0; b < sharded.shards.size(); ++b) buckets.emplace_back(detail::bucket_key(b), sharded.shards[b].detach());
  safetensors::save_file(dir / (files.shard(layout.rank) + ".safetensors"), buckets, {{"format", "accel-shard"}});
  if (layout.rank != 0) return;
  nlohmann::json index;
  index["shard_count"] = layout.count;
  index["buckets"] = nlohmann::json::array();
  for (std::size_t b = 0; b < sharded.buckets.size(); ++b) {
    const auto& bucket = sharded.buckets[b];
    nlohmann::json parameters = nlohmann::json::array();
    for (const auto& p : bucket.parameters)
      parameters.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
    index["buckets"].push_back({{"numel", bucket.numel},
                                {"padded", bucket.padded},
                                {"dtype", static_cast<int>(sharded.shards[b].scalar_type())},  // c10::ScalarType's number
                                {"parameters", parameters}});
  }
  index["modules"] = nlohmann::json::array();  // every submodule, for a merged file Module::load reads
  for (const auto& item : module.named_modules("", /*include_self=*/false)) index["modules"].push_back(item.key());
  index["whole"] = nlohmann::json::array();
  std::vector<std::pair<std::string, at::Tensor>> whole;
  for (const auto& [name, tensor] : detail::kept_whole(module, sharded.buckets)) {
    whole.emplace_back(name, tensor.first.detach());
    index["whole"].push_back({{"name", name}, {"key", name}, {"buffer", tensor.second}});
  }
  safetensors::save_file(dir / (files.whole() + ".safetensors"), whole, {{"format", "pt"}});
  write_atomically(dir / files.index(), index.dump(1));
}

/// Reads element ranges of parameters, by name, out of a sharded model's
/// files (NOTE [Sharded checkpoints]).
class ShardedModelReader {
 public:
  ShardedModelReader(fs::path dir, ShardedModelFiles files) : dir_(std::move(dir)), files_(std::move(files)) {
    const auto path = dir_ / files_.index();
    std::ifstream in(path);
    if (!in) throw CheckpointError("accel: checkpoint " + dir_.string() + " has no " + files_.index());
    try {
      index_ = nlohmann::json::parse(in);
      shards_ = index_.at("shard_count").get<int>();
      const auto& buckets = index_.at("buckets");
      for (std::size_t b = 0; b < buckets.size(); ++b) {
        dtypes_.push_back(static_cast<at::ScalarType>(buckets[b].at("dtype").get<int>()));
        const std::int64_t padded = buckets[b].at("padded").get<std::int64_t>();
        for (const auto& p : buckets[b].at("parameters"))
          where_[p.at("name").get<std::string>()] = {b, p.at("offset").get<std::int64_t>(),
                                                     p.at("shape").get<std::vector<std::int64_t>>(), padded / shards_};
      }
    } catch (const CheckpointError&) {
      throw;
    } catch (const std::exception& e) {
      throw CheckpointError("accel: checkpoint " + dir_.string() + ": " + files_.index() + " is not a valid index: " +
                            e.what());
    }
  }

  bool has(const std::string& name) const { return where_.contains(name); }
  std::vector<std::int64_t> shape_of(const std::string& name) const { return where_of(name).shape; }
  /// The element type its bucket was saved in.
  at::ScalarType dtype_of(const std::string& name) const { return dtypes_.at(where_of(name).bucket); }

  /// Asks for elements [begin, end) of parameter `name` (flattened), to be
  /// copied into `into` (a 1-D tensor of end - begin elements) by read().
  void request(const std::string& name, std::int64_t begin, std::int64_t end, at::Tensor into) {
    const auto& w = where_of(name);
    std::int64_t done = 0;
    for (std::int64_t flat = w.offset + begin; flat < w.offset + end;) {
      const int s = static_cast<int>(flat / w.shard);
      const std::int64_t in_shard = flat - s * w.shard;
      const std::int64_t n = std::min(w.shard - in_shard, w.offset + end - flat);
      pieces_.push_back({s, w.bucket, in_shard, into.narrow(0, done, n)});
      done += n;
      flat += n;
    }
  }

  /// Copies every requested range: each saved shard file that holds one is
  /// loaded once, and dropped before the next.
  void read() {
    std::sort(pieces_.begin(), pieces_.end(), [](const Piece& a, const Piece& b) { return a.shard < b.shard; });
    c10::NoGradGuard no_grad;
    for (std::size_t i = 0; i < pieces_.size();) {
      const int s = pieces_[i].shard;
      const SavedTensors saved(dir_, files_.shard(s));
      std::map<std::size_t, at::Tensor> buckets;
      for (; i < pieces_.size() && pieces_[i].shard == s; ++i) {
        auto& piece = pieces_[i];
        auto& bucket = buckets[piece.bucket];
        if (!bucket.defined()) bucket = saved.read(detail::bucket_key(piece.bucket));
        piece.into.copy_(bucket.narrow(0, piece.begin, piece.into.numel()));
      }
    }
    pieces_.clear();
  }

  /// The tensors kept whole, by name, with whether each is a buffer.
  std::vector<std::pair<std::string, std::pair<at::Tensor, bool>>> whole() const {
    const SavedTensors saved(dir_, files_.whole());
    std::vector<std::pair<std::string, std::pair<at::Tensor, bool>>> out;
    for (const auto& item : index_.at("whole")) {
      const bool buffer = item.at("buffer").get<bool>();
      out.push_back({item.at("name").get<std::string>(), {saved.read(item.at("key").get<std::string>(), buffer), buffer}});
    }
    return out;
  }

  /// Every submodule's dotted name.
  std::vector<std::string> module_names() const { return index_.value("modules", std::vector<std::string>{}); }

  /// Every sharded parameter's name, in the index's order.
  std::vector<std::string> parameter_names() const {
    std::vector<std::string> names;
    for (const auto& bucket : index_.at("buckets"))
      for (const auto& p : bucket.at("parameters")) names.push_back(p.at("name").get<std::string>());
    return names;
  }

 private:
  struct Where {
    std::size_t bucket = 0;
    std::int64_t offset = 0;
    std::vector<std::int64_t> shape;
    std::int64_t shard = 0;  // elements per shard of its bucket
  };
  // One saved file's tensors by key: <stem>.safetensors, mapped (only what
  // is read is touched), or an older accel's <stem>.pt.
  class SavedTensors {
   public:
    SavedTensors(const fs::path& dir, const std::string& stem) : name_(model_file_name(dir, stem)) {
      const auto path = dir / name_;
      if (!fs::exists(path)) throw CheckpointError("accel: checkpoint " + dir.string() + " has no " + name_);
      if (name_.ends_with(".pt"))
        archive_.load_from(path.string());
      else
        file_.emplace(path);
    }
    at::Tensor read(const std::string& key, bool buffer = false) const {
      at::Tensor out;
      if (!file_) {
        archive_.read(key, out, buffer);
        return out;
      }
      const auto* entry = file_->find(key);
      if (entry == nullptr) throw CheckpointError("accel: checkpoint file " + name_ + " has no tensor \"" + key + "\"");
      return file_->tensor(*entry);
    }

   private:
    std::string name_;
    std::optional<safetensors::File> file_;
    mutable torch::serialize::InputArchive archive_;
  };
  struct Piece {
    int shard;
    std::size_t bucket;
    std::int64_t begin;  // in the shard
    at::Tensor into;
  };
  const Where& where_of(const std::string& name) const {
    auto it = where_.find(name);
    if (it == where_.end())
      throw CheckpointError("accel: checkpoint " + dir_.string() + ": " + files_.index() + " has no parameter '" +
                            name + "'");
    return it->second;
  }

  fs::path dir_;
  ShardedModelFiles files_;
  nlohmann::json index_;
  int shards_ = 1;
  std::map<std::string, Where> where_;
  std::vector<at::ScalarType> dtypes_;  // per bucket
  std::vector<Piece> pieces_;
};

namespace detail {

inline std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// Every parameter the checkpoint holds sharded must be one `loaded` names:
// a name the model lacks would otherwise be skipped without a word.
inline void require_all_loaded(const ShardedModelReader& reader, std::vector<std::string> loaded) {
  std::sort(loaded.begin(), loaded.end());
  for (const auto& name : reader.parameter_names())
    if (!std::binary_search(loaded.begin(), loaded.end(), name))
      throw CheckpointError("the prepared model has no parameter '" + name +
                            "', which the checkpoint holds (a pipeline stage's shards load with SHARDED_STATE_DICT)");
}

inline void check_shape(const ShardedModelReader& reader, const std::string& name, const std::vector<std::int64_t>& shape) {
  if (reader.shape_of(name) != shape)
    throw CheckpointError("parameter '" + name + "' has shape " + nlohmann::json(reader.shape_of(name)).dump() +
                          " in the checkpoint but " + nlohmann::json(shape).dump() + " in the prepared model");
}

/// `saved` copied into `into` in place (the tensor keeps its identity:
/// hooks and the optimizer refer to it), once its shape is checked.
inline void copy_saved_tensor(at::Tensor& into, const at::Tensor& saved, const std::string& name) {
  if (into.sizes() != saved.sizes())
    throw CheckpointError("tensor '" + name + "' has shape " + c10::str(saved.sizes()) + " in the checkpoint but " +
                          c10::str(into.sizes()) + " in the prepared model");
  into.copy_(saved);
}

}  // namespace detail

/// The buffers and frozen parameters of a sharded model, into `module`.
inline void load_whole_tensors(const ShardedModelReader& reader, torch::nn::Module& module) {
  c10::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> mine;
  for (auto& item : module.named_parameters()) mine[item.key()] = item.value();
  for (auto& item : module.named_buffers()) mine[item.key()] = item.value();
  for (const auto& [name, saved] : reader.whole()) {
    auto it = mine.find(name);
    if (it == mine.end()) throw CheckpointError("the prepared model has no tensor '" + name + "'");
    detail::copy_saved_tensor(it->second, saved.first, name);
  }
}

/// Loads a sharded model into this rank's shards of a sharded engine (the
/// buffers and frozen parameters into `module`), whatever the number of
/// ranks or the bucket plan it was saved with. Host shards are written in
/// place; device shards through one host copy of this rank's shard.
inline void load_sharded_into_shards(ShardedModelReader& reader, torch::nn::Module& module,
                                     const strategy::ShardedParameters& mine, const strategy::ShardLayout& layout) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> targets;
  std::vector<std::string> names;
  for (const auto& bucket : mine.buckets)
    for (const auto& p : bucket.parameters) names.push_back(p.name);
  detail::require_all_loaded(reader, names);
  for (std::size_t b = 0; b < mine.buckets.size(); ++b) {
    const auto& bucket = mine.buckets[b];
    const std::int64_t shard = bucket.padded / layout.count;
    const std::int64_t lo = layout.rank * shard, hi = lo + shard;
    const at::Tensor& own = mine.shards[b];
    targets.push_back(own.is_cpu() ? own : at::empty({shard}, own.options().device(at::kCPU)));
    targets.back().zero_();  // the padding
    for (const auto& p : bucket.parameters) {
      detail::check_shape(reader, p.name, p.shape);
      const std::int64_t begin = std::max(lo, p.offset), end = std::min(hi, p.offset + detail::numel_of(p.shape));
      if (begin < end)
        reader.request(p.name, begin - p.offset, end - p.offset, targets.back().narrow(0, begin - lo, end - begin));
    }
  }
  reader.read();
  for (std::size_t b = 0; b < targets.size(); ++b)
    if (!mine.shards[b].is_cpu()) mine.shards[b].copy_(targets[b]);
  load_whole_tensors(reader, module);
}

/// Loads a sharded model into a module that holds its parameters whole.
inline void load_sharded_into_module(ShardedModelReader& reader, torch::nn::Module& module) {
  c10::NoGradGuard no_grad;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (parameter, host copy)
  std::vector<std::string> names;
  for (auto& item : module.named_parameters()) names.push_back(item.key());
  detail::require_all_loaded(reader, names);
  for (auto& item : module.named_parameters()) {
    if (!reader.has(item.key())) continue;  // kept whole: below
    detail::check_shape(reader, item.key(), item.value().sizes().vec());
    auto host = at::empty({item.value().numel()}, item.value().options().device(at::kCPU));
    reader.request(item.key(), 0, host.numel(), host);
    staged.push_back({item.value(), host});
  }
  reader.read();
  for (auto& [parameter, host] : staged) parameter.copy_(host.view(parameter.sizes()));
  load_whole_tensors(reader, module);
}

/// Tensors by dotted module path, written nested as Module::save writes
/// them, so that torch::load(module, file) reads the result.
class NestedArchive {
  struct Node {
    std::vector<std::tuple<std::string, at::Tensor, bool>> tensors;
    std::map<std::string, std::unique_ptr<Node>> children;
    std::vector<std::string> order;
  };

 public:
  void add(const std::string& dotted, at::Tensor tensor, bool is_buffer) {
    const auto dot = dotted.rfind('.');
    Node& node = dot == std::string::npos ? root_ : module(dotted.substr(0, dot));
    node.tensors.push_back({dot == std::string::npos ? dotted : dotted.substr(dot + 1), std::move(tensor), is_buffer});
  }
  /// A submodule, even one without tensors (Module::load reads every child).
  Node& module(const std::string& dotted) {
    Node* node = &root_;
    std::size_t start = 0;
    while (start <= dotted.size()) {
      auto dot = dotted.find('.', start);
      if (dot == std::string::npos) dot = dotted.size();
      const std::string child = dotted.substr(start, dot - start);
      auto& slot = node->children[child];
      if (!slot) {
        slot = std::make_unique<Node>();
        node->order.push_back(child);
      }
      node = slot.get();
      start = dot + 1;
    }
    return *node;
  }
  void save_to(const fs::path& path) {
    torch::serialize::OutputArchive archive;
    write(root_, archive);
    archive.save_to(path.string());
  }

 private:
  static void write(const Node& node, torch::serialize::OutputArchive& archive) {
    for (const auto& [key, tensor, buffer] : node.tensors) archive.write(key, tensor, buffer);
    for (const auto& name : node.order) {
      torch::serialize::OutputArchive child(archive.compilation_unit());
      write(*node.children.at(name), child);
      archive.write(name, child);
    }
  }
  Node root_;
};

/// A checkpoint's full model, in this process: its tensors by dotted name
/// (whether each is a buffer), and every submodule (Module::load reads each).
struct WholeModel {
  std::vector<std::tuple<std::string, at::Tensor, bool>> tensors;
  std::vector<std::string> modules;
  bool knows_buffers = true;  ///< false: read from a LibTorch archive, which does not tell
};

namespace detail {

// A LibTorch archive of Module::save: tensors, then each child's, by dotted name.
inline void read_archive(torch::serialize::InputArchive& archive, const std::string& prefix, WholeModel& out) {
  for (const auto& key : archive.keys()) {
    at::Tensor tensor;
    if (archive.try_read(key, tensor)) {
      out.tensors.push_back({prefix + key, tensor, false});
      continue;
    }
    torch::serialize::InputArchive child;
    if (archive.try_read(key, child)) {
      out.modules.push_back(prefix + key);
      read_archive(child, prefix + key + ".", out);
    }
  }
}

}  // namespace detail

/// The shards of a sharded model joined (NOTE [Sharded checkpoints]), the saved dtypes kept.
inline WholeModel join_sharded_model(const fs::path& dir, const ShardedModelFiles& files) {
  ShardedModelReader reader(dir, files);
  WholeModel out;
  out.modules = reader.module_names();
  for (const auto& name : reader.parameter_names()) {
    const auto shape = reader.shape_of(name);
    auto full = at::empty({detail::numel_of(shape)}, at::TensorOptions().dtype(reader.dtype_of(name)));
    reader.request(name, 0, full.numel(), full);
    out.tensors.push_back({name, full.view(shape), false});
  }
  reader.read();
  for (const auto& [name, saved] : reader.whole()) out.tensors.push_back({name, saved.first, saved.second});
  return out;
}

/// Model `model_index` of a checkpoint, whole, in this process: its shards
/// joined, or its file read (model_<i>.safetensors, whose modules and buffers
/// the manifest lists; or an older accel's model_<i>.pt).
inline WholeModel read_whole_model(const fs::path& dir, int model_index) {
  const auto manifest = manifest_of_whole_model(dir, model_index);
  if (holds_sharded_model(manifest)) return join_sharded_model(dir, {model_stem(model_index)});
  const std::string file = model_file_name(dir, model_stem(model_index));
  WholeModel out;
  if (file.ends_with(".pt")) {
    torch::serialize::InputArchive archive;
    archive.load_from((dir / file).string());
    detail::read_archive(archive, "", out);
    out.knows_buffers = false;
    return out;
  }
  const auto structure = manifest.value("model_structure", nlohmann::json::array());
  std::set<std::string> buffers;
  if (static_cast<std::size_t>(model_index) < structure.size()) {
    out.modules = structure[model_index].at("modules").get<std::vector<std::string>>();
    buffers = structure[model_index].at("buffers").get<std::set<std::string>>();
  } else {
    out.knows_buffers = false;
  }
  for (auto& [name, tensor] : safetensors::load_file(dir / file)) {
    out.tensors.push_back({name, tensor, buffers.contains(name)});
  }
  return out;
}

/// A checkpoint's full model written as `accel merge-weights` writes it, in
/// this process (the whole model in memory, the saved dtypes kept): as
/// `out`/model.safetensors (Accelerate's default), or with
/// `safe_serialization` false as one LibTorch file `out`, nested as
/// Module::save writes it, which torch::load reads into the unsharded model.
/// A model already in that format is copied (export_model).
inline void consolidate_model(const fs::path& dir, const fs::path& out, int model_index = 0,
                              bool safe_serialization = true) {
  if (export_is_a_copy(dir, model_index, safe_serialization))
    return export_model(dir, out, model_index, safe_serialization);
  const WholeModel whole = read_whole_model(dir, model_index);
  if (safe_serialization) {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& [name, tensor, buffer] : whole.tensors) tensors.push_back({name, tensor});
    fs::create_directories(out);
    safetensors::save_file(out / "model.safetensors", tensors, {{"format", "pt"}});
    return;
  }
  if (!whole.knows_buffers)
    throw CheckpointError("accel: checkpoint " + dir.string() + "'s manifest does not list the model's buffers, which "
                          "a LibTorch archive needs: write safetensors instead (without --unsafe_serialization)");
  NestedArchive merged;
  for (const auto& name : whole.modules) merged.module(name);
  for (const auto& [name, tensor, buffer] : whole.tensors) merged.add(name, tensor, buffer);
  const fs::path temp = out.string() + ".tmp";
  merged.save_to(temp);
  fs::rename(temp, out);
}

}  // namespace accel::checkpoint
