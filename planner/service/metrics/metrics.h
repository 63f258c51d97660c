// A small Prometheus metrics library (prometheus-cpp is not packaged in
// Debian 12): a registry of metric families — counters, gauges, histograms
// and gauges computed at scrape time — written in the Prometheus text
// exposition format 0.0.4 by MetricsRegistry::Serialize().
//
//   MetricsRegistry registry;
//   HAP_ASSIGN_OR_RETURN(Family<Counter>* plans,
//       registry.AddCounterFamily("hap_plans_total", "Plans finished.",
//                                 {"result"}));
//   HAP_ASSIGN_OR_RETURN(Counter* ok, plans->Get({"ok"}));
//   ok->Increment();
//
// Naming rules, checked at registration (InvalidArgument otherwise):
//   - metric names match [a-zA-Z_:][a-zA-Z0-9_:]*, label names
//     [a-zA-Z_][a-zA-Z0-9_]* and do not start with "__" (reserved by
//     Prometheus); label names within a family are distinct; histograms may
//     not use the label "le";
//   - counter names end in "_total"; other kinds do not end in "_total",
//     and only histograms produce "_bucket", "_sum" and "_count" samples
//     (what `promtool check metrics` lints for);
//   - no two families share a name or a sample name (a histogram "x" owns
//     x_bucket, x_sum and x_count);
//   - help text is non-empty UTF-8; label values are UTF-8.
//
// Cardinality: each family holds at most
// MetricsRegistryOptions::max_label_sets_per_family children (label-value
// sets). Family::Get for a new set beyond the bound returns
// ResourceExhausted rather than a shared overflow child, so no series ever
// carries made-up label values; callers drop the observation (and may count
// the drop). Existing children keep working. Label values are bounded in
// length too: a value longer than
// MetricsRegistryOptions::max_label_value_bytes is cut (at a UTF-8
// character boundary) and ends in "...", so that one huge value (a 1 MiB
// model name) cannot grow every scrape by its size.
//
// Lifetime: families and children are owned by the registry and live as
// long as it does; pointers returned by Add*/Get stay valid until then, so
// callers look them up once and keep them.
//
// Thread safety: everything here is thread-safe. Counter, Gauge and
// Histogram updates are lock-free atomics; Family::Get and registration
// take short locks. Serialize() takes a consistent-enough snapshot: each
// histogram's "+Inf" bucket always equals its "_count".
#ifndef HAP_PLANNER_SERVICE_METRICS_METRICS_H_
#define HAP_PLANNER_SERVICE_METRICS_METRICS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace hap::metrics {

// Bucket upper bounds (seconds) for durations: Prometheus' client defaults
// (5 ms .. 10 s) extended down to 1 ms and up to 5 min, since plan searches
// run for minutes.
std::vector<double> DefaultDurationBuckets();

// `count` bounds start, start*factor, start*factor^2, ...
// InvalidArgument unless start > 0, factor > 1 and count >= 1.
absl::StatusOr<std::vector<double>> ExponentialBuckets(double start,
                                                       double factor,
                                                       int count);

// A value that only goes up (requests served, bytes sent).
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds `delta`. A negative or NaN delta is ignored: a counter never goes
  // down (Prometheus reads a decrease as a restart).
  void Increment(double delta = 1.0);
  double Value() const;

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down (queue length, last loss).
class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double value);
  void Increment(double delta = 1.0);
  void Decrement(double delta = 1.0);
  double Value() const;

 private:
  std::atomic<double> value_{0.0};
};

// Counts observations into buckets by upper bound (cumulative "le"
// buckets in the output, plus "+Inf"), with their sum and count.
class Histogram {
 public:
  // `bounds`: strictly increasing finite upper bounds (validated by the
  // registry; see MetricsRegistry::AddHistogramFamily).
  explicit Histogram(std::vector<double> bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Records `value`; NaN is ignored.
  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;
    // cumulative[i]: observations <= bounds[i]; one more entry at the end
    // for +Inf, which equals `count`.
    std::vector<uint64_t> cumulative;
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Collect() const;

 private:
  const std::vector<double> bounds_;
  // Per-bucket (non-cumulative) counts, bounds_.size() + 1 of them; the
  // total count is their sum, so "+Inf" and "_count" always agree.
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

namespace internal {

// What every family has; the registry serializes families through it.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, std::string type,
             std::vector<std::string> label_names);
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::string& type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // Appends "# HELP", "# TYPE" and the samples, children in label-value
  // order; nothing when the family has no children yet.
  void Write(std::string* out) const;

 protected:
  // Appends the sample lines only.
  virtual void WriteSamples(std::string* out) const = 0;

  const std::string name_;
  const std::string help_;
  const std::string type_;  // "counter", "gauge" or "histogram"
  const std::vector<std::string> label_names_;
};

}  // namespace internal

// The children of one metric: one Metric per set of label values.
// Metric is Counter, Gauge or Histogram.
template <typename Metric>
class Family final : public internal::FamilyBase {
 public:
  // Creates children; used by MetricsRegistry.
  using Factory = std::function<std::unique_ptr<Metric>()>;
  Family(std::string name, std::string help, std::string type,
         std::vector<std::string> label_names, Factory factory,
         size_t max_children, size_t max_value_bytes);

