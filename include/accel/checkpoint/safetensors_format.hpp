#pragma once
// The safetensors file format, torch-free: the header read and checked, the
// header written, the layout of a model cut into files (Hugging Face's).
//
// NOTE [safetensors]
// A file is: 8 bytes, the header's length N (unsigned, little-endian); N
// bytes of JSON, {"name": {"dtype": "F32", "shape": [2, 3],
// "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}; then the
// data section, each tensor's bytes row-major and little-endian at
// [begin, end) counted from the section's start. Readers of untrusted files
// must not trust any of it, so parse_header refuses, naming the file and the
// entry: a header longer than 100 MB (the reference reader's limit) or than
// the file, an unknown dtype, a negative or overflowing shape, offsets that
// do not match the shape's bytes, that overlap, leave a gap or run past the
// end. Nothing is allocated from a claimed size before it is checked
// against the file's real size. Writers pad the header with spaces to a
// multiple of 8 bytes, so every tensor starts aligned.
//
// A model too large for one file (max_shard_size) is cut as transformers
// and Accelerate cut it: model-00001-of-0000n.safetensors, tensors in order,
// a new file when the next tensor would pass the limit (a tensor larger than
// the limit alone in its file), and model.safetensors.index.json mapping each
// name to its file.

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "accel/core/compiled_once.hpp"

