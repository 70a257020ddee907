#pragma once
// safetensors with LibTorch (NOTE [safetensors]): files mapped, not copied,
// into tensors; a module's weights saved as Hugging Face lays them out
// (one file, or files plus an index) and loaded back by name.
//
//   accel::save_model(model, "out");                 // out/model.safetensors
//   accel::save_model(model, "out", {.max_shard_size = 2'000'000'000});
//   auto report = accel::load_safetensors(model, "out", {.strict = false});
//
// Under a Trainer, trainer.save_model(model, dir) writes the same files from
// every rank at once (checkpoint/save_model.hpp): each rank writes the bytes
// it holds into the files rank 0 laid out, so a sharded model is never whole
// on any rank.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "accel/checkpoint/safetensors_format.hpp"
#include "accel/core/compiled_once.hpp"

static_assert(std::endian::native == std::endian::little,
              "accel: safetensors stores little-endian bytes, which this code copies as they are");

namespace accel {

/// Accelerate's save_model arguments.
struct SaveModelOptions {
  /// Largest file in bytes (Accelerate's default "10GB", decimal); a model
  /// larger than this is cut into model-0000k-of-0000n.safetensors plus
  /// model.safetensors.index.json.
  std::uint64_t max_shard_size = 10'000'000'000;
  /// false: one LibTorch archive, model.pt (Module::save's format), as
  /// Accelerate's unsafe serialization keeps pickle; never cut into files.
  bool safe_serialization = true;
  /// Written into each file's __metadata__ ({"format": "pt"} is always there,
  /// as transformers expects).
  std::map<std::string, std::string> metadata = {};
  /// The files' name for each of the module's names; an empty result leaves
  /// that tensor out. Default: the module's names.
  std::function<std::string(const std::string&)> name_map = {};
  /// The module's tensor (given its module name) in the files' layout, e.g.
  /// a Linear's [out, in] weight as transformers' Conv1D [in, out]. Default:
  /// as the module holds it.
  std::function<at::Tensor(const std::string&, const at::Tensor&)> transform = {};
};

/// How load_safetensors matches the files' names to the module's.
struct LoadOptions {
  /// Every name of the module must be in the files and every name in the
  /// files in the module; else the load throws, listing them, and changes
  /// nothing. false: both lists are returned.
  bool strict = true;
  /// Maps a name in the files to the module's name for it; an empty result
  /// skips that tensor (it is neither loaded nor unexpected). Default: same.
  std::function<std::string(const std::string&)> name_map = {};
  /// A file's tensor in the module's layout, given the module's name (the
  /// inverse of SaveModelOptions::transform); a view where it can be.
  std::function<at::Tensor(const std::string&, const at::Tensor&)> transform = {};
};

/// What a non-strict load did not match.
struct LoadReport {
  std::vector<std::string> missing;     ///< the module's names that no file held
  std::vector<std::string> unexpected;  ///< the files' names (after name_map) the module lacks
  std::size_t loaded = 0;
};

namespace safetensors {

ACCEL_COMPILED_ONCE c10::ScalarType scalar_type(Dtype dtype);
/// Throws for a LibTorch type safetensors cannot hold here (complex, quantized).
ACCEL_COMPILED_ONCE Dtype dtype_of(c10::ScalarType type, const std::string& name);

/// A safetensors file mapped into memory, read only where a tensor is used:
/// a rank that copies out its rows reads only their pages.
class File {
 public:
  explicit File(const std::filesystem::path& path);
  const Header& header() const { return header_; }
  const std::filesystem::path& path() const { return path_; }
  /// nullptr when the file has no such tensor.
  const Entry* find(const std::string& name) const;
  /// The tensor over the mapping (CPU); the mapping lives as long as it.
  /// Writing to it changes a private copy, never the file.
  at::Tensor tensor(const Entry& entry) const;

