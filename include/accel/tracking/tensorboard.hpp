#pragma once
// TensorBoard event files, written without TensorFlow or protobuf: the file
// is a sequence of TFRecords, each holding one `Event` message, encoded here
// by hand (only the few fields a scalar or text log needs). Torch-free.
//
//   TFRecord:  uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
//   Event:     1 wall_time (double), 2 step (int64), 3 file_version (string), 5 summary
//   Summary:   1 value (repeated Value)
//   Value:     1 tag, 2 simple_value (float), 8 tensor (TensorProto), 9 metadata (SummaryMetadata)
//   TensorProto: 1 dtype (7 = DT_STRING), 2 tensor_shape (empty: a scalar), 8 string_val
//   SummaryMetadata: 1 plugin_data { 1 plugin_name }
// The field numbers are TensorFlow's (event.proto, summary.proto,
// tensor.proto); the test reads the files back with TensorBoard's own reader.

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace accel::tracking {

namespace detail {
/// Seconds since the Unix epoch: every tracker's timestamps.
inline double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace detail

/// CRC-32C (Castagnoli), the checksum TFRecord uses.
inline std::uint32_t crc32c(std::string_view bytes) {
  static const auto table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char b : bytes) crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

/// TFRecord stores checksums "masked" so that a CRC of data holding CRCs stays well-behaved.
inline std::uint32_t masked_crc32c(std::string_view bytes) {
  const std::uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

namespace protobuf {

inline void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
inline void key(std::string& out, int field, int wire_type) { varint(out, (static_cast<std::uint64_t>(field) << 3) | wire_type); }
template <class T>
void little_endian(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // x86-64 and aarch64 are little-endian
  out.append(bytes, sizeof(T));
}
inline void bytes_field(std::string& out, int field, std::string_view bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out.append(bytes);
}
inline void double_field(std::string& out, int field, double v) { key(out, field, 1), little_endian(out, v); }
inline void float_field(std::string& out, int field, float v) { key(out, field, 5), little_endian(out, v); }
inline void int_field(std::string& out, int field, std::int64_t v) { key(out, field, 0), varint(out, static_cast<std::uint64_t>(v)); }

}  // namespace protobuf

/// One summary value: a scalar, or a text (TensorBoard's "text" plugin).
inline std::string scalar_value(std::string_view tag, float value) {
  std::string v;
  protobuf::bytes_field(v, 1, tag);
  protobuf::float_field(v, 2, value);
  return v;
}

inline std::string text_value(std::string_view tag, std::string_view text) {
  std::string tensor;
  protobuf::int_field(tensor, 1, 7);       // dtype: DT_STRING
  protobuf::bytes_field(tensor, 2, "");    // shape: scalar
  protobuf::bytes_field(tensor, 8, text);  // string_val
  std::string plugin;
  protobuf::bytes_field(plugin, 1, "text");
  std::string metadata;
  protobuf::bytes_field(metadata, 1, plugin);
  std::string v;
  protobuf::bytes_field(v, 1, tag);
  protobuf::bytes_field(v, 8, tensor);
  protobuf::bytes_field(v, 9, metadata);
  return v;
}

/// Appends Events to `events.out.tfevents.<seconds>.<host>.<pid>` in `dir`,
/// the name TensorBoard looks for. Each record is flushed as it is written,
/// so a run that dies keeps what it logged.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::filesystem::path& dir) {
    std::filesystem::create_directories(dir);
    char host[256] = "localhost";
    ::gethostname(host, sizeof(host) - 1);
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
    path_ = dir / ("events.out.tfevents." + std::to_string(seconds) + "." + host + "." + std::to_string(::getpid()));
    out_.open(path_, std::ios::binary | std::ios::app);
    if (!out_) throw std::runtime_error("accel: cannot write the TensorBoard event file " + path_.string());
    std::string event;
    protobuf::double_field(event, 1, detail::wall_time());
    protobuf::bytes_field(event, 3, "brain.Event:2");
    write_record(event);
  }

  /// One Event at `step` holding `values` (each from scalar_value/text_value).
  template <class Values>
  void write(std::int64_t step, const Values& values) {
    std::string summary;
    for (const std::string& value : values) protobuf::bytes_field(summary, 1, value);
    std::string event;
    protobuf::double_field(event, 1, detail::wall_time());
    protobuf::int_field(event, 2, step);
    protobuf::bytes_field(event, 5, summary);
    write_record(event);
  }

  const std::filesystem::path& path() const { return path_; }

 private:
  void write_record(const std::string& data) {
    std::string header;
    protobuf::little_endian<std::uint64_t>(header, data.size());
    std::string record = header;
    protobuf::little_endian<std::uint32_t>(record, masked_crc32c(header));
    record += data;
    protobuf::little_endian<std::uint32_t>(record, masked_crc32c(data));
    out_.write(record.data(), static_cast<std::streamsize>(record.size()));
    out_.flush();
    if (!out_) throw std::runtime_error("accel: cannot write the TensorBoard event file " + path_.string());
  }

  std::filesystem::path path_;
  std::ofstream out_;
};

}  // namespace accel::tracking
