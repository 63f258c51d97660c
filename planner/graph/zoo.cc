#include "planner/graph/zoo.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace hap::graph {
namespace {

// A parameter's value as the user wrote it (StrCat's 6 digits showed
// 99999999999 as 1e+11 and 1234567.5 as 1.23457e+06).
std::string Shown(double v) { return absl::StrFormat("%.15g", v); }

using P = std::map<std::string, double>;

const std::vector<ZooModelInfo>& Infos() {
  static const auto* infos = new std::vector<ZooModelInfo>{
      {"mlp", "linear+relu stack, cross-entropy classifier",
       {{"layers", 12}, {"hidden", 768}, {"input", 768}, {"classes", 10},
        {"batch", 256}}},
      {"transformer",
       "encoder stack as nn.TransformerEncoderLayer (post-norm, relu) on "
       "float features, mean-pooled classifier",
       {{"layers", 12}, {"hidden", 768}, {"heads", 12}, {"ffn", 3072},
        {"seq", 128}, {"classes", 10}, {"batch", 256}, {"dropout", 0.1}}},
      {"gpt",
       "GPT-style LM on WikiText-2 words: causal pre-norm blocks, untied "
       "decoder, cross-entropy loss",
       {{"layers", 12}, {"hidden", 768}, {"heads", 12}, {"ffn", 3072},
        {"seq", 128}, {"vocab", kWikiText2Vocab}, {"batch", 256},
        {"dropout", 0.1}}},
      {"vit",
       "ViT on 32x32 images: 4x4 conv patches (64), class token, pre-norm "
       "blocks",
       {{"layers", 12}, {"hidden", 768}, {"heads", 12}, {"ffn", 3072},
        {"image", 32}, {"patch", 4}, {"channels", 3}, {"classes", 10},
        {"batch", 256}, {"dropout", 0.1}}},
      {"moe",
       "gpt with every moe_every-th MLP a top-2 mixture of experts (GShard)",
       {{"layers", 12}, {"hidden", 768}, {"heads", 12}, {"ffn", 3072},
        {"seq", 128}, {"vocab", kWikiText2Vocab}, {"batch", 256},
        {"dropout", 0.1}, {"experts", 16}, {"capacity_factor", 1.25},
        {"moe_every", 2}, {"top_k", 2}, {"dense_routing", 0}, {"moe_group_size", 0}}},
      {"switch",
       "gpt with every moe_every-th MLP a top-1 (Switch) mixture of experts",
       {{"layers", 12}, {"hidden", 768}, {"heads", 12}, {"ffn", 3072},
        {"seq", 128}, {"vocab", kWikiText2Vocab}, {"batch", 256},
        {"dropout", 0.1}, {"experts", 16}, {"capacity_factor", 1.25},
        {"moe_every", 2}, {"top_k", 1}, {"dense_routing", 0}, {"moe_group_size", 0}}},
      {"vgg",
       "VGG-style CNN on 32x32 images (conv3x3+relu stages, max-pool)",
       {{"width", 64}, {"stages", 5}, {"convs_per_stage", 2}, {"image", 32},
        {"channels", 3}, {"classes", 10}, {"hidden", 512}, {"batch", 256}}},
  };
  return *infos;
}

// Reads parameters with defaults; integers are checked to be integral and
// positive.
class Params {
 public:
  Params(const ZooModelInfo& info, const P& overrides) : values_(info.defaults) {
    for (const auto& [k, v] : overrides) {
      if (!values_.count(k)) {
        std::vector<std::string> names;
        for (const auto& [n, d] : info.defaults) names.push_back(n);
        status_ = absl::InvalidArgumentError(absl::StrCat(
            "model '", info.name, "' has no parameter '", k,
            "' (it takes: ", absl::StrJoin(names, ", "), ")"));
        return;
      }
      values_[k] = v;
    }
  }
  // A positive integer (or 0 too with allow_zero).
  int64_t Int(const std::string& k, bool allow_zero = false) {
    double v = values_.at(k);
    if (status_.ok() && (!(v >= (allow_zero ? 0 : 1)) || v != std::floor(v) || v > 1e15)) {
      status_ = absl::InvalidArgumentError(absl::StrCat(
          "parameter '", k, "' must be a ", allow_zero ? "non-negative" : "positive",
          " integer, got ", Shown(v)));
    }
    return status_.ok() ? static_cast<int64_t>(v) : 1;
  }
  double Fraction(const std::string& k) {
    double v = values_.at(k);
    if (status_.ok() && !(v >= 0 && v < 1)) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat("parameter '", k, "' must be in [0, 1), got ", Shown(v)));
    }
    return v;
  }
  bool Flag(const std::string& k) {
    double v = values_.at(k);
    if (status_.ok() && v != 0 && v != 1) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat("parameter '", k, "' must be 0 or 1, got ", Shown(v)));
    }
    return v == 1;
  }
  double Positive(const std::string& k) {
    double v = values_.at(k);
    if (status_.ok() && !(v > 0 && std::isfinite(v))) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat("parameter '", k, "' must be positive, got ", Shown(v)));
    }
    return v;
  }
  void Require(bool cond, const std::string& msg) {
    if (status_.ok() && !cond) status_ = absl::InvalidArgumentError(msg);
  }
  // a * b for sizes derived from parameters; an error (and 1) when the
  // product does not fit in 64 bits.
  int64_t Mul(int64_t a, int64_t b, const std::string& what) {
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r)) {
      Require(false, absl::StrCat(what, " (", a, " * ", b,
                                  ") does not fit in 64 bits"));
      return 1;
    }
    return r;
  }
  const absl::Status& status() const { return status_; }
  const std::map<std::string, double>& values() const { return values_; }

 private:
  std::map<std::string, double> values_;
  absl::Status status_;
};

