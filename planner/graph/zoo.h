// The model zoo: the workloads of the HAP paper, built in C++ and
// parameterised. Each model is the forward graph of one training step on one
// device, ending in a scalar loss.
//
//   mlp          linear+relu stack, cross-entropy over `classes`
//   transformer  nn.TransformerEncoderLayer stack (post-norm, relu) on
//                float features [batch, seq, hidden], mean-pooled classifier
//   gpt          GPT-style LM: token + position embedding, pre-norm causal
//                blocks (gelu MLP), final norm, untied decoder, log_softmax +
//                nll_loss over a WikiText-2 word vocabulary
//   vit          ViT on 32x32 images: conv patch embedding, class token,
//                position embedding, pre-norm blocks, class-token head
//   moe          gpt with every `moe_every`-th MLP a top-2 mixture of experts
//   switch       the same with top-1 (Switch) routing
//   vgg          VGG-style CNN on 32x32 images
//
// Defaults are the paper's evaluation settings: 12 layers, hidden 768, 12
// heads, FFN 3072, sequence 128 (ViT: 64 patches), batch 32 per device on 8
// devices (256), experts 2 per device (16), capacity factor 1.25.
#ifndef HAP_PLANNER_GRAPH_ZOO_H_
#define HAP_PLANNER_GRAPH_ZOO_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/graph/graph.h"

namespace hap::graph {

// Words of the vocabulary built from WikiText-2's valid and test splits
// (split on whitespace, one <eos> a line); the data module checks it.
inline constexpr int64_t kWikiText2Vocab = 18328;

// Largest accepted `layers` / `convs_per_stage`.
inline constexpr int64_t kMaxZooRepeats = 4096;

struct ZooModelInfo {
  std::string name;
  std::string description;
  std::map<std::string, double> defaults;  // every accepted parameter
};

std::vector<ZooModelInfo> ZooModels();

// Builds a zoo model. `params` overrides defaults; an unknown name or a
// parameter the model does not take is InvalidArgument, as are values that
// are not positive integers where integers are expected.
absl::StatusOr<Graph> BuildZooModel(const std::string& name,
                                    const std::map<std::string, double>& params = {});

}  // namespace hap::graph

#endif  // HAP_PLANNER_GRAPH_ZOO_H_