 private:
  struct Mapping;
  std::filesystem::path path_;
  std::shared_ptr<Mapping> mapping_;
  Header header_;
  std::map<std::string, std::size_t> by_name_;  // header_.entries' positions
};

/// Writes the tensors, in order, to one file (atomically: a temporary file
/// renamed into place).
ACCEL_COMPILED_ONCE void save_file(const std::filesystem::path& path,
                                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                   std::map<std::string, std::string> metadata = {});

/// Every tensor of one file (views of its mapping), by name.
ACCEL_COMPILED_ONCE std::map<std::string, at::Tensor> load_file(const std::filesystem::path& path);

// ---- the pieces of a model's files, shared with the Trainer's save_model

/// Where every tensor of a model goes: its file and its entry there.
struct FilePlan {
  struct OneFile {
    std::string name;
    std::vector<Entry> entries;
    std::string header;  ///< header_bytes(entries, metadata)
    std::uint64_t bytes() const { return header.size() + (entries.empty() ? 0 : entries.back().end); }
  };
  /// A tensor's file and entry there, and its place in the order it was described in.
  struct Place {
    std::size_t file = 0, entry = 0, order = 0;
  };
  std::vector<OneFile> files;
  std::map<std::string, Place> where;  ///< by name
  std::uint64_t total_size = 0;  ///< the tensors' bytes, as the index's metadata counts them
};
ACCEL_COMPILED_ONCE FilePlan plan_files(const std::vector<Described>& tensors, std::uint64_t max_shard_size,
                                        std::map<std::string, std::string> metadata);

/// Part of a tensor's bytes that this process writes: `values` (any device,
/// any layout) go to the flat elements starting at `first_element`.
struct Piece {
  std::string name;
  std::int64_t first_element = 0;
  at::Tensor values;
};
/// Makes each file, under a temporary name, with its header, at full size.
ACCEL_COMPILED_ONCE void create_files(const std::filesystem::path& dir, const FilePlan& plan);
/// Writes pieces into the files create_files made; returns the bytes written
/// per tensor, in the order plan_files was given them (Place::order).
ACCEL_COMPILED_ONCE std::vector<std::int64_t> write_pieces(const std::filesystem::path& dir, const FilePlan& plan,
                                                           const std::vector<Piece>& pieces);
/// Checks that `written` (summed over every writer) covers every tensor, then
/// puts the files in place, the index last, and removes the files of an
/// earlier save in `dir` that this one does not replace.
ACCEL_COMPILED_ONCE void commit_files(const std::filesystem::path& dir, const FilePlan& plan,
                                      const std::vector<std::int64_t>& written);

/// The files' tensors matched to the names a loader fills (LoadOptions'
/// rules): what each name reads, and what did not match.
struct Matched {
  std::vector<std::unique_ptr<File>> files;
  std::map<std::string, std::pair<const File*, const Entry*>> found;  ///< the loader's name -> its tensor
  LoadReport report;
  /// The tensor that loads into `name`, transformed (LoadOptions::transform).
  at::Tensor tensor(const std::string& name, const LoadOptions& options) const {
    const auto& [file, entry] = found.at(name);
    at::Tensor saved = file->tensor(*entry);
    return options.transform ? options.transform(name, saved) : saved;
  }
};
/// `targets`: each name the loader fills, with its full shape. Throws, naming
/// the tensor, on a shape that differs; when strict, on any name unmatched.
ACCEL_COMPILED_ONCE Matched match(const std::filesystem::path& path,
                                  const std::map<std::string, std::vector<std::int64_t>>& targets,
                                  const LoadOptions& options);

/// A module's parameters, then its buffers, by dotted name: the order of
/// the tensors in the files save_model writes.
inline std::vector<std::pair<std::string, at::Tensor>> module_tensors(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers()) out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace safetensors

/// Accelerate's save_model for a module in one process: its parameters and
/// buffers (Module::named_parameters, then named_buffers), dtype kept.
ACCEL_COMPILED_ONCE void save_model(torch::nn::Module& module, const std::filesystem::path& dir,
                                    const SaveModelOptions& options = {});

/// Loads a module's parameters and buffers from a safetensors file, a
/// directory holding model.safetensors or model.safetensors.index.json, or
/// that index. Shapes must match (any mismatch throws, naming the tensor);
/// values are converted to the module's dtype and device.
ACCEL_COMPILED_ONCE LoadReport load_safetensors(torch::nn::Module& module, const std::filesystem::path& path,
                                                const LoadOptions& options = {});

}  // namespace accel

#if ACCEL_DEFINE_COMPILED_ONCE
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "accel/checkpoint/files.hpp"

namespace accel::safetensors {

namespace detail {

inline std::string system_error(const std::string& what, const std::filesystem::path& path) {
  return "accel: " + what + " " + path.string() + ": " + std::strerror(errno);
}

// A file descriptor closed on scope exit.
struct Descriptor {
  int fd = -1;
  Descriptor(const std::filesystem::path& path, int flags) : fd(::open(path.c_str(), flags | O_CLOEXEC, 0644)) {}
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
};

inline void write_all(int fd, const char* data, std::uint64_t bytes, std::uint64_t at, const std::filesystem::path& path) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, data, std::min<std::uint64_t>(bytes, std::uint64_t{1} << 30), static_cast<off_t>(at));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(system_error("could not write", path));
    }
    data += n;
    bytes -= static_cast<std::uint64_t>(n);
    at += static_cast<std::uint64_t>(n);
  }
}