  // The child for `label_values` (one per label name, in the order they
  // were declared, each cut to max_value_bytes as TruncateLabelValue
  // does), created at zero on first use. InvalidArgument when the number
  // of values differs from the number of label names or a value is not
  // UTF-8; ResourceExhausted when the set is new and the family already
  // holds its maximum number of children.
  absl::StatusOr<Metric*> Get(const std::vector<std::string>& label_values);

 private:
  void WriteSamples(std::string* out) const override;
  // Get for values already checked and cut.
  absl::StatusOr<Metric*> GetChecked(
      const std::vector<std::string>& label_values);

  const Factory factory_;
  const size_t max_children_;
  const size_t max_value_bytes_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_
      ABSL_GUARDED_BY(mu_);
};

// One row of a labelled callback gauge.
struct LabeledValue {
  std::vector<std::string> label_values;
  double value = 0;
};

struct MetricsRegistryOptions {
  // The most label-value sets one family holds (see Family::Get); also the
  // most rows taken from one callback gauge family per scrape.
  size_t max_label_sets_per_family = 1000;
  // The longest label value kept whole, in bytes (see TruncateLabelValue);
  // also applied to callback gauge rows. At least 4.
  size_t max_label_value_bytes = 256;
};

class MetricsRegistry {
 public:
  explicit MetricsRegistry(MetricsRegistryOptions options = {});
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Register a family with the given label names. InvalidArgument on a bad
  // name, label name or help text, or a name already registered (see the
  // rules at the top of this file).
  absl::StatusOr<Family<Counter>*> AddCounterFamily(
      absl::string_view name, absl::string_view help,
      std::vector<std::string> label_names);
  absl::StatusOr<Family<Gauge>*> AddGaugeFamily(
      absl::string_view name, absl::string_view help,
      std::vector<std::string> label_names);
  // `buckets`: strictly increasing upper bounds, none NaN; a trailing +Inf
  // is dropped (it is always there); InvalidArgument otherwise.
  absl::StatusOr<Family<Histogram>*> AddHistogramFamily(
      absl::string_view name, absl::string_view help,
      std::vector<std::string> label_names,
      std::vector<double> buckets = DefaultDurationBuckets());

  // Unlabelled shorthands: register the family and return its only child,
  // which appears in the output (at zero) from now on.
  absl::StatusOr<Counter*> AddCounter(absl::string_view name,
                                      absl::string_view help);
  absl::StatusOr<Gauge*> AddGauge(absl::string_view name,
                                  absl::string_view help);
  absl::StatusOr<Histogram*> AddHistogram(
      absl::string_view name, absl::string_view help,
      std::vector<double> buckets = DefaultDurationBuckets());

  // A gauge whose value `value` computes at scrape time (e.g. live nodes).
  // `value` runs on the scraping thread, without the registry's lock held,
  // so it may use the registry's metrics but must be thread-safe.
  absl::Status AddCallbackGauge(absl::string_view name, absl::string_view help,
                                std::function<double()> value);
  // The labelled form: `rows` returns one row per label-value set. Rows of
  // the wrong arity or with non-UTF-8 values are left out, as are repeats
  // of a set (the first wins) and rows beyond max_label_sets_per_family.
  absl::Status AddCallbackGaugeFamily(
      absl::string_view name, absl::string_view help,
      std::vector<std::string> label_names,
      std::function<std::vector<LabeledValue>()> rows);

  // The Prometheus text exposition format 0.0.4: families sorted by name,
  // children sorted by label values; deterministic for equal values.
  std::string Serialize() const;

 private:
  template <typename Metric>
  absl::StatusOr<Family<Metric>*> AddFamily(
      absl::string_view name, absl::string_view help, absl::string_view type,
      std::vector<std::string> label_names,
      typename Family<Metric>::Factory factory);
  // Validates the family's names (see the rules at the top), reserves them
  // and takes ownership.
  absl::Status AddFamilyBase(std::unique_ptr<internal::FamilyBase> family);

  const MetricsRegistryOptions options_;
  mutable absl::Mutex mu_;
  // By name, so serialization is in name order.
  std::map<std::string, std::unique_ptr<internal::FamilyBase>> families_
      ABSL_GUARDED_BY(mu_);
  // Family names and the sample names histograms write (x_bucket, x_sum,
  // x_count), to refuse collisions.
  std::set<std::string> taken_names_ ABSL_GUARDED_BY(mu_);
};

// Exposed for tests and other writers of the text format.
// A sample value as Prometheus reads it: the shortest decimal that reads
// back to the same double, "+Inf", "-Inf" or "NaN".
std::string FormatValue(double value);
// Escapes for "# HELP" text (\\ and \n) and for label values (\\, \" and \n).
std::string EscapeHelp(absl::string_view help);
// `value` when it has at most `max_bytes` bytes (max_bytes >= 4); otherwise
// its longest prefix that ends on a UTF-8 character boundary and leaves
// room for "...", followed by "...".
std::string TruncateLabelValue(absl::string_view value, size_t max_bytes);
std::string EscapeLabelValue(absl::string_view value);

}  // namespace hap::metrics

#endif  // HAP_PLANNER_SERVICE_METRICS_METRICS_H_
