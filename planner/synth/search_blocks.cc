// The repeated-block search (searcher.h): identical blocks between cuts
// solved once, a DP over the cuts.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "planner/graph/op_registry.h"
#include "planner/synth/gradients.h"
#include "planner/synth/searcher.h"

namespace hap::synth::internal {

// Steps where at most one tensor (of any kind) is live: the boundaries
// between blocks (a transformer layer's residual stream).
std::vector<int> Searcher::Cuts() const {
  const auto& tensors = g_.tensors();
  std::vector<int> delta(n_ + 2, 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (last_use_[t] < 0) continue;
    int first = tensors[t].kind == TensorKind::kActivation ? tensors[t].producer + 1
                                                           : tensors[t].consumers.front() + 1;
    if (first > last_use_[t]) continue;  // live at no step boundary
    delta[first] += 1;                   // live at steps first..last_use
    delta[last_use_[t] + 1] -= 1;
  }
  std::vector<int> cuts = {0};
  int live = 0;
  for (int s = 1; s < n_; ++s) {
    live += delta[s];
    if (live <= 1) cuts.push_back(s);
  }
  cuts.push_back(n_);
  return cuts;
}

// Everything that determines the transitions and costs of ops [a, b) from a
// given entry state: op types, attributes, shapes, how inputs refer to each
// other, sources, gradient requirements, and what stays live at b.
std::string Searcher::Signature(int a, int b) const {
  std::string sig;
  for (int k = a; k < b; ++k) {
    const graph::Op& op = g_.op(k);
    absl::StrAppend(&sig, op.type, "(");
    for (const auto& [name, v] : op.attrs.values()) {
      absl::StrAppend(&sig, name, "=", v.index(), ":");
      if (auto* i = std::get_if<int64_t>(&v)) absl::StrAppend(&sig, *i);
      if (auto* d = std::get_if<double>(&v)) absl::StrAppend(&sig, *d);
      if (auto* str = std::get_if<std::string>(&v)) absl::StrAppend(&sig, *str);
      if (auto* bo = std::get_if<bool>(&v)) absl::StrAppend(&sig, *bo);
      if (auto* is = std::get_if<std::vector<int64_t>>(&v)) {
        for (int64_t x : *is) absl::StrAppend(&sig, x, ",");
      }
      if (auto* fs = std::get_if<std::vector<double>>(&v)) {
        for (double x : *fs) absl::StrAppend(&sig, x, ",");
      }
      sig += ";";
    }
    sig += ")[";
    for (TensorId t : op.inputs) {
      const graph::Tensor& x = g_.tensor(t);
      if (x.kind == TensorKind::kActivation && x.producer >= a) {
        absl::StrAppend(&sig, "L", x.producer - a, ".", x.producer_output);
      } else if (x.kind == TensorKind::kActivation) {
        absl::StrAppend(&sig, "B", graph::TypeString(x.type));
      } else {
        absl::StrAppend(&sig, "S", static_cast<int>(x.kind), x.frozen, graph::TypeString(x.type),
                        x.consumers.front() == k ? "new" : "old", last_use_[t] >= b ? "live" : "");
      }
      absl::StrAppend(&sig, requires_grad_[t] ? "g" : "", ",");
    }
    sig += "]->";
    for (TensorId t : op.outputs) {
      absl::StrAppend(&sig, graph::TypeString(g_.tensor(t).type), last_use_[t] >= b ? "X" : "",
                      t == g_.loss() ? "loss" : "", ",");
    }
    sig += "\n";
  }
  return sig;
}

std::string Searcher::EntryKey(const State& s) const {
  std::string k;
  for (const Live& l : s.live) AppendForms(l, &k);
  return k;
}

// Repeated blocks: cut the op sequence where at most one tensor is live; a
// block's transitions from an entry state (the live tensor's forms) to every
// exit state are found once, exhaustively (Dijkstra inside the block), and
// reused for every block with the same signature. A DP over the cuts then
// combines blocks. Exact for the same state space as the A* search, and the
// work is per distinct block, not per layer.
std::optional<Program> Searcher::RunBlocked() {
  std::vector<int> cuts = Cuts();
  std::vector<std::string> sigs;
  absl::flat_hash_map<std::string, int> count;
  int longest = 0;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    sigs.push_back(Signature(cuts[i], cuts[i + 1]));
    ++count[sigs.back()];
    longest = std::max(longest, cuts[i + 1] - cuts[i]);
  }
  bool repeated = false;
  for (const auto& [sig, c] : count) repeated = repeated || c > 1;
  if (!repeated || longest > 96) return std::nullopt;

