#include "launcher/report/goodput.h"

#include <algorithm>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "launcher/spec/json_value.h"

namespace elrun {

double FaultCost::lost_s() const { return recovered_at_s.value_or(end_s) - at_s; }

void GoodputTracker::OnBeat(int64_t step, double now, int worker) {
  ++beats_;
  if (!first_beat_) first_beat_ = now;
  const bool new_worker = beaten_.insert(worker).second;
  if (open_) {
    FaultCost& fault = faults_[*open_];
    if (!fault.resumed_at_s && (new_worker || step > fault.step_before)) fault.resumed_at_s = now - start_;
    if (step > fault.step_before) {
      fault.recovered_at_s = now - start_;
      if (first_step_after_) fault.steps_redone = std::max<int64_t>(0, fault.step_before - *first_step_after_ + 1);
      open_.reset();
      first_step_after_.reset();
    } else {
      first_step_after_ = std::min(first_step_after_.value_or(step), step);
    }
  }
  high_water_ = std::max(high_water_, step);
}

void GoodputTracker::OnFault(const std::string& kind, const std::string& detail, double at) {
  if (open_) {
    FaultCost& fault = faults_[*open_];
    if (fault.detail.size() < 1000) absl::StrAppend(&fault.detail, "; then ", kind, ": ", detail);
    return;
  }
  FaultCost fault;
  fault.kind = kind;
  fault.detail = detail;
  fault.at_s = std::max(0.0, at - start_);
  fault.step_before = high_water_;
  faults_.push_back(std::move(fault));
  open_ = faults_.size() - 1;
  first_step_after_.reset();
}

GoodputReport GoodputTracker::Report(double now) const {
  GoodputReport report;
  report.wall_s = std::max(0.0, now - start_);
  report.step = high_water_;
  report.beats = beats_;
  report.faults = faults_;
  if (first_beat_) report.first_beat_s = *first_beat_ - start_;
  for (FaultCost& fault : report.faults) {
    fault.end_s = report.wall_s;
    if (!report.first_beat_s) continue;
    // Time before the first beat is startup, not a fault's.
    const double from = std::max(fault.at_s, *report.first_beat_s);
    const double to = fault.recovered_at_s.value_or(report.wall_s);
    report.lost_s += std::max(0.0, to - from);
  }
  return report;
}

std::optional<double> GoodputReport::goodput() const {
  if (!first_beat_s || wall_s <= 0) return std::nullopt;
  return std::clamp((wall_s - *first_beat_s - lost_s) / wall_s, 0.0, 1.0);
}

std::string GoodputReport::Summary() const {
  std::optional<double> share = goodput();
  if (!share) {
    return absl::StrFormat(
        "goodput: unknown, no worker heartbeat in %.1f s (elrun_heartbeat.beat(step) in the script, or "
        "--auto-heartbeat)",
        wall_s);
  }
  std::string line =
      absl::StrFormat("goodput %.1f%% of %.1f s (first step after %.2f s; ", 100 * *share, wall_s, *first_beat_s);
  if (faults.empty()) return absl::StrCat(line, "no faults)");
  absl::StrAppend(&line, faults.size(), faults.size() == 1 ? " fault" : " faults",
                  absl::StrFormat(" cost %.2f s", lost_s));
  for (size_t i = 0; i < faults.size() && i < 5; ++i) {
    const FaultCost& f = faults[i];
    absl::StrAppend(&line, i ? "; " : ": ", f.kind, absl::StrFormat(" at %.1f s: ", f.at_s),
                    f.recovered_at_s ? absl::StrFormat("%.2f s, %d steps redone", f.lost_s(), f.steps_redone)
                                     : std::string("not recovered"));
  }
  if (faults.size() > 5) absl::StrAppend(&line, "; ", faults.size() - 5, " more in --report-file");
  return absl::StrCat(line, ")");
}

using google::protobuf::Struct;
using json::Bool;
using json::Null;
using json::Number;
using json::Text;

std::string GoodputReport::Json(const std::string& host, const std::string& run_id) const {
  Struct root;
  auto& fields = *root.mutable_fields();
  fields["host"] = Text(host);
  fields["run_id"] = Text(run_id);
  fields["wall_s"] = Number(wall_s);
  fields["first_step_s"] = first_beat_s ? Number(*first_beat_s) : Null();
  fields["lost_s"] = Number(lost_s);
  std::optional<double> share = goodput();
  fields["goodput"] = share ? Number(*share) : Null();
  fields["step"] = Number(static_cast<double>(step));
  fields["beats"] = Number(static_cast<double>(beats));
  auto& list = *fields["faults"].mutable_list_value();
  for (const FaultCost& f : faults) {
    Struct fault;
    auto& ff = *fault.mutable_fields();
    ff["kind"] = Text(f.kind);
    ff["detail"] = Text(f.detail);
    ff["at_s"] = Number(f.at_s);
    ff["step_before"] = Number(static_cast<double>(f.step_before));
    ff["recovered"] = Bool(f.recovered_at_s.has_value());
    ff["recovery_s"] = f.recovered_at_s ? Number(f.lost_s()) : Null();
    ff["resume_s"] = f.resumed_at_s ? Number(*f.resumed_at_s - f.at_s) : Null();
    ff["steps_redone"] = Number(static_cast<double>(f.steps_redone));
    *list.add_values()->mutable_struct_value() = std::move(fault);
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  if (!google::protobuf::util::MessageToJsonString(root, &json, options).ok()) return "{}";
  return json;
}

}  // namespace elrun