// PyTorch's default nn.Linear / nn.Conv2d initialisation bound.
Initializer FanIn(int64_t fan_in) {
  double b = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return Initializer::Uniform(-b, b);
}

// Layers shared by the models. Parameters are named "<scope>/<name>".
class Layers {
 public:
  explicit Layers(GraphBuilder& b) : b_(b) {}

  TensorId Linear(const std::string& name, TensorId x, int64_t in, int64_t out,
                  bool bias = true) {
    b_.PushScope(name);
    TensorId w = b_.Parameter(b_.Scoped("weight"), F32({out, in}), FanIn(in));
    std::vector<TensorId> ins = {x, w};
    if (bias) {
      ins.push_back(b_.Parameter(b_.Scoped("bias"), F32({out}), FanIn(in)));
    }
    b_.PopScope();
    return b_.Add("linear", b_.Scoped(name), ins);
  }

  TensorId LayerNorm(const std::string& name, TensorId x, int64_t d) {
    b_.PushScope(name);
    TensorId g = b_.Parameter(b_.Scoped("weight"), F32({d}), Initializer::Ones());
    TensorId be = b_.Parameter(b_.Scoped("bias"), F32({d}), Initializer::Zeros());
    b_.PopScope();
    return b_.Add("layer_norm", b_.Scoped(name), {x, g, be});
  }

  TensorId Unary(const std::string& type, const std::string& name, TensorId x,
                 Attrs attrs = {}) {
    return b_.Add(type, b_.Scoped(name), {x}, std::move(attrs));
  }

  TensorId Dropout(const std::string& name, TensorId x, double p) {
    if (p == 0) return x;
    return Unary("dropout", name, x, {{"p", p}});
  }

  TensorId Add(const std::string& name, TensorId a, TensorId c) {
    return b_.Add("add", b_.Scoped(name), {a, c});
  }

