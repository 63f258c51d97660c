#include "executor/data/batches.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "executor/runtime/random.h"

namespace hap::data {
namespace {

using executor::CounterKey;
using executor::CounterNormal;
using executor::CounterUniform;
using executor::HashName;

// The number of distinct values an integer input may take (2 when no
// consumer says).
int64_t IdRange(const graph::Graph& g, graph::TensorId t) {
  std::optional<IdLimit> l = IntegerInputLimit(g, t);
  return l ? l->limit : 2;
}

template <typename T>
void FillIds(HostTensor& h, uint64_t key, int64_t range) {
  T* p = h.as<T>();
  for (int64_t i = 0; i < h.num_elements(); ++i) {
    p[i] = static_cast<T>(static_cast<int64_t>(CounterUniform(key, i) * range) % range);
  }
}

template <typename T>
void FillNormal(HostTensor& h, uint64_t key) {
  T* p = h.as<T>();
  for (int64_t i = 0; i < h.num_elements(); ++i) {
    p[i] = static_cast<T>(CounterNormal(key, i));
  }
}

class Synthetic : public BatchSource {
 public:
  Synthetic(const graph::Graph& g, uint64_t seed) : g_(g), seed_(seed) {}
  absl::StatusOr<GlobalBatch> Get(int64_t step) override {
    GlobalBatch b;
    for (graph::TensorId t : g_.Inputs()) {
      const graph::Tensor& x = g_.tensor(t);
      HostTensor h(x.type.dtype, x.type.shape);
      uint64_t key = CounterKey(seed_, HashName(x.name), static_cast<uint64_t>(step));
      switch (x.type.dtype) {
        case graph::DType::kInt64:
          FillIds<int64_t>(h, key, IdRange(g_, t));
          break;
        case graph::DType::kInt32:
          FillIds<int32_t>(h, key, IdRange(g_, t));
          break;
        case graph::DType::kFloat64:
          FillNormal<double>(h, key);
          break;
        case graph::DType::kFloat32:
          FillNormal<float>(h, key);
          break;
        default:
          return absl::UnimplementedError(absl::StrCat(
              "synthetic data for input '", x.name, "' of dtype ",
              graph::DTypeName(x.type.dtype)));
      }
      b.emplace(x.name, std::move(h));
    }
    return b;
  }

 private:
  const graph::Graph& g_;
  uint64_t seed_;
};

// The corpus is read as a loop: the token after its last is its first, so
// every token is an input and a label (the next-token pairs (k, k + 1 mod
// N)), each equally often over N steps whatever B, S and N. WikiText's last
// token is the <eos> of its last line, so the pair that closes the loop is
// an end of line and the first line's start, as between any two lines.
// (Windows that stopped at the end, starts mod N - S - 1, never read the
// last token, and when S shared a factor with N - S - 1 they never read
// the last few.)
class Lm : public BatchSource {
 public:
  Lm(std::vector<int64_t> corpus, int64_t batch, int64_t seq)
      : corpus_(std::move(corpus)), batch_(batch), seq_(seq) {
    stride_ = std::max<int64_t>(1, size() / batch_);
  }
  int64_t data_size() const override { return size(); }
  absl::StatusOr<GlobalBatch> Get(int64_t step) override {
    // The step comes from a checkpoint when a run resumes.
    if (step < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
    }
    if (step > std::numeric_limits<int64_t>::max() / seq_) {
      return absl::OutOfRangeError(
          absl::StrCat("step ", step, " times the sequence length ", seq_, " overflows 64 bits"));
    }
    // (i * stride + step * S) mod N, without overflowing the sum.
    const int64_t n = size();
    const int64_t step_start = step * seq_ % n;
    HostTensor tokens(graph::DType::kInt64, {batch_, seq_});
    HostTensor labels(graph::DType::kInt64, {batch_ * seq_});
    int64_t* t = tokens.as<int64_t>();
    int64_t* l = labels.as<int64_t>();
    for (int64_t i = 0; i < batch_; ++i) {
      int64_t at = (i * stride_ % n + step_start) % n;
      for (int64_t j = 0; j < seq_; ++j) {
        const int64_t next = at + 1 == n ? 0 : at + 1;
        t[i * seq_ + j] = corpus_[at];
        l[i * seq_ + j] = corpus_[next];
        at = next;
      }
    }
    GlobalBatch b;
    b.emplace("tokens", std::move(tokens));
    b.emplace("labels", std::move(labels));
    return b;
  }

