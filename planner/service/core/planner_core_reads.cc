// The planner core's plan reads: GetPlan (FULL and BASIC views, copied or
// as encoded bytes), the page of ListPlans, and the views and encodings
// they share with CreatePlan and CancelPlan (planner_core_internal.h).
// Reads take the core's plan snapshots under its lock and copy them after
// it; a plan held as its summary is loaded whole from the store.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "planner/service/core/pagination.h"
#include "planner/service/core/planner_core.h"
#include "planner/service/core/planner_core_internal.h"

namespace hap::service {

namespace v1 = ::hap::v1;

namespace {

// `p` serialized; null when it cannot be (over protobuf's 2 GiB).
std::shared_ptr<const std::string> Encode(const v1::Plan& p) {
  auto bytes = std::make_shared<std::string>();
  if (!p.SerializeToString(bytes.get())) return nullptr;
  return bytes;
}

// `bytes` from Encode, or ResourceExhausted naming plan `name` when it was
// too large to serialize.
absl::StatusOr<std::shared_ptr<const std::string>> NotTooLarge(
    const std::shared_ptr<const std::string>& bytes, const std::string& name) {
  if (bytes == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name, " is too large to send (a message over 2 GiB)"));
  }
  return bytes;
}

}  // namespace

// The BASIC view of GetPlan: everything but the rank programs (the
// summary, with the whole plan's graph and program).
void FillBasicView(const v1::Plan& summary, const v1::Plan& whole, v1::Plan* out) {
  *out = summary;
  if (whole.has_graph()) *out->mutable_graph() = whole.graph();
  if (whole.has_program()) *out->mutable_program() = whole.program();
}
// Of an entry known whole.
v1::Plan BasicView(const PlanEntry& e) {
  v1::Plan p;
  FillBasicView(*e.summary, *e.full, &p);
  return p;
}

struct PlannerCore::PagedPlan {
  std::string name;
  PlanEntry entry;
  std::shared_ptr<const v1::Plan> whole;  // FULL views only
};

// Reads take the snapshots under the lock and copy them after it.
absl::StatusOr<v1::Plan> PlannerCore::GetPlan(const std::string& name, bool full) {
  v1::Plan p;
  HAP_RETURN_IF_ERROR(GetPlan(name, full, &p));
  return p;
}

absl::StatusOr<PlanEntry> PlannerCore::Entry(const std::string& name) {
  HAP_RETURN_IF_ERROR(PlanId(name).status());
  absl::MutexLock l(&s_->mu);
  auto it = s_->plans.find(name);
  if (it == s_->plans.end()) return absl::NotFoundError(absl::StrCat(name, " does not exist"));
  return it->second;
}

