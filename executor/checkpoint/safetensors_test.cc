#include "executor/checkpoint/safetensors.h"

#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/status_matchers.h"
#include "executor/checkpoint/crc32c.h"
#include "executor/checkpoint/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap::executor::checkpoint {
namespace {

using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

std::string Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// A file made by hand from the specification: header length, JSON, data.
std::string HandMade(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + json + data;
}

TEST(SafetensorsTest, WritesTheSpecifiedLayoutAndReadsItBack) {
  HostTensor a(DType::kFloat32, {2, 3});
  HostTensor b(DType::kFloat64, {3});
  HostTensor c(DType::kInt64, {});
  for (int i = 0; i < 6; ++i) a.as<float>()[i] = 0.5f * i;
  for (int i = 0; i < 3; ++i) b.as<double>()[i] = -1.25 * i;
  c.as<int64_t>()[0] = 42;
  const std::string path = TempPath("layout.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"layer/w \"quoted\"", a.view()}, {"b", b.view()}, {"c", c.view()}},
                               {{"format", "pt"}})
                  .ok());

  // The bytes, checked against the specification without our reader.
  const std::string bytes = Slurp(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  EXPECT_THAT(header, HasSubstr("\"__metadata__\":{\"format\":\"pt\"}"));
  // Eight-byte elements first (b, c), then the floats: every tensor aligned.
  EXPECT_THAT(header, HasSubstr("\"b\":{\"dtype\":\"F64\",\"shape\":[3],\"data_offsets\":[0,24]}"));
  EXPECT_THAT(header, HasSubstr("\"c\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[24,32]}"));
  EXPECT_THAT(header, HasSubstr("\"layer/w \\\"quoted\\\"\":{\"dtype\":\"F32\",\"shape\":[2,3],"
                                "\"data_offsets\":[32,56]}"));
  ASSERT_EQ(bytes.size(), 8 + n + 56);
  double b1;
  std::memcpy(&b1, bytes.data() + 8 + n + 8, 8);
  EXPECT_EQ(b1, -1.25);

  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  ASSERT_EQ((*f)->tensors().size(), 3u);
  auto v = (*f)->View("layer/w \"quoted\"");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->shape, (Shape{2, 3}));
  EXPECT_EQ(v->dtype, DType::kFloat32);
  EXPECT_EQ(v->as<float>()[5], 2.5f);
  EXPECT_EQ((*f)->View("c")->as<int64_t>()[0], 42);
  EXPECT_THAT((*f)->View("nope").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
}

// Files of a MB or more go through O_DIRECT and an aligned staging buffer,
// the last partial block through the page cache: the bytes must be exact.
TEST(SafetensorsTest, LargeFilesWrittenDirectlyReadBackExactly) {
  HostTensor big(DType::kFloat32, {(1 << 19) + 7});  // 2 MB + 28 bytes
  HostTensor small(DType::kFloat64, {3});
  for (int64_t i = 0; i < big.num_elements(); ++i) big.as<float>()[i] = 0.25f * (i % 1009);
  for (int i = 0; i < 3; ++i) small.as<double>()[i] = i - 0.5;
  const std::string path = TempPath("large.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"big", big.view()}, {"small", small.view()}}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  auto v = (*f)->View("big");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(std::memcmp(v->data, big.data(), big.view().bytes()), 0);
  EXPECT_EQ((*f)->View("small")->as<double>()[2], 1.5);
  float last;
  ASSERT_TRUE((*f)->ReadBytes("big", big.view().bytes() - 4, 4, &last).ok());
  EXPECT_EQ(last, big.as<float>()[big.num_elements() - 1]);
  EXPECT_THAT((*f)->ReadBytes("big", big.view().bytes() - 2, 4, &last),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("outside tensor 'big'")));
}

TEST(FileWriterTest, DirectWritesOfAnySizeKeepEveryByte) {
  std::string want;
  for (int i = 0; i < (9 << 20) + 4099; ++i) want.push_back(static_cast<char>(i * 7 % 251));
  const std::string path = TempPath("direct.bin");
  auto w = FileWriter::Create(path, /*direct=*/true);
  ASSERT_TRUE(w.ok()) << w.status();
  size_t at = 0;
  for (size_t chunk : {size_t{1}, size_t{4095}, size_t{8 << 20}, size_t{3}, size_t{1 << 20}}) {
    ASSERT_TRUE(w->Write(want.data() + at, chunk).ok());
    at += chunk;
  }
  ASSERT_TRUE(w->Write(want.data() + at, want.size() - at).ok());
  ASSERT_TRUE(w->SyncAndClose().ok());
  EXPECT_EQ(Slurp(path), want);
}

