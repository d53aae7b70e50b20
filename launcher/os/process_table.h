// The OS side of supervision, behind an interface so that restart and timeout logic is tested
// without forking (tests/launcher/job/fake_process_table.h). The real one is PosixProcessTable.
#ifndef ELRUN_LAUNCHER_OS_PROCESS_TABLE_H_
#define ELRUN_LAUNCHER_OS_PROCESS_TABLE_H_

#include "absl/status/statusor.h"
#include "launcher/spec/worker_launch.h"

namespace elrun {

class ProcessTable {
 public:
  virtual ~ProcessTable() = default;

  // Starts a worker that leads its own process group. Returns its pid, or an error when it could
  // not be started (nothing is left running then). The worker's end is reported later, exactly
  // once, through whatever exit callback the implementation was given.
  virtual absl::StatusOr<int> Spawn(const WorkerLaunch& launch) = 0;

  // Sends `signo` to the process group of a worker whose end has not been reported yet (its
  // leader is unreaped, so the group id cannot have been reused).
  virtual void SignalGroup(int pid, int signo) = 0;

  // Worker `pid` (a standby spare, spawned with local rank -1) now is the worker of `local_rank`
  // and `rank`: watchdogs and reports see it as such.
  virtual void Relabel(int /*pid*/, int /*local_rank*/, int /*rank*/) {}
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_PROCESS_TABLE_H_