inline std::filesystem::path temporary(const std::filesystem::path& dir, const std::string& name) {
  return dir / (name + ".partial");
}

inline std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 8) out += " and " + std::to_string(names.size() - 8) + " more";
  return out;
}

}  // namespace detail

struct File::Mapping {
  void* data = nullptr;
  std::uint64_t bytes = 0;
  ~Mapping() {
    if (data) ::munmap(data, bytes);
  }
};

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE c10::ScalarType scalar_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::F64: return c10::kDouble;
    case Dtype::F32: return c10::kFloat;
    case Dtype::F16: return c10::kHalf;
    case Dtype::BF16: return c10::kBFloat16;
    case Dtype::I64: return c10::kLong;
    case Dtype::I32: return c10::kInt;
    case Dtype::I16: return c10::kShort;
    case Dtype::I8: return c10::kChar;
    case Dtype::U8: return c10::kByte;
    case Dtype::BOOL: return c10::kBool;
  }
  throw std::logic_error("accel: safetensors: an unlisted dtype");
}

ACCEL_COMPILED_ONCE Dtype dtype_of(c10::ScalarType type, const std::string& name) {
  for (const Dtype d : {Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::I64, Dtype::I32, Dtype::I16, Dtype::I8,
                        Dtype::U8, Dtype::BOOL})
    if (scalar_type(d) == type) return d;
  throw FormatError("accel: safetensors cannot hold tensor \"" + name + "\" of type " + c10::toString(type));
}

ACCEL_COMPILED_ONCE File::File(const std::filesystem::path& path) : path_(path), mapping_(std::make_shared<Mapping>()) {
  detail::Descriptor file(path, O_RDONLY);
  if (file.fd < 0) throw FormatError(detail::system_error("could not open", path));
  struct stat info {};
  if (::fstat(file.fd, &info) != 0) throw FormatError(detail::system_error("could not stat", path));
  const auto bytes = static_cast<std::uint64_t>(info.st_size);
  if (bytes < 8)
    throw FormatError("accel: " + path.string() + " is truncated: " + std::to_string(bytes) +
                      " bytes, fewer than the 8 that give the header's length");
  // MAP_PRIVATE: a tensor written to changes a copy of its pages, not the file.
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, file.fd, 0);
  if (data == MAP_FAILED) throw FormatError(detail::system_error("could not map", path));
  mapping_->data = data;
  mapping_->bytes = bytes;
  const auto* begin = static_cast<const unsigned char*>(data);
  unsigned char prefix[8];
  std::memcpy(prefix, begin, 8);
  const std::uint64_t length = header_length(prefix, bytes, path.string());
  header_ = parse_header(std::string_view(reinterpret_cast<const char*>(begin) + 8, length), bytes, path.string());
  for (std::size_t i = 0; i < header_.entries.size(); ++i) by_name_[header_.entries[i].name] = i;
}

ACCEL_COMPILED_ONCE const Entry* File::find(const std::string& name) const {
  const auto found = by_name_.find(name);
  return found == by_name_.end() ? nullptr : &header_.entries[found->second];
}

ACCEL_COMPILED_ONCE at::Tensor File::tensor(const Entry& entry) const {
  const auto options = at::TensorOptions().dtype(scalar_type(entry.dtype));
  if (entry.end == entry.begin) return at::empty(entry.shape, options);
  auto* at_bytes = static_cast<unsigned char*>(mapping_->data) + header_.data_start + entry.begin;
  if (reinterpret_cast<std::uintptr_t>(at_bytes) % dtype_bytes(entry.dtype) != 0) {
    // A writer that did not align its header: copy to aligned memory.
    at::Tensor out = at::empty(entry.shape, options);
    std::memcpy(out.data_ptr(), at_bytes, entry.end - entry.begin);
    return out;
  }
  auto keep = mapping_;
  return at::from_blob(at_bytes, entry.shape, [keep](void*) mutable { keep.reset(); }, options);
}

