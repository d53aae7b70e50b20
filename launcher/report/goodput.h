// Goodput as the launcher sees it: the share of a job's wall time in which it made new progress,
// and what each fault cost. Fed with this node's workers' progress heartbeats (heartbeat.h) and
// with the faults elrun saw or caused (a worker that failed, a hung worker, a new rendezvous
// round, an injected fault).
//
// The job's step is the highest step any worker of this node has beaten (its high-water mark).
// A fault opens at the moment it happened (for a hang: the hung worker's last beat) and closes
// at the first beat past the high-water mark it found; the steps beaten in between were redone.
// The first beat after it from a worker that had not beaten before it (a restarted one), or the
// recovering beat if sooner, is when the job was stepping again (resume_s in the JSON).
// A fault seen while another is open (the group restart that follows a kill, the round that
// follows a failure) is part of the open one. Time lost is the union of the faults' windows;
// a fault still open at the end counts to the end. Goodput is
//
//   (wall - startup - lost) / wall,  startup = from elrun's start to the first beat.
//
// With no beat at all there is no goodput (scripts that do not beat; see --auto-heartbeat).
// Pure logic over times in seconds of one monotonic clock. Thread-compatible.
#ifndef ELRUN_LAUNCHER_REPORT_GOODPUT_H_
#define ELRUN_LAUNCHER_REPORT_GOODPUT_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace elrun {

struct FaultCost {
  std::string kind;                      // "worker failed", "hang", "new round", "kill-worker (injected)", ...
  std::string detail;                    // One line: what was seen, and what followed while it was open.
  double at_s = 0;                       // Since the job's start.
  int64_t step_before = -1;              // The high-water step when it happened; -1: none yet.
  std::optional<double> resumed_at_s;    // The first beat after it, whatever its step: stepping again.
  std::optional<double> recovered_at_s;  // The first beat past step_before; unset: never.
  int64_t steps_redone = 0;
  double lost_s() const;  // recovered_at_s - at_s, or up to the end when never recovered.
  double end_s = 0;       // The report's end, for lost_s() of a fault never recovered.
};

struct GoodputReport {
  double wall_s = 0;
  std::optional<double> first_beat_s;  // Unset: no beat, no goodput.
  double lost_s = 0;                   // The union of the faults' windows (after the first beat).
  int64_t step = -1;                   // The high-water step at the end.
  int64_t beats = 0;
  std::vector<FaultCost> faults;
  // (wall - startup - lost) / wall; unset without a beat.
  std::optional<double> goodput() const;
  // One line for the end of the job, e.g. "goodput 97.4% of 61.2 s (first step after 1.1 s;
  // 2 faults cost 0.5 s: kill-worker (injected) at 20.1 s: 0.31 s, 3 steps redone; ...)".
  std::string Summary() const;
  // The whole report as one JSON object (see docs/operations.md).
  std::string Json(const std::string& host, const std::string& run_id) const;
};

class GoodputTracker {
 public:
  explicit GoodputTracker(double start_s) : start_(start_s) {}

  // A beat of worker `worker` (any id unique to one worker process) of this node at `now`.
  void OnBeat(int64_t step, double now, int worker);
  // A fault that happened at `at` (<= now). Part of the open fault when one is open.
  void OnFault(const std::string& kind, const std::string& detail, double at);
  // The highest step beaten so far; -1 before any beat.
  int64_t step() const { return high_water_; }
  bool fault_open() const { return open_.has_value(); }
  GoodputReport Report(double now) const;

 private:
  const double start_;
  int64_t high_water_ = -1;
  int64_t beats_ = 0;
  std::optional<double> first_beat_;
  std::vector<FaultCost> faults_;
  std::optional<size_t> open_;               // Index into faults_.
  std::optional<int64_t> first_step_after_;  // The lowest step beaten while open_ is open.
  std::set<int> beaten_;                     // The workers that have beaten.
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_REPORT_GOODPUT_H_
