// hapctl checkpoint: look into and export training checkpoints
// (executor/checkpoint).
#ifndef HAP_TOOLS_HAPCTL_CHECKPOINT_H_
#define HAP_TOOLS_HAPCTL_CHECKPOINT_H_

#include <string>
#include <vector>

namespace hap::tools {

// `hapctl checkpoint inspect DIR [-o table|json]` and
// `hapctl checkpoint export DIR -o FILE.safetensors [--with-optimizer-state]`.
int RunCheckpoint(const std::vector<std::string>& argv);

}  // namespace hap::tools

#endif  // HAP_TOOLS_HAPCTL_CHECKPOINT_H_
