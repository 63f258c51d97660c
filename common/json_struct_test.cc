#include "common/json_struct.h"

#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hap {
namespace {

using ::hap::testing::StatusIs;
using ::testing::HasSubstr;

std::string Nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(JsonStructTest, ParsesAnObject) {
  google::protobuf::Struct s;
  ASSERT_TRUE(JsonToStruct(R"({"a": [1, {"b": "c"}], "d": true})", &s).ok());
  EXPECT_EQ(s.fields().at("a").list_value().values(1).struct_value().fields().at("b").string_value(),
            "c");
  EXPECT_TRUE(s.fields().at("d").bool_value());
}

TEST(JsonStructTest, NestingIsBoundedBeforeTheQuadraticParserSeesIt) {
  EXPECT_TRUE(CheckJsonNesting("{\"a\":" + Nested(kMaxJsonNesting - 1) + "}").ok());
  EXPECT_THAT(CheckJsonNesting("{\"a\":" + Nested(kMaxJsonNesting) + "}"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nest deeper than 64 levels at byte 68")));
  // 2^20 levels, as a 2 MiB file holds: refused at once (protobuf alone
  // would take hours).
  google::protobuf::Struct s;
  EXPECT_THAT(JsonToStruct("{\"a\":" + Nested(1 << 20) + "}", &s),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nest deeper than 64")));
}

TEST(JsonStructTest, BracketsInsideStringsDoNotCount) {
  const std::string deep_string = "{\"a\":\"" + std::string(1000, '[') + "\\\"" + "\"}";
  google::protobuf::Struct s;
  ASSERT_TRUE(JsonToStruct(deep_string, &s).ok());
  EXPECT_EQ(s.fields().at("a").string_value(), std::string(1000, '[') + "\"");
  // An escaped quote does not end the string: the brackets after it are text.
  EXPECT_TRUE(CheckJsonNesting("{\"a\":\"\\\"" + std::string(100, '{') + "\"}").ok());
}

TEST(JsonStructTest, ParseErrorsAreInvalidArgument) {
  google::protobuf::Struct s;
  EXPECT_THAT(JsonToStruct("{not json", &s), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")));
  EXPECT_THAT(JsonToStruct("[1, 2]", &s), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")));
}

}  // namespace
}  // namespace hap
