// Where the calling thread's time went: on a CPU, or runnable but waiting for one (the kernel's
// schedstat). A training step that takes longer than its CPU time and run-queue wait was blocked:
// for a synchronous DDP step, on the slowest rank. Thread-safe (reads /proc only).
#ifndef ELRUN_TRAINER_RUNTIME_THREAD_TIMES_H_
#define ELRUN_TRAINER_RUNTIME_THREAD_TIMES_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace elrun::trainer {

struct ThreadTimes {
  double cpu_s = 0;       // On a CPU.
  double runqueue_s = 0;  // Runnable, waiting for a CPU.
};

// Parses a schedstat line: "<ns on a CPU> <ns waiting on a run queue> <timeslices>".
[[nodiscard]] absl::StatusOr<ThreadTimes> ParseSchedstat(absl::string_view text);

// The calling thread's CPU time so far (CLOCK_THREAD_CPUTIME_ID): cheap enough for every step.
double ThreadCpuSeconds();

// The calling thread's totals so far, from /proc/thread-self/schedstat. Unavailable when the
// kernel has no schedstat (CONFIG_SCHED_INFO off) or /proc is not mounted.
[[nodiscard]] absl::StatusOr<ThreadTimes> CurrentThreadTimes();

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_RUNTIME_THREAD_TIMES_H_
