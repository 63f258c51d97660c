// Tensor forms (docs/design.md §4): R replicated, P partial sum, S(d) sharded on
// dimension d by the sharding ratios.
#ifndef HAP_PLANNER_SYNTH_FORM_H_
#define HAP_PLANNER_SYNTH_FORM_H_

#include <cstdint>
#include <string>

namespace hap::synth {

class Form {
 public:
  static constexpr int8_t kReplicated = -1;
  static constexpr int8_t kPartial = -2;
  // The largest dimension S(d) can name (d is kept in an int8_t).
  static constexpr int kMaxShardedDim = 127;

  constexpr Form() : v_(kReplicated) {}
  static constexpr Form R() { return Form(kReplicated); }
  static constexpr Form P() { return Form(kPartial); }
  // 0 <= dim <= kMaxShardedDim (RulesFor makes no rule past it).
  static constexpr Form S(int dim) { return Form(static_cast<int8_t>(dim)); }
  // The form whose raw() is `raw`.
  static constexpr Form FromRaw(int8_t raw) { return Form(raw); }

  bool is_replicated() const { return v_ == kReplicated; }
  bool is_partial() const { return v_ == kPartial; }
  bool is_sharded() const { return v_ >= 0; }
  int dim() const { return v_; }
  int8_t raw() const { return v_; }

  std::string ToString() const {
    if (is_replicated()) return "R";
    if (is_partial()) return "P";
    return "S(" + std::to_string(v_) + ")";
  }
  bool operator==(Form o) const { return v_ == o.v_; }
  bool operator!=(Form o) const { return v_ != o.v_; }
  bool operator<(Form o) const { return v_ < o.v_; }

 private:
  constexpr explicit Form(int8_t v) : v_(v) {}
  int8_t v_;
};

}  // namespace hap::synth

#endif  // HAP_PLANNER_SYNTH_FORM_H_