 private:
  int64_t size() const { return static_cast<int64_t>(corpus_.size()); }

  std::vector<int64_t> corpus_;
  int64_t batch_, seq_, stride_ = 1;
};

}  // namespace

std::optional<IdLimit> IntegerInputLimit(const graph::Graph& g, graph::TensorId t) {
  // The ids reach an embedding or a loss directly or through ops that only
  // move them (the exporter's labels.view(-1) is a reshape).
  static const std::set<std::string> kMoves = {"reshape", "flatten", "transpose", "slice",
                                               "split",   "concat",  "expand"};
  std::optional<IdLimit> best;
  std::vector<graph::TensorId> work = {t};
  std::set<graph::TensorId> seen = {t};
  while (!work.empty()) {
    const graph::TensorId x = work.back();
    work.pop_back();
    for (graph::OpId c : g.tensor(x).consumers) {
      const graph::Op& op = g.op(c);
      IdLimit l;
      if (op.type == "embedding" && op.inputs[0] == x) {
        l.limit = g.tensor(op.inputs[1]).type.shape[0];
        l.source = absl::StrCat("the vocabulary of ", l.limit, " of embedding '", op.name, "'");
      } else if ((op.type == "nll_loss" || op.type == "cross_entropy") && op.inputs[1] == x) {
        l.limit = g.tensor(op.inputs[0]).type.shape[1];
        l.source = absl::StrCat("the ", l.limit, " classes of ", op.type, " '", op.name, "'");
      } else {
        if (kMoves.count(op.type)) {
          for (graph::TensorId y : op.outputs) {
            if (seen.insert(y).second) work.push_back(y);
          }
        }
        continue;
      }
      if (!best || l.limit < best->limit) best = std::move(l);
    }
  }
  return best;
}

std::unique_ptr<BatchSource> NewSyntheticBatches(const graph::Graph& g, uint64_t seed) {
  return std::make_unique<Synthetic>(g, seed);
}

absl::StatusOr<std::unique_ptr<BatchSource>> NewLmBatches(
    const graph::Graph& g, std::vector<int64_t> corpus) {
  auto tokens = g.FindTensor("tokens");
  auto labels = g.FindTensor("labels");
  if (!tokens || !labels || g.tensor(*tokens).type.rank() != 2 ||
      !graph::IsInteger(g.tensor(*tokens).type.dtype) ||
      g.tensor(*tokens).type.dtype != graph::DType::kInt64 ||
      g.tensor(*labels).type.dtype != graph::DType::kInt64 ||
      g.tensor(*labels).type.shape != graph::Shape{g.tensor(*tokens).type.num_elements()}) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", g.name(),
        "' is not a language model with int64 inputs tokens[B, S] and labels[B*S]"));
  }
  int64_t b = g.tensor(*tokens).type.shape[0], s = g.tensor(*tokens).type.shape[1];
  if (static_cast<int64_t>(corpus.size()) < s + 1) {
    return absl::InvalidArgumentError(absl::StrCat("the corpus has ", corpus.size(),
                                                   " tokens, fewer than a sequence of ", s,
                                                   " and the token after it"));
  }
  // Every corpus token is also a label: the tighter of the vocabulary and
  // the loss's classes.
  int64_t vocab = IdRange(g, *tokens);
  if (auto l = IntegerInputLimit(g, *labels)) vocab = std::min(vocab, l->limit);
  for (size_t i = 0; i < corpus.size(); ++i) {
    if (corpus[i] < 0 || corpus[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "corpus token ", i, " has id ", corpus[i],
          ", outside the model's vocabulary (and the classes of its loss) of ", vocab));
    }
  }
  return std::unique_ptr<BatchSource>(std::make_unique<Lm>(std::move(corpus), b, s));
}

}  // namespace hap::data