  // Multi-head self-attention on x[batch, seq, hidden]: separate q/k/v
  // projections, scaled dot product, optional causal mask, output projection.
  TensorId Attention(TensorId x, int64_t batch, int64_t seq, int64_t hidden,
                     int64_t heads, double dropout, bool causal) {
    b_.PushScope("attn");
    int64_t dh = hidden / heads;
    TensorId q = Linear("q", x, hidden, hidden);
    TensorId k = Linear("k", x, hidden, hidden);
    TensorId v = Linear("v", x, hidden, hidden);
    Attrs split_heads = {{"shape", std::vector<int64_t>{batch, seq, heads, dh}}};
    q = Unary("reshape", "q_heads", q, split_heads);
    k = Unary("reshape", "k_heads", k, split_heads);
    v = Unary("reshape", "v_heads", v, split_heads);
    q = Unary("transpose", "q_t", q, {{"perm", std::vector<int64_t>{0, 2, 1, 3}}});
    k = Unary("transpose", "k_t", k, {{"perm", std::vector<int64_t>{0, 2, 3, 1}}});
    v = Unary("transpose", "v_t", v, {{"perm", std::vector<int64_t>{0, 2, 1, 3}}});
    TensorId s = b_.Add("matmul", b_.Scoped("scores"), {q, k});
    s = Unary("scale", "scaled", s,
              {{"factor", 1.0 / std::sqrt(static_cast<double>(dh))}});
    s = Unary("softmax", "probs", s, {{"causal", causal}});
    s = Dropout("probs_drop", s, dropout);
    TensorId ctx = b_.Add("matmul", b_.Scoped("context"), {s, v});
    ctx = Unary("transpose", "context_t", ctx,
                {{"perm", std::vector<int64_t>{0, 2, 1, 3}}});
    ctx = Unary("reshape", "context_merged", ctx,
                {{"shape", std::vector<int64_t>{batch, seq, hidden}}});
    TensorId out = Linear("out", ctx, hidden, hidden);
    b_.PopScope();
    return out;
  }

  TensorId Mlp(TensorId x, int64_t hidden, int64_t ffn,
               const std::string& act, double dropout) {
    b_.PushScope("mlp");
    TensorId h = Linear("fc1", x, hidden, ffn);
    h = Unary(act, act, h);
    h = Dropout("drop", h, dropout);
    h = Linear("fc2", h, ffn, hidden);
    b_.PopScope();
    return h;
  }

  // GShard mixture of experts on x[batch, seq, hidden]; `dense_moe` builds
  // the dense form (combine weights [tokens, experts, capacity]).
  bool dense_moe = false;
  // Tokens routed together (GShard's group size; 0: all the batch's): each
  // group has ceil(capacity_factor * group * top_k / experts) slots per
  // expert. The builder's caller keeps groups inside samples.
  int64_t moe_group_size = 0;
  TensorId Moe(TensorId x, int64_t tokens, int64_t hidden, int64_t ffn,
               int64_t experts, int64_t top_k, double capacity_factor,
               int64_t batch, int64_t seq) {
    b_.PushScope("moe");
    const int64_t group = moe_group_size > 0 ? moe_group_size : tokens;
    // In doubles (tokens * top_k may not fit), capped below 2^62 so the cast
    // is defined; a huge capacity then fails the builder's shape check.
    double cap =
        std::ceil(capacity_factor * static_cast<double>(group) *
                  static_cast<double>(top_k) / static_cast<double>(experts)) *
        static_cast<double>(tokens / group);
    int64_t capacity = static_cast<int64_t>(
        std::min(cap, static_cast<double>(int64_t{1} << 62)));
    if (capacity < 1) capacity = 1;
    TensorId flat = Unary("reshape", "tokens", x,
                          {{"shape", std::vector<int64_t>{tokens, hidden}}});
    TensorId logits = Linear("gate", flat, hidden, experts, /*bias=*/false);
    TensorId dispatched;
    std::function<TensorId(TensorId)> combine;
    if (dense_moe) {  // the earlier form, for comparisons
      TensorId weights = Unary("moe_gate", "route", logits,
                               {{"k", top_k}, {"capacity", capacity}});
      dispatched =
          b_.Add("moe_dispatch", b_.Scoped("dispatch"), {flat, weights});
      combine = [this, weights](TensorId h) {
        return b_.Add("moe_combine", b_.Scoped("combine"), {h, weights});
      };
    } else {
      // The compact routing (int64 slots and weights [tokens, top_k]): the
      // dense combine tensor [tokens, experts, capacity] grows with
      // tokens^2.
      const int64_t g = moe_group_size;
      TensorId route = Unary("moe_route", "route", logits,
                             {{"k", top_k}, {"capacity", capacity}, {"group_size", g}});
      TensorId weights =
          Unary("moe_route_weights", "route_weights", logits, {{"k", top_k}});
      dispatched = b_.Add("moe_dispatch_idx", b_.Scoped("dispatch"), {flat, route},
                          {{"experts", experts}, {"capacity", capacity}, {"group_size", g}});
      combine = [this, route, weights, g](TensorId h) {
        return b_.Add("moe_combine_idx", b_.Scoped("combine"), {h, route, weights},
                      {{"group_size", g}});
      };
    }
    TensorId w1 = b_.Parameter(b_.Scoped("experts/fc1/weight"),
                               F32({experts, hidden, ffn}), FanIn(hidden));
    TensorId w2 = b_.Parameter(b_.Scoped("experts/fc2/weight"),
                               F32({experts, ffn, hidden}), FanIn(ffn));
    TensorId h = b_.Add("matmul", b_.Scoped("experts/fc1"), {dispatched, w1});
    h = Unary("gelu", "experts/gelu", h);
    h = b_.Add("matmul", b_.Scoped("experts/fc2"), {h, w2});
    TensorId y = combine(h);
    y = Unary("reshape", "untokens", y,
              {{"shape", std::vector<int64_t>{batch, seq, hidden}}});
    b_.PopScope();
    return y;
  }

