#include "planner/service/metrics/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/utf8.h"

namespace hap::metrics {
namespace {

// std::atomic<double>::fetch_add is C++20.
void AtomicAdd(std::atomic<double>& target, double delta) {
  double current = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(current, current + delta,
                                       std::memory_order_relaxed)) {
  }
}

bool IsAsciiLetter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

// [a-zA-Z_:][a-zA-Z0-9_:]*
bool IsValidMetricName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok =
        IsAsciiLetter(c) || c == '_' || c == ':' || (i > 0 && IsAsciiDigit(c));
    if (!ok) return false;
  }
  return true;
}

// [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__".
bool IsValidLabelName(absl::string_view name) {
  if (name.empty() || absl::StartsWith(name, "__")) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (!(IsAsciiLetter(c) || c == '_' || (i > 0 && IsAsciiDigit(c)))) {
      return false;
    }
  }
  return true;
}

// Well-formed UTF-8: no stray continuation bytes, overlong forms,
// surrogates or code points above U+10FFFF.
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[len] || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

absl::Status CheckLabelValues(const internal::FamilyBase& family,
                              const std::vector<std::string>& values) {
  if (values.size() != family.label_names().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metric ", family.name(), " takes ", family.label_names().size(),
        " label values (", absl::StrJoin(family.label_names(), ", "), "), got ",
        values.size()));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!IsValidUtf8(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", family.name(), ": value of label ",
                       family.label_names()[i], " is not valid UTF-8"));
    }
  }
  return absl::OkStatus();
}

bool FitsLabelValues(const std::vector<std::string>& values, size_t max_bytes) {
  for (const std::string& v : values) {
    if (v.size() > max_bytes) return false;
  }
  return true;
}

std::vector<std::string> TruncateLabelValues(
    const std::vector<std::string>& values, size_t max_bytes) {
  std::vector<std::string> out;
  out.reserve(values.size());
  for (const std::string& v : values)
    out.push_back(TruncateLabelValue(v, max_bytes));
  return out;
}

// Appends `name{l1="v1",...,le="bound"} value\n` (no braces without labels).
void AppendSample(std::string* out, absl::string_view name,
                  const std::vector<std::string>& label_names,
                  const std::vector<std::string>& label_values,
                  const std::string* le, absl::string_view value) {
  absl::StrAppend(out, name);
  if (!label_names.empty() || le != nullptr) {
    out->push_back('{');
    for (size_t i = 0; i < label_names.size(); ++i) {
      if (i > 0) out->push_back(',');
      absl::StrAppend(out, label_names[i], "=\"",
                      EscapeLabelValue(label_values[i]), "\"");
    }
    if (le != nullptr) {
      if (!label_names.empty()) out->push_back(',');
      absl::StrAppend(out, "le=\"", *le, "\"");
    }
    out->push_back('}');
  }
  absl::StrAppend(out, " ", value, "\n");
}

void AppendChild(std::string* out, const internal::FamilyBase& family,
                 const std::vector<std::string>& values, const Counter& c) {
  AppendSample(out, family.name(), family.label_names(), values, nullptr,
               FormatValue(c.Value()));
}

void AppendChild(std::string* out, const internal::FamilyBase& family,
                 const std::vector<std::string>& values, const Gauge& g) {
  AppendSample(out, family.name(), family.label_names(), values, nullptr,
               FormatValue(g.Value()));
}

void AppendChild(std::string* out, const internal::FamilyBase& family,
                 const std::vector<std::string>& values, const Histogram& h) {
  const Histogram::Snapshot snap = h.Collect();
  const std::string bucket = absl::StrCat(family.name(), "_bucket");
  for (size_t i = 0; i <= snap.bounds.size(); ++i) {
    const std::string le = i < snap.bounds.size() ? FormatValue(snap.bounds[i])
                                                  : std::string("+Inf");
    AppendSample(out, bucket, family.label_names(), values, &le,
                 absl::StrCat(snap.cumulative[i]));
  }
  AppendSample(out, absl::StrCat(family.name(), "_sum"), family.label_names(),
               values, nullptr, FormatValue(snap.sum));
  AppendSample(out, absl::StrCat(family.name(), "_count"), family.label_names(),
               values, nullptr, absl::StrCat(snap.count));
}

