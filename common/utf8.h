// UTF-8 text cut to a size without splitting a character (messages, label
// values and records the planner bounds).
#ifndef HAP_COMMON_UTF8_H_
#define HAP_COMMON_UTF8_H_

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace hap {

// Whether byte `c` continues a UTF-8 character (10xxxxxx).
inline bool Utf8Continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// `s` when it has at most `max_bytes` bytes; otherwise its longest prefix
// that ends on a character's start and leaves room for "...", then "...".
inline std::string CutUtf8(absl::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  size_t keep = max_bytes < 3 ? 0 : max_bytes - 3;
  while (keep > 0 && Utf8Continuation(s[keep])) --keep;
  return absl::StrCat(s.substr(0, keep), "...");
}

}  // namespace hap

#endif  // HAP_COMMON_UTF8_H_
