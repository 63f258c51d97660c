// The per-deployment series of the planner's /metrics, made from the
// deployments the planner holds at each scrape: a series exists while its
// deployment does (retention deletes finished ones) and the family's bound
// on label sets drops the oldest finished deployments, never a running
// one. (A family fed as metrics arrived kept every deployment ever seen
// and, once it held its 1,000 label sets, showed no new deployment's loss.)
#ifndef HAP_PLANNER_SERVICE_DEPLOYMENT_METRICS_H_
#define HAP_PLANNER_SERVICE_DEPLOYMENT_METRICS_H_

#include <cstddef>
#include <vector>

#include "hap/v1/planner_service.pb.h"
#include "planner/service/metrics/metrics.h"

namespace hap::service {

// hap_training_loss{deployment}: rank 0's latest loss of each deployment
// that has reported a step; unfinished deployments first (by name), then
// finished ones, the latest to end first; at most `max_rows`.
std::vector<metrics::LabeledValue> TrainingLossRows(std::vector<hap::v1::Deployment> deployments,
                                                    size_t max_rows);

}  // namespace hap::service

#endif  // HAP_PLANNER_SERVICE_DEPLOYMENT_METRICS_H_
