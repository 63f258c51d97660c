// Recurrent ops: lstm, one layer and one direction of PyTorch's nn.LSTM
// (the exporter stacks layers and directions, tools/export_fx.py).
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {

void RegisterLstmOps(OpRegistry& r) {
  OpDef d;
  d.type = "lstm";
  d.attrs = {"reverse"};
  d.summary =
      "lstm(x[b, s, i], w_ih[4h, i], w_hh[4h, h], b_ih[4h]?, b_hh[4h]?; "
      "reverse=false) -> y[b, s, h]: one LSTM layer from a zero state, "
      "PyTorch's gate order (i, f, g, o); y[:, t] is the hidden state after "
      "step t (reverse: the sequence is read from its end)";
  d.min_inputs = 3;
  d.max_inputs = 5;
  d.infer = [](const OpCall& c) -> absl::StatusOr<std::vector<TensorType>> {
    HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
    HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 3));
    for (size_t i = 1; i < c.inputs.size(); ++i) {
      HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, static_cast<int>(i)));
    }
    HAP_RETURN_IF_ERROR(ExpectRank(c, 1, 2));
    HAP_RETURN_IF_ERROR(ExpectRank(c, 2, 2));
    const int64_t b = c.shape(0)[0], s = c.shape(0)[1], in = c.shape(0)[2];
    const int64_t h = c.shape(2)[1];
    if (h < 1 || c.shape(2)[0] != 4 * h) {
      return absl::InvalidArgumentError(
          absl::StrCat(c.Describe(2), " must be [4 * hidden, hidden] (gates i, f, g, o)"));
    }
    if (c.shape(1) != Shape{4 * h, in}) {
      return absl::InvalidArgumentError(absl::StrCat(c.Describe(1), " must have shape ",
                                                     ShapeString({4 * h, in}),
                                                     " (4 * hidden, the input features of x)"));
    }
    for (size_t i = 3; i < c.inputs.size(); ++i) {
      if (c.shape(static_cast<int>(i)) != Shape{4 * h}) {
        return absl::InvalidArgumentError(absl::StrCat(c.Describe(static_cast<int>(i)),
                                                       " must have shape ", ShapeString({4 * h}),
                                                       " (4 * hidden)"));
      }
    }
    HAP_RETURN_IF_ERROR(c.attrs.Bool("reverse", false).status());
    return std::vector<TensorType>{{c.in(0).dtype, {b, s, h}}};
  };
  // Per step and sample: the input and recurrent products (4h x (i + h)
  // multiply-adds) and about 12 operations per hidden unit for the gates.
  d.flops = [](const OpCall& c) {
    const double bs = static_cast<double>(c.shape(0)[0] * c.shape(0)[1]);
    const double in = static_cast<double>(c.shape(0)[2]);
    const double h = static_cast<double>(c.shape(2)[1]);
    return bs * (2.0 * 4 * h * (in + h) + 12.0 * h);
  };
  // The backward kernel recomputes the forward (the gates it needs are not
  // kept between the passes), then runs the products of the gradients.
  d.backward_flops_multiple = 3.0;
  r.Register(std::move(d));
}

}  // namespace hap::graph::internal