// A gauge family whose rows a callback computes at scrape time.
class CallbackGaugeFamily final : public internal::FamilyBase {
 public:
  CallbackGaugeFamily(std::string name, std::string help,
                      std::vector<std::string> label_names,
                      std::function<std::vector<LabeledValue>()> rows,
                      size_t max_rows, size_t max_value_bytes)
      : FamilyBase(std::move(name), std::move(help), "gauge",
                   std::move(label_names)),
        rows_(std::move(rows)),
        max_rows_(max_rows),
        max_value_bytes_(max_value_bytes) {}

 private:
  void WriteSamples(std::string* out) const override {
    std::map<std::vector<std::string>, double> sorted;
    for (LabeledValue& row : rows_()) {
      if (sorted.size() >= max_rows_) break;
      if (!CheckLabelValues(*this, row.label_values).ok()) continue;
      if (!FitsLabelValues(row.label_values, max_value_bytes_)) {
        row.label_values =
            TruncateLabelValues(row.label_values, max_value_bytes_);
      }
      sorted.emplace(std::move(row.label_values), row.value);
    }
    for (const auto& [values, value] : sorted) {
      AppendSample(out, name(), label_names(), values, nullptr,
                   FormatValue(value));
    }
  }

  const std::function<std::vector<LabeledValue>()> rows_;
  const size_t max_rows_;
  const size_t max_value_bytes_;
};

// Validates bucket bounds and drops a trailing +Inf.
absl::StatusOr<std::vector<double>> CheckBuckets(absl::string_view name,
                                                 std::vector<double> bounds) {
  if (!bounds.empty() &&
      bounds.back() == std::numeric_limits<double>::infinity()) {
    bounds.pop_back();
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram ", name, ": bucket bound ",
                       FormatValue(bounds[i]), " is not finite"));
    }
    if (i > 0 && !(bounds[i] > bounds[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram ", name, ": bucket bounds must increase strictly, got ",
          FormatValue(bounds[i - 1]), " then ", FormatValue(bounds[i])));
    }
  }
  return bounds;
}

}  // namespace

std::vector<double> DefaultDurationBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
          1,     2.5,    5,     10,   30,    60,   120, 300};
}

absl::StatusOr<std::vector<double>> ExponentialBuckets(double start,
                                                       double factor,
                                                       int count) {
  if (!(start > 0) || !(factor > 1) || count < 1 || !std::isfinite(start) ||
      !std::isfinite(factor)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "exponential buckets need start > 0, factor > 1 and count >= 1; got ",
        FormatValue(start), ", ", FormatValue(factor), ", ", count));
  }
  std::vector<double> bounds;
  bounds.reserve(count);
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
  return bounds;
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // The fewest significant digits that read back exactly (17 always do).
  int digits = 17;
  for (int p = 1; p < 17; ++p) {
    double back;
    if (absl::SimpleAtod(absl::StrFormat("%.*g", p, value), &back) &&
        back == value) {
      digits = p;
      break;
    }
  }
  // Printed with at least 6 so that %g keeps "10" and "123456" out of
  // exponent form (as Go's client does). The extra digits come out as
  // zeros, which %g drops: the value lies within about 1e-16 (relative) of
  // its short form, far below the 6th digit.
  return absl::StrFormat("%.*g", std::max(digits, 6), value);
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// ---- Counter, Gauge, Histogram -------------------------------------------

void Counter::Increment(double delta) {
  if (!(delta >= 0)) return;  // negative or NaN
  AtomicAdd(value_, delta);
}

double Counter::Value() const { return value_.load(std::memory_order_relaxed); }

void Gauge::Set(double value) {
  value_.store(value, std::memory_order_relaxed);
}
void Gauge::Increment(double delta) { AtomicAdd(value_, delta); }
void Gauge::Decrement(double delta) { AtomicAdd(value_, -delta); }
double Gauge::Value() const { return value_.load(std::memory_order_relaxed); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  // The first bound >= value ("le"); past the end means +Inf.
  const size_t bucket =
      std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, value);
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot snap;
  snap.bounds = bounds_;
  snap.cumulative.resize(bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    snap.cumulative[i] = running;
  }
  snap.count = running;
  snap.sum = sum_.load(std::memory_order_relaxed);
  return snap;
}