ACCEL_COMPILED_ONCE FilePlan plan_files(const std::vector<Described>& tensors, std::uint64_t max_shard_size,
                                        std::map<std::string, std::string> metadata) {
  metadata.emplace("format", "pt");
  std::vector<std::uint64_t> bytes;
  FilePlan plan;
  for (const auto& e : lay_out(tensors)) {
    if (plan.where.count(e.name)) throw std::invalid_argument("accel: save_model: two tensors named \"" + e.name + "\"");
    const std::size_t order = plan.where.size();
    plan.where[e.name] = {0, 0, order};
    bytes.push_back(e.end - e.begin);
    plan.total_size += e.end - e.begin;
  }
  const auto starts = cut_into_files(bytes, max_shard_size);
  for (std::size_t f = 0; f < starts.size(); ++f) {
    const std::size_t end = f + 1 < starts.size() ? starts[f + 1] : tensors.size();
    std::vector<Described> in_file(tensors.begin() + static_cast<std::ptrdiff_t>(starts[f]),
                                   tensors.begin() + static_cast<std::ptrdiff_t>(end));
    FilePlan::OneFile file;
    file.name = starts.size() == 1 ? single_file_name : sharded_file_name(f, starts.size());
    file.entries = lay_out(in_file);
    file.header = header_bytes(file.entries, metadata);
    for (std::size_t k = 0; k < file.entries.size(); ++k) {
      auto& place = plan.where[file.entries[k].name];
      place.file = f;
      place.entry = k;
    }
    plan.files.push_back(std::move(file));
  }
  return plan;
}

ACCEL_COMPILED_ONCE void create_files(const std::filesystem::path& dir, const FilePlan& plan) {
  std::filesystem::create_directories(dir);
  for (const auto& file : plan.files) {
    const auto path = detail::temporary(dir, file.name);
    detail::Descriptor out(path, O_WRONLY | O_CREAT | O_TRUNC);
    if (out.fd < 0) throw std::runtime_error(detail::system_error("could not create", path));
    detail::write_all(out.fd, file.header.data(), file.header.size(), 0, path);
    if (::ftruncate(out.fd, static_cast<off_t>(file.bytes())) != 0)
      throw std::runtime_error(detail::system_error("could not size", path));
  }
}

ACCEL_COMPILED_ONCE std::vector<std::int64_t> write_pieces(const std::filesystem::path& dir, const FilePlan& plan,
                                                           const std::vector<Piece>& pieces) {
  std::vector<std::int64_t> written(plan.where.size(), 0);
  std::map<std::size_t, std::unique_ptr<detail::Descriptor>> open;
  for (const auto& piece : pieces) {
    const auto found = plan.where.find(piece.name);
    if (found == plan.where.end())
      throw std::logic_error("accel: save_model: a piece of \"" + piece.name + "\", which the plan lacks");
    const auto& place = found->second;
    const auto& file = plan.files[place.file];
    const auto& entry = file.entries[place.entry];
    const at::Tensor values = piece.values.detach().to(at::kCPU).contiguous();
    if (scalar_type(entry.dtype) != values.scalar_type())
      throw std::logic_error("accel: save_model: a piece of \"" + piece.name + "\" of another dtype");
    const std::uint64_t element = dtype_bytes(entry.dtype);
    const std::uint64_t at = file.header.size() + entry.begin + static_cast<std::uint64_t>(piece.first_element) * element;
    const std::uint64_t bytes = static_cast<std::uint64_t>(values.numel()) * element;
    if (piece.first_element < 0 || at + bytes > file.header.size() + entry.end)
      throw std::logic_error("accel: save_model: a piece of \"" + piece.name + "\" past its end");
    auto& fd = open[place.file];
    const auto path = detail::temporary(dir, file.name);
    if (!fd) {
      fd = std::make_unique<detail::Descriptor>(path, O_WRONLY);
      if (fd->fd < 0) throw std::runtime_error(detail::system_error("could not open", path));
    }
    detail::write_all(fd->fd, static_cast<const char*>(values.data_ptr()), bytes, at, path);
    written[place.order] += static_cast<std::int64_t>(bytes);
  }
  return written;
}

