// The local worker group's state machine: start an attempt, watch for exits, stop the group on a
// failure or a signal (SIGTERM, then SIGKILL after the shutdown timeout), restart while the
// restart budget allows, and decide the launcher's exit code. No I/O of its own: the OS is
// reached through ProcessTable and Clock, and the event loop feeds it events.
// Thread-compatible: one thread (the event loop) calls every method.
#ifndef ELRUN_LAUNCHER_JOB_SUPERVISOR_H_
#define ELRUN_LAUNCHER_JOB_SUPERVISOR_H_

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/os/clock.h"
#include "launcher/os/process_table.h"
#include "launcher/report/failure_report.h"
#include "launcher/spec/exit_status.h"
#include "launcher/spec/worker_launch.h"

namespace elrun {

struct SupervisorOptions {
  int max_restarts = 0;
  std::chrono::milliseconds shutdown_timeout{30000};
  // --keep-survivors: a failed worker is restarted alone when every other worker said it can
  // regroup in place (OnWorkerReady) in the current generation; the others are told the new
  // attempt's contract (the Regrouper) instead of being stopped. Anything else - a worker that
  // never said so, a failure while a regroup is under way, a worker that already finished, a
  // survivor that cannot be told - restarts the group as without it. Either way one restart is
  // spent.
  bool keep_survivors = false;
  // With keep_survivors in a multi-node job, where the rendezvous spends restarts and forms the
  // next round: a failed worker does not stop the others when they all said ready; the group is
  // held() instead (done() with its failure for the agent's report) until the next round tells
  // it to Regroup, or it is stopped.
  bool hold_survivors = false;
};

// Exit codes of the launcher.
inline constexpr int kExitSuccess = 0;
inline constexpr int kExitJobFailed = 1;
inline constexpr int kExitUsage = 2;
// Internal: the group was stopped on request (a new rendezvous round); never elrun's exit code.
inline constexpr int kExitStopped = -1;

class Supervisor {
 public:
  // Builds the launches of one attempt (environment, argv, log paths) for a restart count;
  // an error ends the job as failed.
  using AttemptPreparer = std::function<absl::StatusOr<std::vector<WorkerLaunch>>(int attempt, int restart_count)>;
  // Told of each attempt's end: (attempt, failures). Used for the restart log line.
  using AttemptObserver = std::function<void(int attempt, const std::vector<WorkerFailure>&)>;

  // `table` and `clock` must outlive the supervisor.
  Supervisor(SupervisorOptions options, ProcessTable* table, const Clock* clock, AttemptPreparer prepare,
             AttemptObserver on_restart = nullptr);

  // --keep-survivors: tells surviving worker `pid`, started as `started_as`, its launch in the
  // new attempt (its rank, world, master, generation and restart count); false when it cannot
  // be told.
  using Regrouper = std::function<bool(int pid, const WorkerLaunch& started_as, const WorkerLaunch& launch)>;
  // Told when a failed worker is restarted alone: (the attempt that failed, its failure, how
  // many workers keep running).
  using RegroupObserver = std::function<void(int attempt, const WorkerFailure& failure, int survivors)>;
  void SetRegrouper(Regrouper regroup, RegroupObserver on_regroup = nullptr) {
    regroup_ = std::move(regroup);
    on_regroup_ = std::move(on_regroup);
  }
  // Worker `pid` can regroup in place and is in generation `generation`, the attempt it was
  // started in or last regrouped into (its heartbeat channel's "ready" line).
  void OnWorkerReady(int pid, int64_t generation);
  // --keep-survivors with a standby spare (standby_worker.h): `take` hands the spare the launch of
  // a failed worker in the new generation and returns its pid (then no process is started),
  // nullopt when there is none; `on_all_ready` is told once per generation, with the spare's
  // started_as launch, when every worker said ready (a new spare may start then: not earlier, so
  // that its start-up does not slow the regroup).
  struct Standby {
    std::function<std::optional<std::pair<int, WorkerLaunch>>(const WorkerLaunch& launch)> take;
    std::function<void(const WorkerLaunch& base)> on_all_ready;
  };
  void SetStandby(Standby standby) { standby_ = std::move(standby); }

  // Told of each failure that ends an attempt, when it is seen (not of the workers elrun then
  // stops): for the goodput report.
  void OnFailure(std::function<void(const WorkerFailure&)> on_failure) { on_failure_ = std::move(on_failure); }

  // Starts `attempt` (a multi-node agent numbers them per round) at `restart_count`; with
  // `join_live` (a round that regroups around workers kept alive on other nodes) every worker
  // takes the job's live state from them, as a replacement does (the standby spare first).
  void Start(int attempt = 0, int restart_count = 0, bool join_live = false);