 private:
  GraphBuilder& b_;
};

absl::StatusOr<Graph> BuildMlp(Params& p) {
  int64_t layers = p.Int("layers"), hidden = p.Int("hidden"),
          input = p.Int("input"), classes = p.Int("classes"),
          batch = p.Int("batch");
  HAP_RETURN_IF_ERROR(p.status());
  GraphBuilder b("mlp");
  Layers L(b);
  TensorId x = b.Input("x", F32({batch, input}));
  TensorId y = b.Input("labels", I64({batch}), InputRole::kLabels);
  int64_t width = input;
  for (int64_t i = 0; i < layers; ++i) {
    b.PushScope(absl::StrCat("layer", i));
    x = L.Linear("fc", x, width, hidden);
    x = L.Unary("relu", "relu", x);
    b.PopScope();
    width = hidden;
  }
  TensorId logits = L.Linear("head", x, width, classes);
  b.SetLoss(b.Add("cross_entropy", "loss", {logits, y}));
  return b.Build();
}

absl::StatusOr<Graph> BuildTransformer(Params& p) {
  int64_t layers = p.Int("layers"), hidden = p.Int("hidden"),
          heads = p.Int("heads"), ffn = p.Int("ffn"), seq = p.Int("seq"),
          classes = p.Int("classes"), batch = p.Int("batch");
  double dropout = p.Fraction("dropout");
  p.Require(hidden % heads == 0, "hidden must be divisible by heads");
  HAP_RETURN_IF_ERROR(p.status());
  GraphBuilder b("transformer");
  Layers L(b);
  TensorId x = b.Input("x", F32({batch, seq, hidden}));
  TensorId y = b.Input("labels", I64({batch}), InputRole::kLabels);
  for (int64_t i = 0; i < layers; ++i) {
    b.PushScope(absl::StrCat("layer", i));
    TensorId a = L.Attention(x, batch, seq, hidden, heads, dropout, false);
    a = L.Dropout("attn_drop", a, dropout);
    x = L.LayerNorm("norm1", L.Add("attn_residual", x, a), hidden);
    TensorId f = L.Mlp(x, hidden, ffn, "relu", dropout);
    f = L.Dropout("mlp_drop", f, dropout);
    x = L.LayerNorm("norm2", L.Add("mlp_residual", x, f), hidden);
    b.PopScope();
  }
  TensorId pooled =
      b.Add("mean", "pool", {x}, {{"axes", std::vector<int64_t>{1}}});
  TensorId logits = L.Linear("head", pooled, hidden, classes);
  b.SetLoss(b.Add("cross_entropy", "loss", {logits, y}));
  return b.Build();
}

