// --inject-faults: the faults elrun causes on purpose, for restart-on-failure experiments, and
// when they fall due. A plan is a comma-separated list of items
//
//   KIND[:LOCAL_RANK]@WHEN
//   KIND  kill-worker (kill -9 of a worker), stop-worker (SIGSTOP of a worker's process group:
//         a hang, noticed with --worker-timeout) or kill-agent (kill -9 of this elrun, its
//         workers with it: a lost node)
//   WHEN  Ts | T1-T2s         once, at T (or uniformly in [T1, T2]) seconds after elrun started
//         stepN | stepN1-N2   once, when this node's workers first reach step N (or one drawn in
//                             [N1, N2]); steps are the heartbeats' (heartbeat.h)
//         every... of either  again and again, each gap drawn anew: every30s, every20-40s,
//                             everystep100
//
// e.g. "kill-worker@20-40s,stop-worker:1@step100,kill-worker@every30s". Without LOCAL_RANK a
// worker is drawn. Every draw comes from one generator seeded with --inject-seed, so a plan and
// a seed give the same schedule on every run. FaultSchedule is pure (times in seconds since the
// start, steps as beaten). Thread-compatible.
#ifndef ELRUN_LAUNCHER_INJECT_FAULT_PLAN_H_
#define ELRUN_LAUNCHER_INJECT_FAULT_PLAN_H_

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace elrun {

enum class FaultKind { kKillWorker, kStopWorker, kKillAgent };
const char* FaultKindName(FaultKind kind);  // "kill-worker", ...

struct FaultItem {
  FaultKind kind = FaultKind::kKillWorker;
  std::optional<int> local_rank;  // Unset: drawn.
  bool by_step = false;           // WHEN counts steps, else seconds.
  bool every = false;
  double from = 0;  // The range WHEN draws from (a single value: from == to).
  double to = 0;
  std::string text;  // The item as written.
};

inline constexpr size_t kMaxFaultItems = 64;

// The plan, or InvalidArgument naming the item at fault and what a valid one looks like.
absl::StatusOr<std::vector<FaultItem>> ParseFaultPlan(const std::string& plan);

class FaultSchedule {
 public:
  FaultSchedule(std::vector<FaultItem> items, uint64_t seed);

  struct Due {
    FaultKind kind = FaultKind::kKillWorker;
    std::optional<int> local_rank;
    std::string text;  // The item that fell due.
  };
  // The faults due at `now_s` with the workers at `step` (-1: no beat yet); each once, the
  // "every" items re-armed from here.
  std::vector<Due> TakeDue(double now_s, int64_t step);
  // When the next time-triggered fault falls due; nullopt when none is left.
  std::optional<double> NextTime() const;
  // A local rank drawn from [0, count).
  int DrawRank(int count);
  // One line per item with its first draw, e.g. "kill-worker@20-40s: at 31.2 s".
  std::string Describe() const;

 private:
  struct Armed {
    FaultItem item;
    double at = 0;  // Seconds or a step, per item.by_step.
    bool done = false;
  };
  double Draw(const FaultItem& item);

  std::mt19937_64 rng_;
  std::vector<Armed> armed_;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_INJECT_FAULT_PLAN_H_
