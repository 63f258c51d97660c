#include "planner/graph/test_util.h"

#include <algorithm>
#include <vector>

namespace hap::graph::testing {
namespace {

std::string ProducerName(const Graph& g, const Tensor& t) {
  return t.producer < 0 ? "" : g.op(t.producer).name;
}

std::vector<std::string> ConsumerNames(const Graph& g, const Tensor& t) {
  std::vector<std::string> out;
  for (OpId c : t.consumers) out.push_back(g.op(c).name);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> Names(const Graph& g,
                               const std::vector<TensorId>& ids) {
  std::vector<std::string> out;
  for (TensorId t : ids) out.push_back(g.tensor(t).name);
  return out;
}

const Op* FindOp(const Graph& g, const std::string& name) {
  for (const Op& op : g.ops()) {
    if (op.name == name) return &op;
  }
  return nullptr;
}

}  // namespace

void ExpectSameGraph(const Graph& a, const Graph& b) {
  EXPECT_EQ(a.name(), b.name());
  EXPECT_EQ(a.tensors().size(), b.tensors().size());
  for (const Tensor& x : a.tensors()) {
    SCOPED_TRACE("tensor " + x.name);
    auto id = b.FindTensor(x.name);
    ASSERT_TRUE(id.has_value());
    const Tensor& y = b.tensor(*id);
    EXPECT_EQ(x.type, y.type)
        << TypeString(x.type) << " vs " << TypeString(y.type);
    EXPECT_EQ(x.kind, y.kind);
    EXPECT_EQ(ProducerName(a, x), ProducerName(b, y));
    EXPECT_EQ(x.producer_output, y.producer_output);
    EXPECT_EQ(ConsumerNames(a, x), ConsumerNames(b, y));
    if (x.kind == TensorKind::kParameter) {
      EXPECT_EQ(x.init.kind, y.init.kind);
      EXPECT_EQ(x.init.value, y.init.value);
      EXPECT_EQ(x.init.mean, y.init.mean);
      EXPECT_EQ(x.init.stddev, y.init.stddev);
      EXPECT_EQ(x.init.low, y.init.low);
      EXPECT_EQ(x.init.high, y.init.high);
      EXPECT_EQ(x.init.values, y.init.values);
      EXPECT_EQ(x.init.counts, y.init.counts);
      EXPECT_EQ(x.frozen, y.frozen);
    }
    if (x.kind == TensorKind::kInput) {
      EXPECT_EQ(x.role, y.role);
    }
  }
  EXPECT_EQ(a.ops().size(), b.ops().size());
  for (const Op& x : a.ops()) {
    SCOPED_TRACE("op " + x.name);
    const Op* y = FindOp(b, x.name);
    ASSERT_NE(y, nullptr);
    EXPECT_EQ(x.type, y->type);
    EXPECT_EQ(Names(a, x.inputs), Names(b, y->inputs));
    EXPECT_EQ(Names(a, x.outputs), Names(b, y->outputs));
    EXPECT_EQ(x.attrs.values(), y->attrs.values());
    EXPECT_EQ(x.scope, y->scope);
  }
  EXPECT_EQ(a.tensor(a.loss()).name, b.tensor(b.loss()).name);
  EXPECT_EQ(a.metadata(), b.metadata());
  EXPECT_EQ(a.ParameterCount(), b.ParameterCount());
  EXPECT_EQ(a.TrainableParameterCount(), b.TrainableParameterCount());
  // Summation order follows the op order, which may differ.
  EXPECT_DOUBLE_EQ(a.ForwardFlops(), b.ForwardFlops());
  EXPECT_DOUBLE_EQ(a.TrainingFlops(), b.TrainingFlops());
}

}  // namespace hap::graph::testing