// ---- Families ------------------------------------------------------------

namespace internal {

FamilyBase::FamilyBase(std::string name, std::string help, std::string type,
                       std::vector<std::string> label_names)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(std::move(type)),
      label_names_(std::move(label_names)) {}

void FamilyBase::Write(std::string* out) const {
  std::string samples;
  WriteSamples(&samples);
  if (samples.empty()) return;
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n",
                  "# TYPE ", name_, " ", type_, "\n", samples);
}

}  // namespace internal

template <typename Metric>
Family<Metric>::Family(std::string name, std::string help, std::string type,
                       std::vector<std::string> label_names, Factory factory,
                       size_t max_children, size_t max_value_bytes)
    : FamilyBase(std::move(name), std::move(help), std::move(type),
                 std::move(label_names)),
      factory_(std::move(factory)),
      max_children_(max_children),
      max_value_bytes_(max_value_bytes) {}

template <typename Metric>
absl::StatusOr<Metric*> Family<Metric>::Get(
    const std::vector<std::string>& values) {
  HAP_RETURN_IF_ERROR(CheckLabelValues(*this, values));
  std::vector<std::string> cut;
  const std::vector<std::string>* label_values = &values;
  if (!FitsLabelValues(values, max_value_bytes_)) {
    cut = TruncateLabelValues(values, max_value_bytes_);
    label_values = &cut;
  }
  return GetChecked(*label_values);
}

template <typename Metric>
absl::StatusOr<Metric*> Family<Metric>::GetChecked(
    const std::vector<std::string>& label_values) {
  absl::MutexLock lock(&mu_);
  auto it = children_.find(label_values);
  if (it != children_.end()) return it->second.get();
  if (children_.size() >= max_children_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("metric ", name(), " already has ", children_.size(),
                     " label sets, its bound; refusing a new one (",
                     absl::StrJoin(label_values, ", "),
                     "): a label is likely taking unbounded values"));
  }
  Metric* child = factory_().release();
  children_.emplace(label_values, std::unique_ptr<Metric>(child));
  return child;
}

template <typename Metric>
void Family<Metric>::WriteSamples(std::string* out) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [values, child] : children_) {
    AppendChild(out, *this, values, *child);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---- Registry ------------------------------------------------------------

MetricsRegistry::MetricsRegistry(MetricsRegistryOptions options)
    : options_(options) {}

absl::Status MetricsRegistry::AddFamilyBase(
    std::unique_ptr<internal::FamilyBase> family) {
  const std::string& name = family->name();
  const std::string& type = family->type();
  if (!IsValidMetricName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric name \"", EscapeLabelValue(name),
                     "\" does not match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  if (family->help().empty() || !IsValidUtf8(family->help())) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", name, ": help text must be non-empty UTF-8"));
  }
  const bool is_counter = type == "counter";
  const bool is_histogram = type == "histogram";
  if (is_counter != absl::EndsWith(name, "_total")) {
    return absl::InvalidArgumentError(
        is_counter ? absl::StrCat("counter name ", name, " must end in _total")
                   : absl::StrCat(type, " name ", name,
                                  " must not end in _total (counters only)"));
  }
  if (!is_histogram) {
    for (absl::string_view suffix : {"_bucket", "_sum", "_count"}) {
      if (absl::EndsWith(name, suffix)) {
        return absl::InvalidArgumentError(
            absl::StrCat(type, " name ", name, " must not end in ", suffix,
                         " (a histogram's sample suffix)"));
      }
    }
  }
  std::set<absl::string_view> seen;
  for (const std::string& label : family->label_names()) {
    if (!IsValidLabelName(label)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metric ", name, ": label name \"", EscapeLabelValue(label),
          "\" does not match [a-zA-Z_][a-zA-Z0-9_]* or starts with __"));
    }
    if (is_histogram && label == "le") {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram ", name, ": label name le is reserved for buckets"));
    }
    if (!seen.insert(label).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": label ", label, " repeated"));
    }
  }
  std::vector<std::string> names = {name};
  if (is_histogram) {
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      names.push_back(absl::StrCat(name, suffix));
    }
  }

  absl::MutexLock lock(&mu_);
  for (const std::string& n : names) {
    if (taken_names_.count(n) > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metric ", name, " is already registered or collides with ", n));
    }
  }
  taken_names_.insert(names.begin(), names.end());
  families_.emplace(name, std::move(family));
  return absl::OkStatus();
}

