// Recurrent ops: lstm and gru, one layer and one direction of PyTorch's
// nn.LSTM and nn.GRU (the exporter stacks layers and directions,
// tools/fx_export/ops_lstm.py).
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/op_util.h"

namespace hap::graph::internal {

namespace {

// The shape rule shared by lstm and gru: x[b, s, i], w_ih[g*h, i],
// w_hh[g*h, h], b_ih[g*h]?, b_hh[g*h]? -> y[b, s, h] for `gates` stacked
// gates (named in `gate_names`, for errors).
absl::StatusOr<std::vector<TensorType>> InferRecurrent(const OpCall& c, int64_t gates,
                                                       const char* gate_names) {
  HAP_RETURN_IF_ERROR(ExpectFloating(c, 0));
  HAP_RETURN_IF_ERROR(ExpectRank(c, 0, 3));
  for (size_t i = 1; i < c.inputs.size(); ++i) {
    HAP_RETURN_IF_ERROR(ExpectSameDtype(c, 0, static_cast<int>(i)));
  }
  HAP_RETURN_IF_ERROR(ExpectRank(c, 1, 2));
  HAP_RETURN_IF_ERROR(ExpectRank(c, 2, 2));
  const int64_t b = c.shape(0)[0], s = c.shape(0)[1], in = c.shape(0)[2];
  const int64_t h = c.shape(2)[1];
  if (h < 1 || c.shape(2)[0] != gates * h) {
    return absl::InvalidArgumentError(absl::StrCat(c.Describe(2), " must be [", gates,
                                                   " * hidden, hidden] (gates ", gate_names, ")"));
  }
  if (c.shape(1) != Shape{gates * h, in}) {
    return absl::InvalidArgumentError(absl::StrCat(c.Describe(1), " must have shape ",
                                                   ShapeString({gates * h, in}), " (", gates,
                                                   " * hidden, the input features of x)"));
  }
  for (size_t i = 3; i < c.inputs.size(); ++i) {
    if (c.shape(static_cast<int>(i)) != Shape{gates * h}) {
      return absl::InvalidArgumentError(absl::StrCat(c.Describe(static_cast<int>(i)),
                                                     " must have shape ", ShapeString({gates * h}),
                                                     " (", gates, " * hidden)"));
    }
  }
  HAP_RETURN_IF_ERROR(c.attrs.Bool("reverse", false).status());
  return std::vector<TensorType>{{c.in(0).dtype, {b, s, h}}};
}

// Per step and sample: the input and recurrent products (g*h x (i + h)
// multiply-adds) and `per_unit` operations per hidden unit for the gates.
double RecurrentFlops(const OpCall& c, double gates, double per_unit) {
  const double bs = static_cast<double>(c.shape(0)[0] * c.shape(0)[1]);
  const double in = static_cast<double>(c.shape(0)[2]);
  const double h = static_cast<double>(c.shape(2)[1]);
  return bs * (2.0 * gates * h * (in + h) + per_unit * h);
}

}  // namespace

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
  d.infer = [](const OpCall& c) { return InferRecurrent(c, 4, "i, f, g, o"); };
  d.flops = [](const OpCall& c) { return RecurrentFlops(c, 4, 12); };
  // The backward kernel recomputes the forward (the gates it needs are not
  // kept between the passes), then runs the products of the gradients.
  d.backward_flops_multiple = 3.0;
  r.Register(d);

  d.type = "gru";
  d.summary =
      "gru(x[b, s, i], w_ih[3h, i], w_hh[3h, h], b_ih[3h]?, b_hh[3h]?; "
      "reverse=false) -> y[b, s, h]: one GRU layer from a zero state, "
      "PyTorch's gates (r, z, n; n = tanh(x W_in^T + b_in + r * (h W_hn^T + "
      "b_hn)), h' = (1 - z) * n + z * h); y[:, t] is the hidden state after "
      "step t (reverse: the sequence is read from its end)";
  d.infer = [](const OpCall& c) { return InferRecurrent(c, 3, "r, z, n"); };
  d.flops = [](const OpCall& c) { return RecurrentFlops(c, 3, 10); };
  r.Register(std::move(d));
}

}  // namespace hap::graph::internal
