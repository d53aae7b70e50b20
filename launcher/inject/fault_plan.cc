#include "launcher/inject/fault_plan.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace elrun {
namespace {

constexpr char kForm[] =
    "expected KIND[:LOCAL_RANK]@WHEN, KIND kill-worker, stop-worker or kill-agent, WHEN Ts, T1-T2s, stepN, "
    "stepN1-N2, or every followed by one of those (e.g. kill-worker@20-40s,stop-worker:1@step100)";
constexpr double kMaxSeconds = 1e7;
constexpr double kMaxSteps = 1e12;

absl::Status Bad(absl::string_view item, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("'", item, "': ", why, "; ", kForm));
}

// "A" or "A-B", both finite numbers in [0, max] with A <= B; integers when `integral`.
bool ParseRange(absl::string_view text, bool integral, double max, double* from, double* to) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, absl::MaxSplits('-', 1));
  auto number = [&](absl::string_view s, double* out) {
    if (s.empty() || s.front() == '+' || s.front() == '-') return false;
    if (integral) {
      int64_t n = 0;
      if (!absl::SimpleAtoi(s, &n)) return false;
      *out = static_cast<double>(n);
    } else if (!absl::SimpleAtod(s, out)) {
      return false;
    }
    return std::isfinite(*out) && *out >= 0 && *out <= max;
  };
  if (!number(parts[0], from)) return false;
  *to = *from;
  if (parts.size() == 2 && !number(parts[1], to)) return false;
  return *from <= *to;
}

}  // namespace

const char* FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kKillWorker: return "kill-worker";
    case FaultKind::kStopWorker: return "stop-worker";
    case FaultKind::kKillAgent: return "kill-agent";
  }
  return "?";
}

absl::StatusOr<std::vector<FaultItem>> ParseFaultPlan(const std::string& plan) {
  for (char c : plan) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat("the plan holds a control or non-ASCII byte; ", kForm));
    }
  }
  std::vector<FaultItem> items;
  for (absl::string_view text : absl::StrSplit(plan, ',')) {
    while (absl::ConsumePrefix(&text, " ")) {
    }
    while (absl::ConsumeSuffix(&text, " ")) {
    }
    if (text.size() > 64) return Bad(text.substr(0, 64), "too long");
    FaultItem item;
    item.text = std::string(text);
    std::vector<absl::string_view> halves = absl::StrSplit(text, absl::MaxSplits('@', 1));
    if (halves.size() != 2) return Bad(text, "no '@'");
    std::vector<absl::string_view> what = absl::StrSplit(halves[0], absl::MaxSplits(':', 1));
    if (what[0] == "kill-worker") {
      item.kind = FaultKind::kKillWorker;
    } else if (what[0] == "stop-worker") {
      item.kind = FaultKind::kStopWorker;
    } else if (what[0] == "kill-agent") {
      item.kind = FaultKind::kKillAgent;
    } else {
      return Bad(text, "unknown kind");
    }
    if (what.size() == 2) {
      int rank = -1;
      if (item.kind == FaultKind::kKillAgent) return Bad(text, "kill-agent takes no local rank");
      if (!absl::SimpleAtoi(what[1], &rank) || rank < 0 || rank > 1 << 16) return Bad(text, "bad local rank");
      item.local_rank = rank;
    }
    absl::string_view when = halves[1];
    item.every = absl::ConsumePrefix(&when, "every");
    item.by_step = absl::ConsumePrefix(&when, "step");
    if (!item.by_step && !absl::ConsumeSuffix(&when, "s")) return Bad(text, "a time needs its unit, s");
    if (!ParseRange(when, item.by_step, item.by_step ? kMaxSteps : kMaxSeconds, &item.from, &item.to)) {
      return Bad(text, "bad time or step");
    }
    if (item.every && item.from < (item.by_step ? 1.0 : 0.1)) {
      return Bad(text, "an 'every' period must be at least 0.1 s or 1 step");
    }
    items.push_back(std::move(item));
    if (items.size() > kMaxFaultItems) return absl::InvalidArgumentError("more than 64 items");
  }
  return items;
}

FaultSchedule::FaultSchedule(std::vector<FaultItem> items, uint64_t seed) : rng_(seed) {
  for (FaultItem& item : items) {
    Armed armed;
    armed.at = Draw(item);
    armed.item = std::move(item);
    armed_.push_back(std::move(armed));
  }
}

double FaultSchedule::Draw(const FaultItem& item) {
  if (item.from == item.to) return item.from;
  if (item.by_step) {
    std::uniform_int_distribution<int64_t> steps(static_cast<int64_t>(item.from), static_cast<int64_t>(item.to));
    return static_cast<double>(steps(rng_));
  }
  return std::uniform_real_distribution<double>(item.from, item.to)(rng_);
}

std::vector<FaultSchedule::Due> FaultSchedule::TakeDue(double now_s, int64_t step) {
  std::vector<Due> due;
  for (Armed& armed : armed_) {
    if (armed.done) continue;
    const double reached = armed.item.by_step ? static_cast<double>(step) : now_s;
    if (reached < armed.at) continue;
    due.push_back({armed.item.kind, armed.item.local_rank, armed.item.text});
    if (armed.item.every) {
      armed.at = reached + Draw(armed.item);
    } else {
      armed.done = true;
    }
  }
  return due;
}

std::optional<double> FaultSchedule::NextTime() const {
  std::optional<double> next;
  for (const Armed& armed : armed_) {
    if (armed.done || armed.item.by_step) continue;
    if (!next || armed.at < *next) next = armed.at;
  }
  return next;
}

int FaultSchedule::DrawRank(int count) {
  if (count <= 1) return 0;
  return std::uniform_int_distribution<int>(0, count - 1)(rng_);
}

std::string FaultSchedule::Describe() const {
  std::string out;
  for (const Armed& armed : armed_) {
    absl::StrAppend(&out, out.empty() ? "" : "; ", armed.item.text, ": ",
                    armed.item.by_step ? absl::StrFormat("at step %d", static_cast<int64_t>(armed.at))
                                       : absl::StrFormat("at %.1f s", armed.at),
                    armed.item.every ? " and again after each" : "");
  }
  return out;
}

}  // namespace elrun