  struct Exit {
    std::string key;
    double cost;
    std::vector<int> rules;
  };
  struct Front {
    double g;
    std::vector<int> rules;
    State state;
  };
  absl::flat_hash_map<std::string, std::vector<Exit>> tables;
  std::map<std::string, Front> front;
  front[""] = Front{0, {}, State{}};
  for (size_t seg = 0; seg + 1 < cuts.size(); ++seg) {
    int b = cuts[seg + 1];
    std::map<std::string, Front> next;
    for (const auto& [key, f] : front) {
      std::string tkey = absl::StrCat(sigs[seg], "|", key);
      auto it = tables.find(tkey);
      if (it == tables.end()) {
        // Dijkstra inside the block from this entry state.
        std::vector<State> local = {f.state};
        local[0].g = 0;
        local[0].parent = -1;
        absl::flat_hash_map<std::string, int> best;
        best[Key(local[0])] = 0;
        std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> open;
        int64_t seq = 0;
        open.push({0, seq++, 0});
        std::vector<Exit> exits;
        while (!open.empty()) {
          Candidate top = open.top();
          open.pop();
          if (best[Key(local[top.index])] != top.index) continue;
          if (local[top.index].step == b) {
            Exit e;
            e.key = EntryKey(local[top.index]);
            e.cost = local[top.index].g;
            for (int i = top.index; local[i].parent >= 0; i = local[i].parent) {
              e.rules.push_back(local[i].rule);
            }
            std::reverse(e.rules.begin(), e.rules.end());
            exits.push_back(std::move(e));
            continue;
          }
          ++expanded_;
          if (OutOfBudget()) return std::nullopt;
          int idx = top.index;
          for (int r = 0; r < static_cast<int>(rules_[local[idx].step].size()); ++r) {
            State ns;
            double c;
            if (!Apply(local[idx], r, &ns, &c, nullptr)) continue;
            std::string k = Key(ns);
            auto bi = best.find(k);
            if (bi != best.end() && local[bi->second].g <= ns.g) continue;
            ns.parent = idx;
            ns.rule = r;
            local.push_back(std::move(ns));
            int ni = static_cast<int>(local.size()) - 1;
            best[k] = ni;
            open.push({local[ni].g, seq++, ni});
          }
        }
        it = tables.emplace(tkey, std::move(exits)).first;
      }
      for (const Exit& e : it->second) {
        double g = f.g + e.cost;
        auto n = next.find(e.key);
        if (n != next.end() && n->second.g <= g) continue;
        // The concrete exit state of this block instance: replay the rules.
        State s = f.state;
        bool ok = true;
        for (int r : e.rules) {
          State ns;
          double c;
          ok = ok && Apply(s, r, &ns, &c, nullptr);
          if (!ok) break;
          s = std::move(ns);
        }
        if (!ok) return std::nullopt;  // signature collision: be safe
        Front nf{g, f.rules, std::move(s)};
        nf.rules.insert(nf.rules.end(), e.rules.begin(), e.rules.end());
        next[e.key] = std::move(nf);
      }
    }
    front = std::move(next);
    if (opt_.progress) opt_.progress(expanded_, 0);
    if (front.empty()) return std::nullopt;
  }
  auto done = front.find("");
  if (done == front.end()) return std::nullopt;
  return Finish(Replay(done->second.rules), true);
}

}  // namespace hap::synth::internal