  // hold_survivors: keeps the running workers alive for the next round (a new round was called
  // elsewhere) when every one said ready; false, and nothing changed, when they cannot be kept.
  bool Hold();
  // The workers are kept alive for the next round (Hold, or a local failure with
  // hold_survivors); failures() has the local failure, if any.
  bool held() const { return state_ == State::kHeld; }
  // Held: the next round's `attempt` at `restart_count` tells every kept worker its new launch
  // and starts the missing local ranks with ELRUN_JOIN_LIVE=1. A worker that cannot be told
  // stops the group as a failure.
  void Regroup(int attempt, int restart_count);

  // Events.
  void OnWorkerExit(int pid, ExitStatus status);
  void OnSignal(int signo);
  // Call when SteadyNow() >= deadline(): workers still alive after SIGTERM get SIGKILL.
  void OnDeadline();
  // elrun signalled worker `pid` (or a process of its group) for `why`, outside a stop: the
  // worker's end, if it fails, carries `why` as its cause.
  void NoteSignalled(int pid, std::string why);
  // Stops the workers (SIGTERM, SIGKILL at the deadline) for a reason outside this node, such
  // as a new rendezvous round: no failure is counted and no restart follows; done() then has
  // exit_code() == kExitStopped (kExitJobFailed when held after a local failure). No effect
  // when already stopping or done.
  void Stop();

  // When the event loop must call OnDeadline; nullopt when no stop is in progress.
  std::optional<std::chrono::steady_clock::time_point> deadline() const { return deadline_; }
  bool done() const { return state_ == State::kDone; }
  // Valid once done(): 0 success, 1 failed, 128+signo after a forwarded signal, kExitStopped
  // after Stop().
  int exit_code() const { return exit_code_; }
  int restart_count() const { return restart_count_; }
  int attempt() const { return attempt_; }
  // The failures of the attempt that ended the job, in the order they were observed.
  const std::vector<WorkerFailure>& failures() const { return failures_; }
  // The launches of the current attempt, by local rank.
  const std::vector<WorkerLaunch>& launches() const { return launches_; }

 private:
  enum class State { kRunning, kHeld, kStopping, kDone };
  enum class StopReason { kFailure, kSignal, kRequested };

  void StartAttempt(bool join_live);
  // --keep-survivors: restarts the worker of `failed_local_rank` alone; false when the group
  // must restart instead (nothing was changed then).
  bool TryRegroup(int failed_local_rank);
  // Tells every live worker its launch in launches_ (and relabels it); false at the first that
  // cannot be told.
  bool TellSurvivors();
  // Starts the worker of `local_rank` from launches_ to join the survivors (the standby spare, or
  // a new process with ELRUN_JOIN_LIVE=1); false when it did not start (recorded as a failure).
  bool StartReplacement(int local_rank);
  // The current attempt's launch of `local_rank`; null when it has none.
  const WorkerLaunch* LaunchOf(int local_rank) const;
  // Every live worker said ready in the current generation (attempt_).
  bool AllReady() const;
  bool CanHold() const;
  void BeginStop(StopReason reason, int signo);
  void FinishStop();
  void RecordFailure(int local_rank, int pid, ExitStatus status, std::string start_error);

  // Constant after construction.
  const SupervisorOptions options_;
  ProcessTable* const table_;
  const Clock* const clock_;
  const AttemptPreparer prepare_;
  const AttemptObserver on_restart_;
  std::function<void(const WorkerFailure&)> on_failure_;
  Regrouper regroup_;
  RegroupObserver on_regroup_;
  Standby standby_;

  State state_ = State::kRunning;
  StopReason stop_reason_ = StopReason::kFailure;
  int stop_signal_ = 0;
  int exit_code_ = 0;
  int attempt_ = 0;
  int restart_count_ = 0;
  int succeeded_ = 0;
  std::vector<WorkerLaunch> launches_;
  std::map<int, int> live_;                 // pid -> local rank, workers whose end is not reported yet.
  std::map<int, std::string> causes_;       // pid -> why elrun signalled it (NoteSignalled).
  std::map<int, int64_t> ready_;            // pid -> the generation it can regroup from (OnWorkerReady).
  std::map<int, WorkerLaunch> started_as_;  // pid -> the launch it was started with (--keep-survivors).
  int64_t all_ready_told_ = -1;             // The last generation on_all_ready was told of.
  std::vector<WorkerFailure> failures_;
  std::optional<std::chrono::steady_clock::time_point> deadline_;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_JOB_SUPERVISOR_H_
