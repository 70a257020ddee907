// The safetensors header, torch-free: what a writer lays out reads back, and
// every malformed header is refused with what is wrong (NOTE [safetensors]).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <accel/checkpoint/safetensors_format.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "../support/doctest.hpp"

namespace st = accel::safetensors;

namespace {

// The header of a file whose data section holds `data_bytes`, parsed as a reader would.
st::Header parse(const std::string& json, std::uint64_t data_bytes) {
  return st::parse_header(json, 8 + json.size() + data_bytes, "f.safetensors");
}

std::string one_tensor(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"w":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
}

}  // namespace

TEST_SUITE("safetensors_format") {
  TEST_CASE("what the writer lays out reads back: entries in data order, metadata kept, data aligned to 8") {
    const std::vector<st::Described> tensors{{"b.weight", st::Dtype::BF16, {3, 5}},
                                             {"a.bias", st::Dtype::F32, {5}},
                                             {"mask", st::Dtype::BOOL, {7}},
                                             {"step", st::Dtype::I64, {}},
                                             {"empty", st::Dtype::F16, {0, 4}}};
    const auto entries = st::lay_out(tensors);
    REQUIRE(entries.size() == 5);
    CHECK(entries[0].begin == 0);
    CHECK(entries[0].end == 30);
    CHECK(entries[1].begin == 30);
    CHECK(entries[3].end - entries[3].begin == 8);  // a scalar is one element
    CHECK(entries[4].begin == entries[4].end);
    const std::string bytes = st::header_bytes(entries, {{"format", "pt"}, {"note", "x\"y"}});
    CHECK(bytes.size() % 8 == 0);
    unsigned char prefix[8];
    std::memcpy(prefix, bytes.data(), 8);
    const std::uint64_t data = entries.back().end;
    const auto length = st::header_length(prefix, bytes.size() + data, "f");
    CHECK(length == bytes.size() - 8);
    const auto header = st::parse_header(std::string_view(bytes).substr(8, length), bytes.size() + data, "f");
    CHECK(header.data_start == bytes.size());
    CHECK(header.metadata.at("note") == "x\"y");
    REQUIRE(header.entries.size() == 5);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      CHECK(header.entries[i].name == entries[i].name);
      CHECK(header.entries[i].dtype == entries[i].dtype);
      CHECK(header.entries[i].shape == entries[i].shape);
      CHECK(header.entries[i].begin == entries[i].begin);
    }
    // The tensors appear in the JSON in data order, as the reference writer puts them.
    CHECK(bytes.find("b.weight") < bytes.find("a.bias"));
  }

  TEST_CASE("every dtype safetensors and LibTorch share, with its size") {
    const std::vector<std::pair<const char*, std::uint64_t>> expected{
        {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1}, {"U8", 1}, {"BOOL", 1}};
    for (const auto& [name, bytes] : expected) {
      const auto dtype = st::dtype_named(name);
      REQUIRE(dtype.has_value());
      CHECK(st::dtype_name(*dtype) == name);
      CHECK(st::dtype_bytes(*dtype) == bytes);
    }
    CHECK_FALSE(st::dtype_named("F8_E4M3").has_value());
    CHECK_FALSE(st::dtype_named("f32").has_value());
  }

  TEST_CASE("a header claiming more than the limit or than the file is refused before anything is allocated") {
    unsigned char terabytes[8] = {0, 0, 0, 0, 0, 1, 0, 0};  // 2^40
    CHECK_THROWS_WITH_AS(st::header_length(terabytes, 1 << 20, "big.safetensors"),
                         doctest::Contains("big.safetensors is not a safetensors file: its header claims 1099511627776 bytes"),
                         st::FormatError);
    unsigned char thousand[8] = {0xe8, 0x03, 0, 0, 0, 0, 0, 0};
    CHECK(st::header_length(thousand, 1008, "f") == 1000);
    CHECK_THROWS_WITH_AS(st::header_length(thousand, 1007, "cut.safetensors"),
                         doctest::Contains("cut.safetensors is truncated: its header claims 1000 bytes, but the file has 1007"),
                         st::FormatError);
  }

  TEST_CASE("malformed headers are refused, naming the tensor and what is wrong") {
    CHECK(parse(one_tensor("F32", "[2,3]", "[0,24]"), 24).entries.size() == 1);
    const std::vector<std::pair<std::string, std::string>> bad{
        {"not json", "the header is not JSON"},
        {"[1,2]", "the header is not a JSON object"},
        {one_tensor("C64", "[2]", "[0,16]"), "tensor \"w\": dtype \"C64\" is not one LibTorch reads"},
        {one_tensor("F32", "[2,-3]", "[0,24]"), "shape [2,-3] has a negative or non-integer size"},
        {one_tensor("F32", "[2,1.5]", "[0,24]"), "non-integer size"},
        {one_tensor("F32", "[4294967296,4294967296]", "[0,24]"), "is impossibly large"},
        {one_tensor("F32", "[2,3]", "[0,20]"), "data_offsets [0,20] hold 20 bytes, its shape needs 24"},
        {one_tensor("F32", "[2,3]", "[24,0]"), "hold 0 bytes, its shape needs 24"},
        {one_tensor("F32", "[2,3]", "[0]"), "is not [begin, end]"},
        {one_tensor("F32", "[2,3]", "[8,32]"), "run past the data's end (24 bytes"},
        {R"({"w":{"dtype":"F32","shape":[2]}})", "needs dtype, shape and data_offsets"},
        {R"({"__metadata__":{"k":1}})", "__metadata__[\"k\"] is not a string"},
    };
    for (const auto& [json, message] : bad) {
      CAPTURE(json);
      CHECK_THROWS_WITH_AS(parse(json, 24), doctest::Contains(message.c_str()), st::FormatError);
    }
    const std::string two = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})";
    CHECK_THROWS_WITH_AS(parse(two, 6), doctest::Contains("tensor \"b\" overlaps the tensor before it"), st::FormatError);
    const std::string gap = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})";
    CHECK_THROWS_WITH_AS(parse(gap, 10), doctest::Contains("a gap of 2 bytes before tensor \"b\""), st::FormatError);
    CHECK_THROWS_WITH_AS(parse(one_tensor("U8", "[4]", "[0,4]"), 9),
                         doctest::Contains("5 bytes after the last tensor belong to none"), st::FormatError);
  }

  TEST_CASE("a model is cut into files as transformers cuts it: in order, a new file before the limit is passed") {
    using Starts = std::vector<std::size_t>;
    CHECK(st::cut_into_files({4, 4, 4}, 8) == Starts{0, 2});
    CHECK(st::cut_into_files({4, 4, 4}, 100) == Starts{0});
    CHECK(st::cut_into_files({10, 1}, 8) == Starts{0, 1});         // a tensor over the limit fills a file alone
    CHECK(st::cut_into_files({1, 10, 1}, 8) == Starts{0, 1, 2});
    CHECK(st::cut_into_files({}, 8) == Starts{0});
    CHECK_THROWS_AS(st::cut_into_files({1}, 0), std::invalid_argument);
    CHECK(st::sharded_file_name(1, 5) == "model-00002-of-00005.safetensors");
    CHECK(st::sharded_file_name(0, 123456) == "model-00001-of-123456.safetensors");
  }
}
