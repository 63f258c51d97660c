// libFuzzer target: cluster profiles (hap.v1.Cluster, binary or protobuf
// JSON as in planner/examples/) through ClusterModel::FromProto, which
// every plan request runs on agents' reports and users' files.
#include <cstddef>
#include <cstdint>
#include <string>

#include "google/protobuf/util/json_util.h"
#include "planner/cost/cluster_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  hap::v1::Cluster cluster;
  const bool parsed = !bytes.empty() && bytes[0] == '{'
                          ? google::protobuf::util::JsonStringToMessage(bytes, &cluster).ok()
                          : cluster.ParseFromString(bytes);
  if (!parsed) return 0;
  auto model = hap::cost::ClusterModel::FromProto(cluster);
  if (model.ok() && model->size() <= 0) __builtin_trap();
  return 0;
}
