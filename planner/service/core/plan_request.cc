// What a plan request's model and options must hold beyond what the
// planner converts them by (ConvertOptions, planner_core.cc): the model
// built from a zoo name or a graph at the request's batch, and no option
// given that nothing would read.
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/graph/graph_proto.h"
#include "planner/graph/zoo.h"
#include "planner/service/core/planner_core.h"

namespace hap::service {

namespace v1 = ::hap::v1;

absl::StatusOr<graph::Graph> PlannerCore::BuildModel(const v1::ModelSpec& model,
                                                     int64_t global_batch, int devices) {
  if (model.has_zoo()) {
    std::map<std::string, double> params(model.zoo().params().begin(), model.zoo().params().end());
    const std::string& zoo = model.zoo().name();
    if (global_batch > 0) params["batch"] = static_cast<double>(global_batch);
    if (!params.count("batch")) params["batch"] = 32.0 * devices;
    if ((zoo == "moe" || zoo == "switch") && !params.count("experts")) {
      params["experts"] = 2.0 * devices;
    }
    auto g = graph::BuildZooModel(zoo, params);
    if (!g.ok()) return Annotate(g.status(), "model.zoo");
    return g;
  }
  if (model.has_graph()) {
    auto g = graph::FromProto(model.graph());
    if (!g.ok()) return Annotate(g.status(), "model.graph");
    const std::vector<graph::TensorId> inputs = g->Inputs();
    if (global_batch > 0 && !inputs.empty()) {
      // The batch is dimension 0 of the first input, which may have none.
      const graph::Tensor& first = g->tensor(inputs.front());
      if (first.type.rank() < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "global_batch ", global_batch, " is given but the graph's first input '", first.name,
            "' is a scalar, with no batch dimension (leave global_batch 0)"));
      }
      if (first.type.shape[0] != global_batch) {
        return absl::InvalidArgumentError(absl::StrCat(
            "global_batch ", global_batch, " differs from the graph's batch ", first.type.shape[0],
            " (graphs have concrete shapes; export the graph at that batch)"));
      }
    }
    return g;
  }
  return absl::InvalidArgumentError("model is required: a graph or a zoo model");
}

absl::Status PlannerCore::CheckBatchGivenOnce(const v1::ModelSpec& model, int64_t global_batch) {
  if (!model.has_zoo() || global_batch <= 0) return absl::OkStatus();
  auto it = model.zoo().params().find("batch");
  if (it == model.zoo().params().end() || it->second == static_cast<double>(global_batch)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("global_batch ", global_batch, " differs from model.zoo.params[\"batch\"] ",
                   it->second, ": give the batch once (global_batch, or the zoo model's batch)"));
}

absl::Status PlannerCore::CheckNewPlanOptions(const v1::PlanOptions& options) {
  HAP_RETURN_IF_ERROR(CheckPlanOptions(options));
  const v1::OptimizerConfig& o = options.optimizer();
  if (o.kind() == v1::OptimizerConfig::ADAM && o.momentum() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.optimizer.momentum (", o.momentum(),
        ") is SGD's; ADAM keeps its own moments (beta1, beta2) and would not read it"));
  }
  if (o.kind() != v1::OptimizerConfig::ADAM &&
      (o.has_beta1() || o.has_beta2() || o.epsilon() != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.optimizer.beta1, beta2 and epsilon (", o.beta1(), ", ", o.beta2(),
                     ", ", o.epsilon(), ") are Adam's; ", v1::OptimizerConfig::Kind_Name(o.kind()),
                     " would not read them"));
  }
  // Nothing reads compute_dtype: every plan computes in float32, and
  // `precision` asks for bf16. A FLOAT16 or BFLOAT16 here was taken and
  // trained in float32 without a word.
  if (options.compute_dtype() != v1::DTYPE_UNSPECIFIED && options.compute_dtype() != v1::FLOAT32) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.compute_dtype ", v1::DType_Name(options.compute_dtype()),
                     " is not supported: plans compute in FLOAT32 (leave it unset); for bf16 mixed "
                     "precision set options.precision PRECISION_BF16"));
  }
  // The pipeline's count and microbatches are read only where they apply.
  if (options.pipeline() == v1::PlanOptions::PIPELINE_OFF &&
      (options.pipeline_stages() != 0 || options.pipeline_microbatches() != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.pipeline_stages (", options.pipeline_stages(), ") and pipeline_microbatches (",
        options.pipeline_microbatches(),
        ") apply to a pipeline (PIPELINE_AUTO or PIPELINE_STAGES); options.pipeline is "
        "PIPELINE_OFF and would not read them"));
  }
  if (options.pipeline() == v1::PlanOptions::PIPELINE_AUTO && options.pipeline_stages() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.pipeline_stages (", options.pipeline_stages(),
        ") applies to PIPELINE_STAGES; PIPELINE_AUTO chooses the stage count and would not "
        "read it"));
  }
  return absl::OkStatus();
}

}  // namespace hap::service