namespace accel::safetensors {

/// A file that is not valid safetensors, or does not fit what reads it.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The element types safetensors names that LibTorch also has.
enum class Dtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

/// One tensor of a file: offsets count from the data section's start.
struct Entry {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// A file's header, checked against the file's size.
struct Header {
  std::vector<Entry> entries;  ///< in data order
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;  ///< 8 + the header's length
};

/// The reference reader's limit on the JSON header.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;
inline constexpr const char* single_file_name = "model.safetensors";
inline constexpr const char* index_file_name = "model.safetensors.index.json";

ACCEL_COMPILED_ONCE std::string_view dtype_name(Dtype dtype);
ACCEL_COMPILED_ONCE std::optional<Dtype> dtype_named(std::string_view name);
ACCEL_COMPILED_ONCE std::uint64_t dtype_bytes(Dtype dtype);

/// The header length in the file's first 8 bytes, checked against the limit
/// and against `file_bytes` (the file's size); `file` names it in errors.
ACCEL_COMPILED_ONCE std::uint64_t header_length(const unsigned char (&prefix)[8], std::uint64_t file_bytes,
                                                const std::string& file);

/// Parses and checks the JSON header (NOTE [safetensors]).
ACCEL_COMPILED_ONCE Header parse_header(std::string_view json, std::uint64_t file_bytes, const std::string& file);

/// What a writer knows of a tensor before it places it.
struct Described {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<std::int64_t> shape;
};

/// Places the tensors one after another, in the given order.
ACCEL_COMPILED_ONCE std::vector<Entry> lay_out(const std::vector<Described>& tensors);

/// The bytes before the data section: the 8-byte length, then the JSON
/// header padded with spaces to a multiple of 8.
ACCEL_COMPILED_ONCE std::string header_bytes(const std::vector<Entry>& entries,
                                             const std::map<std::string, std::string>& metadata);

/// Groups consecutive tensors (their byte sizes given in order) into files of
/// at most `max_file_bytes` each, a larger tensor alone; returns each file's
/// first tensor index.
ACCEL_COMPILED_ONCE std::vector<std::size_t> cut_into_files(const std::vector<std::uint64_t>& tensor_bytes,
                                                            std::uint64_t max_file_bytes);

/// "model-00002-of-00005.safetensors" for file 1 of 5 (counted from 0).
ACCEL_COMPILED_ONCE std::string sharded_file_name(std::size_t file, std::size_t files);

}  // namespace accel::safetensors

#if ACCEL_DEFINE_COMPILED_ONCE
#include <algorithm>
#include <array>
#include <limits>
#include <nlohmann/json.hpp>

namespace accel::safetensors {

namespace detail {

struct DtypeInfo {
  Dtype dtype;
  std::string_view name;
  std::uint64_t bytes;
};
inline constexpr std::array<DtypeInfo, 10> dtypes{{{Dtype::F64, "F64", 8},
                                                   {Dtype::F32, "F32", 4},
                                                   {Dtype::F16, "F16", 2},
                                                   {Dtype::BF16, "BF16", 2},
                                                   {Dtype::I64, "I64", 8},
                                                   {Dtype::I32, "I32", 4},
                                                   {Dtype::I16, "I16", 2},
                                                   {Dtype::I8, "I8", 1},
                                                   {Dtype::U8, "U8", 1},
                                                   {Dtype::BOOL, "BOOL", 1}}};

inline const DtypeInfo& info(Dtype dtype) {
  for (const auto& d : dtypes)
    if (d.dtype == dtype) return d;
  throw std::logic_error("accel: safetensors: an unlisted dtype");
}

// a * b, or nothing when it passes 2^63 (no real file holds that much).
inline std::optional<std::uint64_t> times(std::uint64_t a, std::uint64_t b) {
  constexpr std::uint64_t limit = std::uint64_t{1} << 63;
  if (a != 0 && b > limit / a) return std::nullopt;
  return a * b;
}

}  // namespace detail

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE std::string_view dtype_name(Dtype dtype) { return detail::info(dtype).name; }

ACCEL_COMPILED_ONCE std::optional<Dtype> dtype_named(std::string_view name) {
  for (const auto& d : detail::dtypes)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

ACCEL_COMPILED_ONCE std::uint64_t dtype_bytes(Dtype dtype) { return detail::info(dtype).bytes; }

ACCEL_COMPILED_ONCE std::uint64_t header_length(const unsigned char (&prefix)[8], std::uint64_t file_bytes,
                                                const std::string& file) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > max_header_bytes)
    throw FormatError("accel: " + file + " is not a safetensors file: its header claims " + std::to_string(n) +
                      " bytes, over the format's limit of " + std::to_string(max_header_bytes));
  if (n + 8 > file_bytes)
    throw FormatError("accel: " + file + " is truncated: its header claims " + std::to_string(n) +
                      " bytes, but the file has " + std::to_string(file_bytes) + " in all");
  return n;
}

ACCEL_COMPILED_ONCE Header parse_header(std::string_view text, std::uint64_t file_bytes, const std::string& file) {
  const std::string where = "accel: " + file + ": ";
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(where + "the header is not JSON (" + e.what() + ")");
  }
  if (!json.is_object()) throw FormatError(where + "the header is not a JSON object");
  Header header;
  header.data_start = 8 + text.size();
  if (header.data_start > file_bytes) throw FormatError(where + "the file ends inside its header");
  const std::uint64_t data_bytes = file_bytes - header.data_start;
  for (const auto& [name, value] : json.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw FormatError(where + "__metadata__ is not an object of strings");
      for (const auto& [key, item] : value.items()) {
        if (!item.is_string()) throw FormatError(where + "__metadata__[\"" + key + "\"] is not a string");
        header.metadata[key] = item.get<std::string>();
      }
      continue;
    }
    const std::string entry = where + "tensor \"" + name + "\": ";
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets"))
      throw FormatError(entry + "needs dtype, shape and data_offsets");
    Entry e;
    e.name = name;
    const auto& dtype = value["dtype"];
    const auto known = dtype.is_string() ? dtype_named(dtype.get<std::string>()) : std::nullopt;
    if (!known)
      throw FormatError(entry + "dtype " + dtype.dump() +
                        " is not one LibTorch reads (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
    e.dtype = *known;
    const auto& shape = value["shape"];
    if (!shape.is_array()) throw FormatError(entry + "shape is not a list");
    std::uint64_t bytes = dtype_bytes(e.dtype);
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) throw FormatError(entry + "shape " + shape.dump() + " has a negative or non-integer size");
      const auto size = d.get<std::uint64_t>();
      const auto product = detail::times(bytes, size);
      if (!product || size > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        throw FormatError(entry + "shape " + shape.dump() + " is impossibly large");
      bytes = *product;
      e.shape.push_back(static_cast<std::int64_t>(size));
    }
    const auto& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      throw FormatError(entry + "data_offsets " + offsets.dump() + " is not [begin, end]");
    e.begin = offsets[0].get<std::uint64_t>();
    e.end = offsets[1].get<std::uint64_t>();
    if (e.end < e.begin || e.end - e.begin != bytes)
      throw FormatError(entry + "data_offsets " + offsets.dump() + " hold " +
                        std::to_string(e.end < e.begin ? 0 : e.end - e.begin) + " bytes, its shape needs " +
                        std::to_string(bytes));
    if (e.end > data_bytes)
      throw FormatError(entry + "data_offsets " + offsets.dump() + " run past the data's end (" +
                        std::to_string(data_bytes) + " bytes; the file is truncated or corrupt)");
    header.entries.push_back(std::move(e));
  }
  std::sort(header.entries.begin(), header.entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  std::uint64_t next = 0;
  for (const auto& e : header.entries) {
    if (e.begin < next) throw FormatError(where + "tensor \"" + e.name + "\" overlaps the tensor before it");
    if (e.begin > next)
      throw FormatError(where + "a gap of " + std::to_string(e.begin - next) + " bytes before tensor \"" + e.name + "\"");
    next = e.end;
  }
  if (next != data_bytes)
    throw FormatError(where + std::to_string(data_bytes - next) + " bytes after the last tensor belong to none");
  return header;
}

