#pragma once
// The file layer of a checkpoint directory (torch-free):
//
// NOTE [Checkpoint commit]
// Every rank writes its own files into the checkpoint directory; after a
// barrier, rank 0 writes `manifest.json` (its size and the size of every
// file, the world size, the step, ...) to a temporary name and renames it
// into place. The rename is the commit: a directory without a manifest is an
// interrupted save, and load_state refuses it. Saving over an existing
// checkpoint goes through a staging directory that replaces the old one only
// once complete, so a crash never destroys the last good checkpoint.

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "accel/core/compiled_once.hpp"
#include "accel/core/json.hpp"

namespace accel::checkpoint {

namespace fs = std::filesystem;

/// A checkpoint that is missing, incomplete, corrupt or does not fit.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr const char* manifest_name = "manifest.json";
inline constexpr int format_version = 1;

/// Writes `text` to `path` atomically: temp file, flush, rename.
ACCEL_COMPILED_ONCE void write_atomically(const fs::path& path, const std::string& text);

/// The manifest of a complete checkpoint, checked against the files present.
ACCEL_COMPILED_ONCE nlohmann::json read_manifest(const fs::path& dir);

/// Sizes of the files in `dir` (all but the manifest), for the manifest.
ACCEL_COMPILED_ONCE nlohmann::json file_sizes(const fs::path& dir);

/// Whether a checkpoint holds its model as shards (NOTE [Sharded checkpoints]
/// in checkpoint/sharded.hpp), which only a program linking LibTorch joins.
ACCEL_COMPILED_ONCE bool holds_sharded_model(const nlohmann::json& manifest);

/// The manifest of a checkpoint whose model `model_index` can be written as
/// one file: not cut into parts by tensor or pipeline parallelism, and there.
ACCEL_COMPILED_ONCE nlohmann::json manifest_of_whole_model(const fs::path& dir, int model_index);

/// The name of a model's file in a checkpoint, `stem` (model_<i>, or
/// model_<i>_part_<p> for a part): <stem>.safetensors, or <stem>.pt where an
/// older accel wrote it as a LibTorch archive.
ACCEL_COMPILED_ONCE std::string model_file_name(const fs::path& dir, const std::string& stem);
inline std::string model_stem(int model_index) { return "model_" + std::to_string(model_index); }

/// Whether exporting model `model_index` is a copy of its file: the model is
/// whole (not sharded) and already in the format asked for (safetensors, or
/// with `safe_serialization` false a LibTorch archive). Otherwise only a
/// program linking LibTorch writes it (consolidate_model, accel merge-weights).
ACCEL_COMPILED_ONCE bool export_is_a_copy(const fs::path& dir, int model_index, bool safe_serialization);

/// Consolidation for export, where it is a copy (export_is_a_copy): the
/// full model of a checkpoint, checked (complete, not cut into parts), as
/// Accelerate's merge-weights writes it: `out`/model.safetensors, or with
/// `safe_serialization` false one LibTorch file `out`, loadable with
/// torch::load into the unsharded model. The optimizer state stays in the
/// checkpoint.
///   accel export checkpoints/checkpoint_7 exported/
/// Else consolidate_model (<accel/checkpoint/sharded.hpp>) joins the shards
/// or converts the file.
ACCEL_COMPILED_ONCE void export_model(const fs::path& dir, const fs::path& out, int model_index = 0,
                                      bool safe_serialization = true);

/// `checkpoint_<n>` folders under `root`, oldest first.
ACCEL_COMPILED_ONCE std::vector<std::pair<long, fs::path>> numbered_checkpoints(const fs::path& root);

/// The newest checkpoint_<n> under `root` whose save completed (its manifest
/// there, every file of the size it names); nothing when there is none.
ACCEL_COMPILED_ONCE std::optional<std::pair<long, fs::path>> newest_complete_checkpoint(const fs::path& root);

}  // namespace accel::checkpoint

#if ACCEL_DEFINE_COMPILED_ONCE
#include <algorithm>
#include <fstream>
#include <regex>
#include <system_error>

namespace accel::checkpoint {

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE void write_atomically(const fs::path& path, const std::string& text) {
  const fs::path temp = path.string() + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw CheckpointError("accel: could not write " + temp.string());
  }
  fs::rename(temp, path);
}

