// The OS side of supervision, behind an interface so that restart and timeout logic is tested
// without forking (tests/launcher/fake_process_table.h). The real one is PosixProcessTable.
#ifndef ELRUN_LAUNCHER_PROCESS_TABLE_H_
#define ELRUN_LAUNCHER_PROCESS_TABLE_H_

#include <chrono>

#include "absl/status/statusor.h"
#include "launcher/worker_launch.h"

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
};

// Time, behind an interface so that tests can set it.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual std::chrono::steady_clock::time_point SteadyNow() const = 0;
  virtual std::chrono::system_clock::time_point WallNow() const = 0;
};

class RealClock : public Clock {
 public:
  std::chrono::steady_clock::time_point SteadyNow() const override {
    return std::chrono::steady_clock::now();
  }
  std::chrono::system_clock::time_point WallNow() const override {
    return std::chrono::system_clock::now();
  }
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_PROCESS_TABLE_H_