ACCEL_COMPILED_ONCE void commit_files(const std::filesystem::path& dir, const FilePlan& plan,
                                      const std::vector<std::int64_t>& written) {
  for (const auto& [name, at] : plan.where) {
    const auto& e = plan.files[at.file].entries[at.entry];
    const auto expected = static_cast<std::int64_t>(e.end - e.begin);
    if (written.at(at.order) != expected)
      throw std::runtime_error("accel: save_model: the ranks wrote " + std::to_string(written[at.order]) + " of the " +
                               std::to_string(expected) + " bytes of \"" + name + "\" (the files are left as " +
                               "*.partial; the model's last complete save is untouched)");
  }
  // An earlier save's files that this one does not overwrite would mix two
  // models in one directory: Accelerate removes them too.
  std::set<std::string> ours;
  for (const auto& f : plan.files) ours.insert(f.name);
  for (const auto& item : std::filesystem::directory_iterator(dir)) {
    const std::string name = item.path().filename().string();
    const bool sharded = name.rfind("model-", 0) == 0 && name.size() > 12 &&
                         name.compare(name.size() - 12, 12, ".safetensors") == 0;
    if ((sharded || name == single_file_name || name == index_file_name) && !ours.count(name))
      std::filesystem::remove(item.path());
  }
  for (const auto& f : plan.files) std::filesystem::rename(detail::temporary(dir, f.name), dir / f.name);
  if (plan.files.size() > 1) {
    nlohmann::json index;
    index["metadata"] = {{"total_size", plan.total_size}};
    index["weight_map"] = nlohmann::json::object();
    for (const auto& [name, at] : plan.where) index["weight_map"][name] = plan.files[at.file].name;
    checkpoint::write_atomically(dir / index_file_name, index.dump(2));
  }
}

ACCEL_COMPILED_ONCE void save_file(const std::filesystem::path& path,
                                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                   std::map<std::string, std::string> metadata) {
  std::vector<Described> described;
  for (const auto& [name, t] : tensors) described.push_back({name, dtype_of(t.scalar_type(), name), t.sizes().vec()});
  const auto entries = lay_out(described);
  const std::string header = header_bytes(entries, metadata);
  const auto temp = std::filesystem::path(path.string() + ".partial");
  {
    detail::Descriptor out(temp, O_WRONLY | O_CREAT | O_TRUNC);
    if (out.fd < 0) throw std::runtime_error(detail::system_error("could not create", temp));
    detail::write_all(out.fd, header.data(), header.size(), 0, temp);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor t = tensors[i].second.detach().to(at::kCPU).contiguous();
      detail::write_all(out.fd, static_cast<const char*>(t.data_ptr()), entries[i].end - entries[i].begin,
                        header.size() + entries[i].begin, temp);
    }
  }
  std::filesystem::rename(temp, path);
}

ACCEL_COMPILED_ONCE std::map<std::string, at::Tensor> load_file(const std::filesystem::path& path) {
  const File file(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& e : file.header().entries) out[e.name] = file.tensor(e);
  return out;
}

}  // namespace accel::safetensors

namespace accel {

namespace detail {

// The files that hold a model: a .safetensors file, an index, or a directory of either.
inline std::map<std::string, std::filesystem::path> safetensors_files(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  fs::path index;
  if (fs::is_directory(path)) {
    if (fs::exists(path / safetensors::single_file_name)) return {{"", path / safetensors::single_file_name}};
    index = path / safetensors::index_file_name;
    if (!fs::exists(index))
      throw safetensors::FormatError("accel: " + path.string() + " holds neither " + safetensors::single_file_name +
                                     " nor " + safetensors::index_file_name);
  } else if (path.extension() == ".json") {
    index = path;
  } else {
    if (!fs::exists(path)) throw safetensors::FormatError("accel: " + path.string() + " does not exist");
    return {{"", path}};
  }
  std::ifstream in(index);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw safetensors::FormatError("accel: " + index.string() + " is not JSON (" + e.what() + ")");
  }
  if (!json.contains("weight_map") || !json["weight_map"].is_object())
    throw safetensors::FormatError("accel: " + index.string() + " has no weight_map object");
  std::map<std::string, fs::path> files;
  for (const auto& [name, file] : json["weight_map"].items()) {
    if (!file.is_string() || fs::path(file.get<std::string>()).has_parent_path())
      throw safetensors::FormatError("accel: " + index.string() + ": the file of \"" + name +
                                     "\" is not a file name in its directory");
    files[file.get<std::string>()] = index.parent_path() / file.get<std::string>();
  }
  return files;
}

}  // namespace detail