ACCEL_COMPILED_ONCE nlohmann::json read_manifest(const fs::path& dir) {
  if (!fs::is_directory(dir)) throw CheckpointError("accel: checkpoint " + dir.string() + " does not exist");
  const fs::path manifest = dir / manifest_name;
  if (!fs::exists(manifest))
    throw CheckpointError("accel: checkpoint " + dir.string() +
                          " is incomplete: it has no manifest.json (the save was interrupted); load an earlier "
                          "checkpoint");
  nlohmann::json m;
  try {
    std::ifstream in(manifest);
    m = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw CheckpointError("accel: checkpoint " + dir.string() + ": manifest.json is not valid JSON: " + e.what());
  }
  if (m.value("format_version", 0) != format_version)
    throw CheckpointError("accel: checkpoint " + dir.string() + " has format version " +
                          std::to_string(m.value("format_version", 0)) + "; this accel reads version " +
                          std::to_string(format_version));
  for (const auto& [name, size] : m.at("files").items()) {
    const fs::path file = dir / name;
    std::error_code ec;
    const auto actual = fs::file_size(file, ec);
    if (ec)
      throw CheckpointError("accel: checkpoint " + dir.string() + " is corrupt: " + name + " is missing");
    if (actual != size.get<std::uintmax_t>())
      throw CheckpointError("accel: checkpoint " + dir.string() + " is corrupt: " + name + " has " +
                            std::to_string(actual) + " bytes, the manifest says " +
                            std::to_string(size.get<std::uintmax_t>()));
  }
  return m;
}

ACCEL_COMPILED_ONCE nlohmann::json file_sizes(const fs::path& dir) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_regular_file() && entry.path().filename() != manifest_name &&
        entry.path().extension() != ".tmp")
      files[entry.path().filename().string()] = entry.file_size();
  return files;
}

ACCEL_COMPILED_ONCE bool holds_sharded_model(const nlohmann::json& manifest) {
  return manifest.value("model_state_dict", std::string("FULL_STATE_DICT")) == "SHARDED_STATE_DICT";
}

ACCEL_COMPILED_ONCE nlohmann::json manifest_of_whole_model(const fs::path& dir, int model_index) {
  auto manifest = read_manifest(dir);
  const int parts = manifest.value("model_parts", 1);
  if (parts != 1)
    throw CheckpointError("accel: checkpoint " + dir.string() + " holds the model cut into " + std::to_string(parts) +
                          " parts (" + manifest.value("model_layout", std::string("?")) +
                          "): there is no whole model to write; each part is saved on its own (model_<i>_part_<p>...)");
  const auto models = manifest.at("models").size();
  if (model_index < 0 || static_cast<std::size_t>(model_index) >= models)
    throw CheckpointError("accel: checkpoint " + dir.string() + " holds " + std::to_string(models) +
                          " model(s); there is no model " + std::to_string(model_index));
  return manifest;
}

ACCEL_COMPILED_ONCE std::string model_file_name(const fs::path& dir, const std::string& stem) {
  return fs::exists(dir / (stem + ".pt")) && !fs::exists(dir / (stem + ".safetensors")) ? stem + ".pt"
                                                                                          : stem + ".safetensors";
}

ACCEL_COMPILED_ONCE bool export_is_a_copy(const fs::path& dir, int model_index, bool safe_serialization) {
  if (holds_sharded_model(manifest_of_whole_model(dir, model_index))) return false;
  return (model_file_name(dir, model_stem(model_index)).ends_with(".safetensors")) == safe_serialization;
}

ACCEL_COMPILED_ONCE void export_model(const fs::path& dir, const fs::path& out, int model_index,
                                      bool safe_serialization) {
  const auto manifest = manifest_of_whole_model(dir, model_index);
  if (holds_sharded_model(manifest))
    throw CheckpointError("accel: checkpoint " + dir.string() +
                          " holds its model as shards (SHARDED_STATE_DICT): join them with "
                          "accel::checkpoint::consolidate_model (<accel/checkpoint/sharded.hpp>) or `accel merge-weights`");
  const std::string file = model_file_name(dir, model_stem(model_index));
  if (file.ends_with(".safetensors") != safe_serialization)
    throw CheckpointError("accel: checkpoint " + dir.string() + " holds " + file + "; writing it as " +
                          (safe_serialization ? "safetensors" : "a LibTorch archive") +
                          " converts it, which needs LibTorch: accel::checkpoint::consolidate_model "
                          "(<accel/checkpoint/sharded.hpp>) or `accel merge-weights`");
  fs::path target = out;
  if (safe_serialization) {
    fs::create_directories(out);
    target = out / "model.safetensors";
  }
  const fs::path temp = target.string() + ".tmp";
  fs::copy_file(dir / file, temp, fs::copy_options::overwrite_existing);
  fs::rename(temp, target);
}

ACCEL_COMPILED_ONCE std::vector<std::pair<long, fs::path>> numbered_checkpoints(const fs::path& root) {
  std::vector<std::pair<long, fs::path>> found;
  if (!fs::is_directory(root)) return found;
  static const std::regex pattern("checkpoint_([0-9]+)");
  for (const auto& entry : fs::directory_iterator(root)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, match, pattern)) found.emplace_back(std::stol(match[1]), entry.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

ACCEL_COMPILED_ONCE std::optional<std::pair<long, fs::path>> newest_complete_checkpoint(const fs::path& root) {
  const auto all = numbered_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      (void)read_manifest(it->second);
      return *it;
    } catch (const CheckpointError&) {
      // interrupted: an older one
    }
  }
  return std::nullopt;
}

}  // namespace accel::checkpoint

#endif