// Pre-norm block used by gpt, vit, moe and switch. `moe_experts` > 0 makes
// the MLP a mixture of experts.
TensorId PreNormBlock(Layers& L, TensorId x, int64_t batch,
                      int64_t seq, int64_t hidden, int64_t heads, int64_t ffn,
                      double dropout, bool causal, int64_t moe_experts,
                      int64_t top_k, double capacity_factor) {
  TensorId h = L.LayerNorm("ln1", x, hidden);
  h = L.Attention(h, batch, seq, hidden, heads, dropout, causal);
  x = L.Add("attn_residual", x, L.Dropout("attn_drop", h, dropout));
  h = L.LayerNorm("ln2", x, hidden);
  if (moe_experts > 0) {
    h = L.Moe(h, batch * seq, hidden, ffn, moe_experts, top_k, capacity_factor,
              batch, seq);
  } else {
    h = L.Mlp(h, hidden, ffn, "gelu", dropout);
  }
  return L.Add("mlp_residual", x, L.Dropout("mlp_drop", h, dropout));
}

absl::StatusOr<Graph> BuildLm(const std::string& name, Params& p, bool moe) {
  int64_t layers = p.Int("layers"), hidden = p.Int("hidden"),
          heads = p.Int("heads"), ffn = p.Int("ffn"), seq = p.Int("seq"),
          vocab = p.Int("vocab"), batch = p.Int("batch");
  double dropout = p.Fraction("dropout");
  int64_t experts = 0, every = 1, top_k = 1;
  double cf = 1;
  if (moe) {
    experts = p.Int("experts");
    every = p.Int("moe_every");
    top_k = p.Int("top_k");
    cf = p.Positive("capacity_factor");
    p.Require(top_k <= experts, "top_k must not exceed experts");
  }
  const bool dense_routing = moe && p.Flag("dense_routing");
  const int64_t moe_group = moe ? p.Int("moe_group_size", true) : 0;
  if (moe_group > 0) {
    p.Require(seq % moe_group == 0,
              "moe_group_size must divide seq (routing groups stay inside samples, so a plan "
              "that splits the batch keeps whole groups)");
    p.Require(!dense_routing, "moe_group_size needs the compact routing (dense_routing 0)");
  }
  p.Require(hidden % heads == 0, "hidden must be divisible by heads");
  const int64_t num_tokens = p.Mul(batch, seq, "batch * seq");
  HAP_RETURN_IF_ERROR(p.status());
  GraphBuilder b(name);
  Layers L(b);
  L.dense_moe = dense_routing;
  L.moe_group_size = moe_group;
  TensorId tokens = b.Input("tokens", I64({batch, seq}));
  TensorId labels = b.Input("labels", I64({num_tokens}), InputRole::kLabels);
  TensorId wte = b.Parameter("embed/tokens", F32({vocab, hidden}),
                             Initializer::Normal(0, 0.02));
  TensorId wpe = b.Parameter("embed/positions", F32({seq, hidden}),
                             Initializer::Normal(0, 0.02));
  TensorId x = b.Add("embedding", "embed/lookup", {tokens, wte});
  x = b.Add("add", "embed/add_positions", {x, wpe});
  x = L.Dropout("embed/drop", x, dropout);
  for (int64_t i = 0; i < layers; ++i) {
    b.PushScope(absl::StrCat("layer", i));
    bool is_moe = moe && (i % every == every - 1);
    x = PreNormBlock(L, x, batch, seq, hidden, heads, ffn, dropout,
                     /*causal=*/true, is_moe ? experts : 0, top_k, cf);
    b.PopScope();
  }
  x = L.LayerNorm("ln_f", x, hidden);
  TensorId logits = L.Linear("decoder", x, hidden, vocab, /*bias=*/false);
  logits = b.Add("reshape", "decoder/flat", {logits},
                 {{"shape", std::vector<int64_t>{num_tokens, vocab}}});
  // log_softmax and nll_loss fused: one pass over the logits each way, and
  // the logits may be sharded by class (vocabulary-parallel).
  b.SetLoss(b.Add("cross_entropy", "loss", {logits, labels}));
  return b.Build();
}