TEST(SafetensorsTest, RejectsRepeatedOrReservedNames) {
  HostTensor a(DType::kFloat32, {1});
  EXPECT_THAT(WriteSafetensors(TempPath("dup.safetensors"), {{"x", a.view()}, {"x", a.view()}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'x' appears twice")));
  EXPECT_THAT(WriteSafetensors(TempPath("meta.safetensors"), {{"__metadata__", a.view()}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reserved")));
}

TEST(SafetensorsTest, AFailedWriteIsAnErrorNamingTheFile) {
  HostTensor a(DType::kFloat32, {1});
  EXPECT_THAT(WriteSafetensors("/nonexistent-dir/x.safetensors", {{"x", a.view()}}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent-dir/x.safetensors")));
}

TEST(SafetensorsTest, ReadsAHandMadeFile) {
  const std::string json = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  float data[2] = {1.5f, -2.0f};
  const std::string path = TempPath("hand.safetensors");
  Spit(path, HandMade(json, std::string(reinterpret_cast<char*>(data), 8)));
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->View("w")->as<float>()[1], -2.0f);
}

// Entries of dtypes we do not train with (a model's BOOL and U8 buffers in
// its state_dict) open, apart from the tensors, as bytes; they are written
// under their dtype, and their sizes checked as any entry's.
TEST(SafetensorsTest, EntriesOfOtherDtypesAreKeptAsBytes) {
  const std::string json = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("mask":{"dtype":"BOOL","shape":[2,2],"data_offsets":[8,12]},)"
                           R"("ids":{"dtype":"U8","shape":[3],"data_offsets":[12,15]},)"
                           R"("pad":{"dtype":"U8","shape":[1],"data_offsets":[15,16]}})";
  float w[2] = {1.5f, -2.0f};
  const std::string data =
      std::string(reinterpret_cast<char*>(w), 8) + std::string("\1\0\1\1", 4) + "abcz";
  const std::string path = TempPath("others.safetensors");
  Spit(path, HandMade(json, data));
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->tensors().size(), 1u);
  ASSERT_EQ((*f)->others().size(), 3u);
  const SafetensorsFile::Other& mask = (*f)->others().at("mask");
  EXPECT_EQ(mask.dtype, "BOOL");
  EXPECT_EQ(mask.shape, (Shape{2, 2}));
  EXPECT_EQ(mask.bytes, std::string("\1\0\1\1", 4));
  EXPECT_EQ((*f)->others().at("ids").bytes, "abc");

  // Written back under their dtypes, next to a tensor; read back equal.
  std::string flags("\1\0\0", 3);
  HostTensor t(DType::kFloat32, Shape{2});
  const std::string out = TempPath("others_out.safetensors");
  ASSERT_TRUE(WriteSafetensors(
                  out, {{"t", t.view()},
                        {"flags", TensorView{DType::kFloat32, Shape{3}, flags.data()}, "BOOL"}})
                  .ok());
  auto back = SafetensorsFile::Open(out);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ((*back)->others().at("flags").dtype, "BOOL");
  EXPECT_EQ((*back)->others().at("flags").bytes, flags);
  EXPECT_TRUE((*back)->tensors().count("t"));
  EXPECT_THAT(WriteSafetensors(out, {{"x", t.view(), "Q9"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown dtype 'Q9'")));
  Spit(path, HandMade(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,4]}})", "\1\1\1\1"));
  EXPECT_THAT(
      SafetensorsFile::Open(path).status(),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("has 4 bytes for shape [3] of BOOL")));
}

struct BadCase {
  const char* name;
  std::string bytes;
  const char* message;
};

TEST(SafetensorsTest, MalformedFilesAreDataLossNamingTheFileAndTheProblem) {
  const std::string ok_json = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight(8, '\1');
  std::string huge(8, '\0');
  huge[4] = 1;  // 2^32 bytes of header
  const std::vector<BadCase> cases = {
      {"short", "abc", "fewer than the 8"},
      {"huge_header", huge + "{}", "over the 100 MB limit"},
      {"past_end", HandMade(ok_json, eight).substr(0, 20), "runs past the end"},
      {"not_json", HandMade("{not json", eight), "not a JSON object"},
      {"truncated_data", HandMade(ok_json, eight.substr(0, 4)), "truncated or trailing"},
      {"trailing", HandMade(ok_json, eight + "x"), "truncated or trailing"},
      {"bad_dtype", HandMade(R"({"w":{"dtype":"U7","shape":[2],"data_offsets":[0,8]}})", eight),
       "dtype 'U7'"},
      {"wrong_size", HandMade(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       "has 8 bytes for shape [3]"},
      {"overlap",
       HandMade(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                eight),
       "overlapping or non-contiguous"},
      {"missing_field", HandMade(R"({"w":{"dtype":"F32","shape":[2]}})", eight),
       "two data_offsets"},
      {"negative", HandMade(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       "not a count"},
      // Nesting a recursive parser would follow until its stack ran out.
      {"deeply_nested",
       HandMade(R"({"w":)" + std::string(1 << 20, '[') + std::string(1 << 20, ']') + "}", eight),
       "not a JSON object"},
      {"nested_metadata", HandMade(R"({"__metadata__":{"a":{"b":"c"}}})", ""), "is not a string"},
  };
  for (const BadCase& c : cases) {
    const std::string path = TempPath(std::string(c.name) + ".safetensors");
    Spit(path, c.bytes);
    EXPECT_THAT(SafetensorsFile::Open(path).status(),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr(c.message)))
        << c.name;
    EXPECT_THAT(SafetensorsFile::Open(path).status(),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path)))
        << c.name;
  }
  EXPECT_THAT(SafetensorsFile::Open(TempPath("missing.safetensors")).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.safetensors")));
}

TEST(FileUtilTest, ReadFileErrorsNameTheFile) {
  const std::string dir = TempPath("read_file_dir");
  std::filesystem::create_directories(dir);
  EXPECT_THAT(ReadFile(dir + "/missing"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(dir + "/missing")));
  Spit(dir + "/f", std::string("a\0b", 3));
  auto read = ReadFile(dir + "/f");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, std::string("a\0b", 3));
}

// ReadFile (index.json, trainer.json) on a named pipe waited for a writer
// forever, and on /dev/zero (a link to it in a checkpoint) read until memory
// ran out; SafetensorsFile::Open on a pipe waited alike. A directory was an
// Internal error (EISDIR), which a checkpoint reader took for an I/O failure.
TEST(FileUtilTest, OnlyRegularFilesAreRead) {
  const std::string dir = TempPath("read_file_a_dir");
  std::filesystem::create_directories(dir);
  EXPECT_THAT(ReadFile(dir), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr(dir + " is not a regular file (a directory)")));
  const std::string fifo = TempPath("read_file_fifo");
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(ReadFile(fifo), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr(fifo + " is not a regular file")));
  EXPECT_THAT(SafetensorsFile::Open(fifo),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(fifo + " is not a regular file")));
  EXPECT_THAT(ReadFile("/dev/zero"), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("/dev/zero is not a regular file")));
}

// The values of RFC 3720 (iSCSI), B.4, and the software and hardware forms
// agreeing at every length and alignment.
TEST(Crc32cTest, KnownValuesAndBothFormsAgree) {
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  std::string zeros(32, '\0'), ones(32, '\xff'), ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<char>(i);
  EXPECT_EQ(Crc32c(0, zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(0, ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(0, ascending.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(Crc32cHex(0x0000ABCDu), "0000abcd");
  std::string bytes(1000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7919 % 251);
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n : {0, 1, 7, 8, 9, 63, 500, 991}) {
      const char* p = bytes.data() + start;
      EXPECT_EQ(Crc32c(0, p, n), Crc32cPortable(0, p, n)) << start << " " << n;
      EXPECT_EQ(Crc32c(Crc32c(0, p, n / 3), p + n / 3, n - n / 3), Crc32c(0, p, n));
    }
  }
}

TEST(Crc32cTest, ATensorsChecksumIsItsBytes) {
  const std::string path = TempPath("crc.safetensors");
  std::vector<float> v(3000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f;
  ASSERT_TRUE(WriteSafetensors(path, {{"w", TensorView{DType::kFloat32, {3000}, v.data()}}}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  auto crc = (*f)->Crc32cOf("w");
  ASSERT_TRUE(crc.ok()) << crc.status();
  EXPECT_EQ(*crc, Crc32c(0, v.data(), v.size() * sizeof(float)));
  EXPECT_THAT((*f)->Crc32cOf("x").status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no tensor 'x'")));
}

}  // namespace
}  // namespace hap::executor::checkpoint