ACCEL_COMPILED_ONCE std::vector<Entry> lay_out(const std::vector<Described>& tensors) {
  std::vector<Entry> out;
  std::uint64_t next = 0;
  for (const auto& t : tensors) {
    std::uint64_t bytes = dtype_bytes(t.dtype);
    for (const auto d : t.shape) {
      if (d < 0) throw std::invalid_argument("accel: safetensors: tensor \"" + t.name + "\" has a negative size");
      bytes *= static_cast<std::uint64_t>(d);
    }
    out.push_back({t.name, t.dtype, t.shape, next, next + bytes});
    next += bytes;
  }
  return out;
}

ACCEL_COMPILED_ONCE std::string header_bytes(const std::vector<Entry>& entries,
                                             const std::map<std::string, std::string>& metadata) {
  // Written by hand, not through nlohmann::json's sorted object, so the
  // tensors appear in data order as the reference writer puts them.
  std::string json = "{";
  if (!metadata.empty()) json += "\"__metadata__\":" + nlohmann::json(metadata).dump();
  for (const auto& e : entries) {
    if (json.size() > 1) json += ",";
    nlohmann::json value = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
    json += nlohmann::json(e.name).dump() + ":" + value.dump();
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  std::uint64_t n = json.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out[static_cast<std::size_t>(i)] = static_cast<char>(n & 0xff);
  return out + json;
}

ACCEL_COMPILED_ONCE std::vector<std::size_t> cut_into_files(const std::vector<std::uint64_t>& tensor_bytes,
                                                            std::uint64_t max_file_bytes) {
  if (max_file_bytes == 0) throw std::invalid_argument("accel: max_shard_size must be positive");
  std::vector<std::size_t> starts;
  std::uint64_t in_file = 0;
  for (std::size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (starts.empty() || (in_file > 0 && in_file + tensor_bytes[i] > max_file_bytes)) {
      starts.push_back(i);
      in_file = 0;
    }
    in_file += tensor_bytes[i];
  }
  if (starts.empty()) starts.push_back(0);
  return starts;
}

ACCEL_COMPILED_ONCE std::string sharded_file_name(std::size_t file, std::size_t files) {
  auto five = [](std::size_t n) {
    std::string s = std::to_string(n);
    return std::string(s.size() < 5 ? 5 - s.size() : 0, '0') + s;
  };
  return "model-" + five(file + 1) + "-of-" + five(files) + ".safetensors";
}

}  // namespace accel::safetensors

#endif