absl::StatusOr<Graph> BuildVit(Params& p) {
  int64_t layers = p.Int("layers"), hidden = p.Int("hidden"),
          heads = p.Int("heads"), ffn = p.Int("ffn"), image = p.Int("image"),
          patch = p.Int("patch"), channels = p.Int("channels"),
          classes = p.Int("classes"), batch = p.Int("batch");
  double dropout = p.Fraction("dropout");
  p.Require(hidden % heads == 0, "hidden must be divisible by heads");
  p.Require(image % patch == 0, "image must be divisible by patch");
  const int64_t grid = image / patch;
  const int64_t seq = p.Mul(grid, grid, "patches") + 1;
  const int64_t fan_in =
      p.Mul(p.Mul(channels, patch, "patch fan-in"), patch, "patch fan-in");
  HAP_RETURN_IF_ERROR(p.status());
  GraphBuilder b("vit");
  Layers L(b);
  TensorId img = b.Input("images", F32({batch, channels, image, image}));
  TensorId labels = b.Input("labels", I64({batch}), InputRole::kLabels);
  TensorId pw = b.Parameter("patch_embed/weight",
                            F32({hidden, channels, patch, patch}), FanIn(fan_in));
  TensorId pb = b.Parameter("patch_embed/bias", F32({hidden}), FanIn(fan_in));
  TensorId x = b.Add("conv2d", "patch_embed", {img, pw, pb},
                     {{"stride", std::vector<int64_t>{patch, patch}}});
  x = b.Add("flatten", "patch_embed/flat", {x}, {{"start_dim", int64_t{2}}});
  x = b.Add("transpose", "patch_embed/tokens", {x},
            {{"perm", std::vector<int64_t>{0, 2, 1}}});
  TensorId cls = b.Parameter("cls_token", F32({1, 1, hidden}),
                             Initializer::Normal(0, 0.02));
  TensorId cls_b = b.Add("expand", "cls_expand", {cls},
                         {{"shape", std::vector<int64_t>{batch, 1, hidden}}});
  x = b.Add("concat", "prepend_cls", {cls_b, x}, {{"axis", int64_t{1}}});
  TensorId pos = b.Parameter("pos_embed", F32({1, seq, hidden}),
                             Initializer::Normal(0, 0.02));
  x = b.Add("add", "add_positions", {x, pos});
  x = L.Dropout("embed_drop", x, dropout);
  for (int64_t i = 0; i < layers; ++i) {
    b.PushScope(absl::StrCat("layer", i));
    x = PreNormBlock(L, x, batch, seq, hidden, heads, ffn, dropout, false, 0,
                     1, 1);
    b.PopScope();
  }
  x = L.LayerNorm("ln_f", x, hidden);
  x = b.Add("slice", "cls_out", {x},
            {{"axis", int64_t{1}}, {"start", int64_t{0}}, {"end", int64_t{1}}});
  x = b.Add("reshape", "cls_flat", {x},
            {{"shape", std::vector<int64_t>{batch, hidden}}});
  TensorId logits = L.Linear("head", x, hidden, classes);
  b.SetLoss(b.Add("cross_entropy", "loss", {logits, labels}));
  return b.Build();
}

