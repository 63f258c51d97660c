// The optimizer steps (and gradient clipping's norms).
// Part of lower::internal::RankBuilder (rank_builder.h).

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/lower/rank_builder.h"

namespace hap::lower::internal {

void RankBuilder::Optimizer() {
  const auto O = v1::Step::OPTIMIZER;
  const v1::OptimizerConfig& cfg = o_.optimizer;
  std::vector<const ParamSlot*> live;
  for (const ParamSlot& p : params_) {
    if (HasGrad(p.storage)) live.push_back(&p);
  }
  int norm = -1;
  if (cfg.clip_global_norm() > 0 && !live.empty()) {
    norm = NewNorm();
    Fill(O, norm, 0.0);
    // Every gradient replicated (synchronised): each rank sums them all
    // itself, in the same order, and needs no all-reduce.
    // A pipeline stage's norm is summed over stages afterwards: always
    // all-reduced in the group, each gradient counted once.
    bool all_replicated = st_ == nullptr;
    for (const ParamSlot* p : live) all_replicated = all_replicated && p->replicated;
    for (const ParamSlot* p : live) {
      // Otherwise a replicated parameter counts once: on rank 0.
      if (!all_replicated && p->replicated && r_ != 0) continue;
      Kernel(O, "sq_norm", {grad_.at(p->storage)}, {norm});
    }
    if (!all_replicated) Coll(O, v1::ALL_REDUCE, norm, norm, g_.loss());
  }
  bool adam = cfg.kind() == v1::OptimizerConfig::ADAM;
  for (const ParamSlot* p : live) {
    int param = fwd_.at(p->storage);
    int grad = grad_.at(p->storage);
    std::vector<int> in = {param, grad, norm};
    std::vector<int> out = {param};
    int8_t raw = p->storage.second;
    if (adam) {
      out.push_back(NewBuffer(p->tensor, raw, v1::Buffer::OPTIMIZER_STATE, "#adam_m"));
      out.push_back(NewBuffer(p->tensor, raw, v1::Buffer::OPTIMIZER_STATE, "#adam_v"));
    } else if (cfg.momentum() != 0) {
      out.push_back(NewBuffer(p->tensor, raw, v1::Buffer::OPTIMIZER_STATE, "#momentum"));
    }
    v1::KernelCall* k =
        Kernel(O, adam ? "adam_update" : "sgd_update", in, out, g_.tensor(p->tensor).name);
    auto& a = *k->mutable_attrs();
    a["learning_rate"].set_f(cfg.learning_rate());
    a["weight_decay"].set_f(cfg.weight_decay());
    a["clip_global_norm"].set_f(cfg.clip_global_norm());
    if (adam) {
      a["beta1"].set_f(cfg.has_beta1() ? cfg.beta1() : 0.9);
      a["beta2"].set_f(cfg.has_beta2() ? cfg.beta2() : 0.999);
      a["epsilon"].set_f(cfg.epsilon() != 0 ? cfg.epsilon() : 1e-8);
    } else {
      a["momentum"].set_f(cfg.momentum());
    }
  }
}

int RankBuilder::NewNorm() {
  v1::Buffer* b = prog_.add_buffers();
  int id = prog_.buffers_size() - 1;
  b->set_id(id);
  b->set_tensor("#global_grad_norm_sq");
  b->add_shape(1);
  b->add_global_shape(1);
  b->add_offsets(0);
  b->set_dtype(v1::FLOAT64);
  b->set_role(v1::Buffer::NORM);
  b->mutable_form()->set_kind(v1::TensorForm::REPLICATED);
  first_.push_back(std::numeric_limits<int>::max());
  last_.push_back(-1);
  return id;
}

}  // namespace hap::lower::internal
