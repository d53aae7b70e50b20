// The real ProcessTable: fork/exec of workers that lead their own process group, die with the
// launcher (PR_SET_PDEATHSIG, with the fork race closed, plus the Guardian for grandchildren),
// and are watched through pidfds in the event loop, so an exit is seen at once.
// When a worker's leader exits, whatever is left in its process group is SIGKILLed before the
// leader is reaped (the unreaped zombie keeps the group id from being reused meanwhile).
// Thread-compatible: used from the event loop's thread.
#ifndef ELRUN_LAUNCHER_OS_POSIX_PROCESS_TABLE_H_
#define ELRUN_LAUNCHER_OS_POSIX_PROCESS_TABLE_H_

#include <signal.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "launcher/os/event_loop.h"
#include "launcher/os/fork_server.h"
#include "launcher/os/guardian.h"
#include "launcher/os/output_pump.h"
#include "launcher/os/process_table.h"
#include "launcher/spec/exit_status.h"

namespace elrun {

// Unlinks the POSIX shared memory a worker named after its pid, /dev/shm/elrun-<what>-<pid>-*
// (elrun-train's shared-memory all-reduce), which a worker killed at the wrong moment leaves
// behind. Called with the worker a zombie, so the pid cannot be anyone else's yet.
void RemoveSharedMemoryOf(int pid);

class PosixProcessTable : public ProcessTable {
 public:
  using ExitCallback = std::function<void(int pid, ExitStatus status)>;

  // `loop` and `guardian` must outlive the table. A group is unregistered from `guardian` before
  // its leader is reaped, never after. Workers start with `forwarded_signals` at
  // their default disposition. `on_exit` runs on the loop's thread once per worker, after its
  // leader was reaped and its output drained.
  PosixProcessTable(EventLoop* loop, GroupRegistry* guardian, std::vector<int> forwarded_signals, ExitCallback on_exit);
  // SIGKILLs and reaps every worker still running.
  ~PosixProcessTable() override;

  absl::StatusOr<int> Spawn(const WorkerLaunch& launch) override;
  // --start-method forkserver: launches marked fork_from_server are forked from a ForkServer
  // (fork_server.h), started at the first of them with its interpreter and environment, and
  // started again once if it died. Makes elrun a child subreaper, so forked workers are its
  // children; orphans that re-parents to elrun are reaped at each worker's exit and spawn.
  absl::Status EnableForkServer(ForkServerOptions options);
  // Starts the forkserver now, with `like`'s interpreter and environment (a worker's, before the
  // first attempt), so that it imports torch while elrun goes on; no effect when one runs. On an
  // error the first spawn tries again.
  absl::Status PrestartForkServer(const WorkerLaunch& like);
  void SignalGroup(int pid, int signo) override;
  // True while `pid` is a worker of this table that has not been reaped (its group's id).
  bool HasWorker(int pid) const { return workers_.count(pid) > 0; }
  // The unreaped workers: pid (their group's id), local rank and rank.
  struct LiveWorker {
    int pid = 0;
    int local_rank = 0;
    int rank = 0;
  };
  void Relabel(int pid, int local_rank, int rank) override {
    auto it = workers_.find(pid);
    if (it == workers_.end()) return;
    it->second.local_rank = local_rank;
    it->second.rank = rank;
  }
  std::vector<LiveWorker> Workers() const {
    std::vector<LiveWorker> live;
    for (const auto& [pid, worker] : workers_) live.push_back({pid, worker.local_rank, worker.rank});
    return live;
  }

 private:
  struct Worker {
    int local_rank = 0;
    int rank = 0;
    int pidfd = -1;
    std::vector<std::unique_ptr<OutputPump>> pumps;
  };

  void OnExit(int pid);
  absl::StatusOr<int> CloneWorker(const WorkerLaunch& launch, int out_fd, int err_fd);
  absl::StatusOr<int> ForkFromServer(const WorkerLaunch& launch, int out_fd, int err_fd);
  void ReapStrays();
  // Reaps the exited leader `pid` of a worker's group (a child not reaped yet), after
  // unregistering it from the guardian and removing its shared memory while its zombie still
  // holds the pid; returns its exit. Blocks until it has exited.
  siginfo_t Reap(int pid);
  // SIGKILLs the worker's whole group, then Reap(pid).
  siginfo_t KillAndReap(int pid);
  void Forget(Worker& worker);  // Stops watching a reaped worker.

  EventLoop* const loop_;
  GroupRegistry* const guardian_;
  const std::vector<int> forwarded_signals_;
  const ExitCallback on_exit_;
  std::map<int, Worker> workers_;  // By pid; unreaped workers only.
  std::optional<ForkServerOptions> fork_server_options_;
  std::unique_ptr<ForkServer> fork_server_;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_POSIX_PROCESS_TABLE_H_