absl::StatusOr<Graph> BuildVgg(Params& p) {
  int64_t width = p.Int("width"), stages = p.Int("stages"),
          convs = p.Int("convs_per_stage"), image = p.Int("image"),
          channels = p.Int("channels"), classes = p.Int("classes"),
          hidden = p.Int("hidden"), batch = p.Int("batch");
  // stages < 63 first: shifting by 63 or more is undefined.
  p.Require(stages < 63 && (image >> stages) >= 1 &&
                (image % (int64_t{1} << stages)) == 0,
            "image must be divisible by 2^stages");
  HAP_RETURN_IF_ERROR(p.status());
  GraphBuilder b("vgg");
  Layers L(b);
  TensorId x = b.Input("images", F32({batch, channels, image, image}));
  TensorId labels = b.Input("labels", I64({batch}), InputRole::kLabels);
  int64_t in = channels, size = image;
  for (int64_t s = 0; s < stages; ++s) {
    int64_t out = width * (int64_t{1} << std::min<int64_t>(s, 3));
    for (int64_t c = 0; c < convs; ++c) {
      b.PushScope(absl::StrCat("stage", s, "/conv", c));
      TensorId w = b.Parameter(b.Scoped("weight"), F32({out, in, 3, 3}),
                               FanIn(in * 9));
      TensorId bias = b.Parameter(b.Scoped("bias"), F32({out}), FanIn(in * 9));
      b.PopScope();
      std::string name = absl::StrCat("stage", s, "/conv", c);
      x = b.Add("conv2d", name, {x, w, bias},
                {{"padding", std::vector<int64_t>{1, 1}}});
      x = b.Add("relu", name + "/relu", {x});
      in = out;
    }
    x = b.Add("max_pool2d", absl::StrCat("stage", s, "/pool"), {x},
              {{"kernel", std::vector<int64_t>{2, 2}}});
    size /= 2;
  }
  x = b.Add("flatten", "flatten", {x});
  HAP_RETURN_IF_ERROR(b.status());
  const int64_t features = p.Mul(p.Mul(in, size, "features"), size, "features");
  HAP_RETURN_IF_ERROR(p.status());
  x = L.Linear("fc1", x, features, hidden);
  x = b.Add("relu", "fc1/relu", {x});
  TensorId logits = L.Linear("head", x, hidden, classes);
  b.SetLoss(b.Add("cross_entropy", "loss", {logits, labels}));
  return b.Build();
}

}  // namespace

std::vector<ZooModelInfo> ZooModels() { return Infos(); }

absl::StatusOr<Graph> BuildZooModel(const std::string& name, const P& params) {
  const ZooModelInfo* info = nullptr;
  std::vector<std::string> names;
  for (const auto& i : Infos()) {
    names.push_back(i.name);
    if (i.name == name) info = &i;
  }
  if (info == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown zoo model '", name,
                     "' (known: ", absl::StrJoin(names, ", "), ")"));
  }
  Params p(*info, params);
  HAP_RETURN_IF_ERROR(p.status());
  // Repeat counts bound the graph's size (and the time to build it).
  for (const char* k : {"layers", "convs_per_stage"}) {
    auto it = p.values().find(k);
    if (it != p.values().end() && it->second > kMaxZooRepeats) {
      return absl::InvalidArgumentError(absl::StrCat(
          "zoo model '", name, "': parameter '", k,
          "' must be a positive integer of at most ", kMaxZooRepeats,
          ", got ", Shown(it->second)));
    }
  }
  absl::StatusOr<Graph> g = absl::InternalError("unreachable");
  if (name == "mlp") g = BuildMlp(p);
  if (name == "transformer") g = BuildTransformer(p);
  if (name == "gpt") g = BuildLm("gpt", p, false);
  if (name == "moe" || name == "switch") g = BuildLm(name, p, true);
  if (name == "vit") g = BuildVit(p);
  if (name == "vgg") g = BuildVgg(p);
  if (!g.ok()) {
    return absl::Status(g.status().code(), absl::StrCat("zoo model '", name,
                                                        "': ",
                                                        g.status().message()));
  }
  return g;
}

}  // namespace hap::graph
