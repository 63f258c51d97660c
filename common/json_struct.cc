#include "common/json_struct.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"

namespace hap {

absl::Status CheckJsonNesting(std::string_view json, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, whatever it is
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '{':
      case '[':
        if (++depth > max_depth) {
          return absl::InvalidArgumentError(absl::StrCat(
              "JSON objects and arrays nest deeper than ", max_depth, " levels at byte ", i));
        }
        break;
      case '}':
      case ']':
        if (depth > 0) --depth;  // unbalanced text is the parser's to refuse
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status JsonToStruct(std::string_view json, google::protobuf::Struct* out) {
  if (absl::Status s = CheckJsonNesting(json); !s.ok()) return s;
  auto st = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), out);
  if (!st.ok()) return absl::InvalidArgumentError(std::string(st.message()));
  return absl::OkStatus();
}

}  // namespace hap
