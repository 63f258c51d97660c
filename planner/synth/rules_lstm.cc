// Rules of the recurrent ops (lstm, gru). An LSTM's or GRU's time steps depend on each other and
// every hidden unit of a step feeds every gate of the next, so neither the
// sequence nor the hidden units split without a collective per step; the
// samples are independent: data parallel over the batch (the weights'
// gradients come out partial and are summed like any shared weight's).
#include "planner/synth/rules.h"

namespace hap::synth::internal {
namespace {

void Recurrent(const RuleInput& x, std::vector<ShardRule>& r) {
  // x[b, s, i], w_ih, w_hh, b_ih?, b_hh? -> y[b, s, h].
  if (!x.Shardable(x.in(0)[0])) return;
  std::vector<Form> in(x.num_inputs(), Form::R());
  in[0] = Form::S(0);
  r.push_back(MakeRule("data(0)", RuleKind::kData, std::move(in), {Form::S(0)}, true));
}

}  // namespace

RuleFn RecurrentRules(const std::string& t) {
  if (t == "lstm" || t == "gru") return Recurrent;
  return nullptr;
}

}  // namespace hap::synth::internal