template <typename Metric>
absl::StatusOr<Family<Metric>*> MetricsRegistry::AddFamily(
    absl::string_view name, absl::string_view help, absl::string_view type,
    std::vector<std::string> label_names,
    typename Family<Metric>::Factory factory) {
  auto family = std::make_unique<Family<Metric>>(
      std::string(name), std::string(help), std::string(type),
      std::move(label_names), std::move(factory),
      options_.max_label_sets_per_family,
      std::max<size_t>(options_.max_label_value_bytes, 4));
  Family<Metric>* raw = family.get();
  HAP_RETURN_IF_ERROR(AddFamilyBase(std::move(family)));
  return raw;
}

absl::StatusOr<Family<Counter>*> MetricsRegistry::AddCounterFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names) {
  return AddFamily<Counter>(name, help, "counter", std::move(label_names),
                            [] { return std::make_unique<Counter>(); });
}

absl::StatusOr<Family<Gauge>*> MetricsRegistry::AddGaugeFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names) {
  return AddFamily<Gauge>(name, help, "gauge", std::move(label_names),
                          [] { return std::make_unique<Gauge>(); });
}

absl::StatusOr<Family<Histogram>*> MetricsRegistry::AddHistogramFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names, std::vector<double> buckets) {
  HAP_ASSIGN_OR_RETURN(std::vector<double> bounds,
                       CheckBuckets(name, std::move(buckets)));
  return AddFamily<Histogram>(
      name, help, "histogram", std::move(label_names),
      [bounds] { return std::make_unique<Histogram>(bounds); });
}

absl::StatusOr<Counter*> MetricsRegistry::AddCounter(absl::string_view name,
                                                     absl::string_view help) {
  HAP_ASSIGN_OR_RETURN(Family<Counter>* family,
                       AddCounterFamily(name, help, {}));
  return family->Get({});
}

absl::StatusOr<Gauge*> MetricsRegistry::AddGauge(absl::string_view name,
                                                 absl::string_view help) {
  HAP_ASSIGN_OR_RETURN(Family<Gauge>* family, AddGaugeFamily(name, help, {}));
  return family->Get({});
}

absl::StatusOr<Histogram*> MetricsRegistry::AddHistogram(
    absl::string_view name, absl::string_view help,
    std::vector<double> buckets) {
  HAP_ASSIGN_OR_RETURN(Family<Histogram>* family,
                       AddHistogramFamily(name, help, {}, std::move(buckets)));
  return family->Get({});
}

absl::Status MetricsRegistry::AddCallbackGauge(absl::string_view name,
                                               absl::string_view help,
                                               std::function<double()> value) {
  if (!value) {
    return absl::InvalidArgumentError(
        absl::StrCat("callback gauge ", name, ": no callback"));
  }
  return AddCallbackGaugeFamily(name, help, {}, [value = std::move(value)] {
    return std::vector<LabeledValue>{{{}, value()}};
  });
}

absl::Status MetricsRegistry::AddCallbackGaugeFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names,
    std::function<std::vector<LabeledValue>()> rows) {
  if (!rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("callback gauge ", name, ": no callback"));
  }
  return AddFamilyBase(std::make_unique<CallbackGaugeFamily>(
      std::string(name), std::string(help), std::move(label_names),
      std::move(rows), options_.max_label_sets_per_family,
      std::max<size_t>(options_.max_label_value_bytes, 4)));
}

std::string MetricsRegistry::Serialize() const {
  // Families are never removed, so the pointers outlive the lock; writing
  // without it lets callbacks use the registry.
  std::vector<const internal::FamilyBase*> families;
  {
    absl::MutexLock lock(&mu_);
    families.reserve(families_.size());
    for (const auto& [name, family] : families_)
      families.push_back(family.get());
  }
  std::string out;
  for (const internal::FamilyBase* family : families) family->Write(&out);
  return out;
}

std::string TruncateLabelValue(absl::string_view value, size_t max_bytes) {
  return CutUtf8(value, max_bytes);
}

}  // namespace hap::metrics