ACCEL_COMPILED_ONCE safetensors::Matched safetensors::match(
    const std::filesystem::path& path, const std::map<std::string, std::vector<std::int64_t>>& targets,
    const LoadOptions& options) {
  Matched out;
  for (const auto& [unused, file_path] : accel::detail::safetensors_files(path)) {
    out.files.push_back(std::make_unique<File>(file_path));
    for (const auto& e : out.files.back()->header().entries) {
      const std::string name = options.name_map ? options.name_map(e.name) : e.name;
      if (name.empty()) continue;
      if (!out.found.emplace(name, std::pair{out.files.back().get(), &e}).second)
        throw FormatError("accel: load_safetensors: two tensors of " + path.string() + " load into \"" + name + "\"");
    }
  }
  for (auto it = out.found.begin(); it != out.found.end();) {
    const auto target = targets.find(it->first);
    if (target == targets.end()) {
      out.report.unexpected.push_back(it->first);
      it = out.found.erase(it);
      continue;
    }
    const auto& [file, entry] = it->second;
    const auto shape = options.transform ? options.transform(it->first, file->tensor(*entry)).sizes().vec() : entry->shape;
    if (target->second != shape)
      throw FormatError("accel: load_safetensors: \"" + it->first + "\" has shape " +
                        c10::str(at::IntArrayRef(target->second)) + " in the module and " +
                        c10::str(at::IntArrayRef(shape)) + (options.transform ? " (transformed) in " : " in ") +
                        file->path().string());
    ++it;
  }
  for (const auto& [name, shape] : targets)
    if (!out.found.count(name)) out.report.missing.push_back(name);
  if (options.strict && (!out.report.missing.empty() || !out.report.unexpected.empty())) {
    const auto& r = out.report;
    throw FormatError("accel: load_safetensors(" + path.string() + ") loaded nothing: " +
                      (r.missing.empty() ? "" : "missing " + detail::listed(r.missing)) +
                      (r.missing.empty() || r.unexpected.empty() ? "" : "; ") +
                      (r.unexpected.empty() ? "" : "unexpected " + detail::listed(r.unexpected)) +
                      " (LoadOptions{.strict = false} loads the rest and returns these lists)");
  }
  return out;
}

ACCEL_COMPILED_ONCE void save_model(torch::nn::Module& module, const std::filesystem::path& dir,
                                    const SaveModelOptions& options) {
  std::filesystem::create_directories(dir);
  if (!options.safe_serialization) {
    torch::serialize::OutputArchive archive;
    module.save(archive);
    archive.save_to((dir / "model.pt").string());
    return;
  }
  std::vector<safetensors::Described> described;
  std::vector<safetensors::Piece> pieces;
  for (const auto& [name, t] : safetensors::module_tensors(module)) {
    const std::string file_name = options.name_map ? options.name_map(name) : name;
    if (file_name.empty()) continue;
    const at::Tensor saved = options.transform ? options.transform(name, t.detach()) : t;
    described.push_back({file_name, safetensors::dtype_of(saved.scalar_type(), file_name), saved.sizes().vec()});
    pieces.push_back({file_name, 0, saved});
  }
  const auto plan = safetensors::plan_files(described, options.max_shard_size, options.metadata);
  safetensors::create_files(dir, plan);
  safetensors::commit_files(dir, plan, safetensors::write_pieces(dir, plan, pieces));
}

ACCEL_COMPILED_ONCE LoadReport load_safetensors(torch::nn::Module& module, const std::filesystem::path& path,
                                                const LoadOptions& options) {
  const auto listed = safetensors::module_tensors(module);
  const std::map<std::string, at::Tensor> tensors(listed.begin(), listed.end());
  std::map<std::string, std::vector<std::int64_t>> targets;
  for (const auto& [name, t] : tensors) {
    if (t.is_meta())
      throw std::invalid_argument("accel: load_safetensors: \"" + name + "\" is on the meta device (build_on_meta): "
                                  "prepare the model under ZeRO<3> or HybridShard and call trainer.load_safetensors, "
                                  "which loads each rank's shard, or accel::device::materialize(model) first");
    targets[name] = t.sizes().vec();
  }
  auto matched = safetensors::match(path, targets, options);
  c10::NoGradGuard no_grad;
  for (const auto& [name, source] : matched.found) {
    tensors.at(name).copy_(matched.tensor(name, options));
    ++matched.report.loaded;
  }
  return matched.report;
}

}  // namespace accel

#endif
