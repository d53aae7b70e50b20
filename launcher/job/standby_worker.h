// --keep-survivors: one spare worker process per node. It is started from a launch of the
// current attempt once every worker said it is ready, does the start-up a worker does before it
// meets its peers (elrun-train: LibTorch and the data set, ELRUN_STANDBY=1) and waits on a
// control FIFO of its own; a regroup then hands it the failed worker's launch (Take) instead of
// starting a process, so the replacement skips its start-up. A spare that dies on its own is not
// replaced after the second time (it would only die again). Thread-compatible: the loop's thread.
#ifndef ELRUN_LAUNCHER_JOB_STANDBY_WORKER_H_
#define ELRUN_LAUNCHER_JOB_STANDBY_WORKER_H_

#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "launcher/os/process_table.h"
#include "launcher/spec/exit_status.h"
#include "launcher/spec/worker_launch.h"

namespace elrun {

class StandbyWorker {
 public:
  // The spare's launch from a worker's (JobRuntime::StandbyLaunch); an error says why no spare
  // can stand in for this job's workers.
  using MakeLaunch = std::function<absl::StatusOr<WorkerLaunch>(const WorkerLaunch& base)>;
  // Tells the spare (started as `spare`) to become `launch` (its generation in its environment).
  using Tell = std::function<bool(const WorkerLaunch& spare, const WorkerLaunch& launch)>;

  // `table` must outlive this.
  StandbyWorker(ProcessTable* table, MakeLaunch make, Tell tell)
      : table_(table), make_(std::move(make)), tell_(std::move(tell)) {}

  // Starts a spare from `base` unless one runs or spares were given up on.
  void Start(const WorkerLaunch& base);
  // The spare, told to become the worker of `launch`: its pid and the launch it was started
  // with, now relabelled as `launch`'s local rank and rank in the process table. nullopt when
  // there is none, or it could not be told (it is killed then).
  std::optional<std::pair<int, WorkerLaunch>> Take(const WorkerLaunch& launch);
  // True when `pid` was the spare (not yet taken): it is forgotten.
  bool OnExit(int pid, ExitStatus status);
  int pid() const { return pid_; }

 private:
  ProcessTable* const table_;
  const MakeLaunch make_;
  const Tell tell_;
  int pid_ = 0;  // 0: none.
  WorkerLaunch launch_;
  int deaths_ = 0;  // Spares that died on their own.
  bool given_up_ = false;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_JOB_STANDBY_WORKER_H_