absl::Status PlannerCore::GetPlan(const std::string& name, bool full, v1::Plan* out) {
  HAP_ASSIGN_OR_RETURN(PlanEntry entry, Entry(name));
  HAP_ASSIGN_OR_RETURN(std::shared_ptr<const v1::Plan> whole, Whole(name, entry));
  if (full) {
    *out = *whole;
  } else {
    FillBasicView(*entry.summary, *whole, out);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const std::string>> PlannerCore::GetPlanEncoded(
    const std::string& name, bool full) {
  HAP_ASSIGN_OR_RETURN(PlanEntry entry, Entry(name));
  HAP_ASSIGN_OR_RETURN(std::shared_ptr<const v1::Plan> whole, Whole(name, entry));
  if (full) return NotTooLarge(Encode(*whole), name);
  PlanEntry::Encoded& e = *entry.encoded;
  absl::call_once(e.basic_once, [&] {
    v1::Plan basic;
    FillBasicView(*entry.summary, *whole, &basic);
    e.basic = Encode(basic);
  });
  return NotTooLarge(e.basic, name);
}

absl::StatusOr<std::shared_ptr<const v1::Plan>> PlannerCore::GetPlanSnapshot(
    const std::string& name) {
  HAP_ASSIGN_OR_RETURN(PlanEntry entry, Entry(name));
  return Whole(name, entry);
}

absl::StatusOr<std::shared_ptr<const v1::Plan>> PlannerCore::Whole(const std::string& name,
                                                                   const PlanEntry& entry) {
  if (entry.full) return entry.full;
  if (!o_.load_plan) {
    return absl::InternalError(
        absl::StrCat(name, " is held as its summary and the planner cannot read the rest"));
  }
  absl::StatusOr<v1::Plan> loaded = o_.load_plan(name);
  if (absl::IsNotFound(loaded.status())) {
    return absl::NotFoundError(absl::StrCat(name, " does not exist"));
  }
  HAP_RETURN_IF_ERROR(Annotate(loaded.status(), absl::StrCat(name, " could not be read")));
  auto whole = std::make_shared<const v1::Plan>(*std::move(loaded));
  absl::MutexLock l(&s_->mu);
  auto it = s_->plans.find(name);
  // Kept for the next read, unless the plan changed or went meanwhile.
  if (it != s_->plans.end() && it->second.summary == entry.summary && !it->second.full) {
    it->second.full = whole;
  }
  return whole;
}

absl::StatusOr<v1::ListPlansResponse> PlannerCore::ListPlans(int page_size,
                                                             const std::string& token, bool full) {
  v1::ListPlansResponse r;
  HAP_RETURN_IF_ERROR(ListPlans(page_size, token, full, &r));
  return r;
}

// The page's entries (under the lock) and, for FULL, their whole plans
// (after it); plans deleted meanwhile are left out.
absl::Status PlannerCore::PlansPage(int page_size, const std::string& token, bool full,
                                    std::vector<PagedPlan>* page, std::string* next) {
  std::vector<std::pair<std::string, PlanEntry>> entries;
  {
    absl::MutexLock l(&s_->mu);
    HAP_ASSIGN_OR_RETURN(*next,
                         Paginate(s_->plans, page_size, token, "plans", [&](const PlanEntry& e) {
                           entries.emplace_back(e.summary->name(), e);
                           return e.summary->ByteSizeLong();
                         }));
  }
  page->reserve(entries.size());
  size_t bytes = 0;  // of whole plans
  for (auto& [name, e] : entries) {
    std::shared_ptr<const v1::Plan> whole;
    if (full) {
      // Whole plans are megabytes each: a page ends at kMaxPageBytes
      // (the next goes on after its last plan), not at gigabytes.
      if (!page->empty() && bytes >= kMaxPageBytes) {
        *next = PageTokenAfter("plans", page->back().name);
        break;
      }
      absl::StatusOr<std::shared_ptr<const v1::Plan>> w = Whole(name, e);
      if (absl::IsNotFound(w.status())) continue;  // deleted since the page was read
      HAP_RETURN_IF_ERROR(w.status());
      whole = *std::move(w);
      bytes += whole->ByteSizeLong();
    }
    page->push_back({std::move(name), std::move(e), std::move(whole)});
  }
  return absl::OkStatus();
}

absl::Status PlannerCore::ListPlans(int page_size, const std::string& token, bool full,
                                    v1::ListPlansResponse* out) {
  std::vector<PagedPlan> page;
  std::string next;
  HAP_RETURN_IF_ERROR(PlansPage(page_size, token, full, &page, &next));
  out->Clear();
  out->mutable_plans()->Reserve(static_cast<int>(page.size()));
  for (const PagedPlan& p : page) *out->add_plans() = full ? *p.whole : *p.entry.summary;
  out->set_next_page_token(next);
  return absl::OkStatus();
}

absl::Status PlannerCore::ListPlansEncoded(int page_size, const std::string& token, bool full,
                                           std::vector<std::shared_ptr<const std::string>>* plans,
                                           std::string* next_page_token) {
  std::vector<PagedPlan> page;
  HAP_RETURN_IF_ERROR(PlansPage(page_size, token, full, &page, next_page_token));
  plans->clear();
  plans->reserve(page.size());
  for (const PagedPlan& p : page) {
    std::shared_ptr<const std::string> bytes;
    if (full) {
      bytes = Encode(*p.whole);
    } else {
      PlanEntry::Encoded& e = *p.entry.encoded;
      absl::call_once(e.summary_once, [&] { e.summary = Encode(*p.entry.summary); });
      bytes = e.summary;
    }
    HAP_ASSIGN_OR_RETURN(bytes, NotTooLarge(bytes, p.name));
    plans->push_back(std::move(bytes));
  }
  return absl::OkStatus();
}

}  // namespace hap::service
