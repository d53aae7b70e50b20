// What every job mode of the launcher shares: logging, the log directory, the guardian, signal
// handling through a signalfd, the epoll loop and the process table.
// Create it once per process (it owns signal dispositions). Thread-compatible: the loop's thread.
#ifndef ELRUN_LAUNCHER_JOB_JOB_RUNTIME_H_
#define ELRUN_LAUNCHER_JOB_JOB_RUNTIME_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "launcher/inject/fault_injector.h"
#include "launcher/job/standby_worker.h"
#include "launcher/job/supervisor.h"
#include "launcher/os/control_fifos.h"
#include "launcher/os/event_loop.h"
#include "launcher/os/guardian.h"
#include "launcher/os/numa_binding.h"
#include "launcher/os/posix_process_table.h"
#include "launcher/report/goodput.h"
#include "launcher/spec/job_spec.h"
#include "launcher/watchdog/file_timer.h"
#include "launcher/watchdog/heartbeat.h"
#include "launcher/worker/attempt_builder.h"
#include "launcher/worker/log_layout.h"
#include "launcher/worker/python_dir.h"

namespace elrun {

class JobRuntime {
 public:
  using ExitHandler = std::function<void(int pid, ExitStatus status)>;
  using TimePoint = std::chrono::steady_clock::time_point;

  // Plans --numa-binding (an error when it cannot be honoured, one warning when it does not
  // apply here), starts the FileTimer watchdog when elrun's environment has
  // TORCHELASTIC_ENABLE_FILE_TIMER=1 (its FIFO: TORCHELASTIC_TIMER_FILE, else a new
  // $TMPDIR/watchdog_timer_<id>, as torchrun does), makes the log directory (a temp dir unless --log-dir), starts the
  // guardian, takes over the handled signals and builds the loop and the process table, whose worker exits go to
  // `on_exit`. On error nothing is left running.
  static absl::StatusOr<std::unique_ptr<JobRuntime>> Create(const JobSpec& spec,
                                                            const std::map<std::string, std::string>& env,
                                                            std::string run_id, ExitHandler on_exit);
  // Kills any worker still running and removes empty directories of a temp log dir.
  ~JobRuntime();

  EventLoop& loop() { return *loop_; }
  PosixProcessTable& table() { return *table_; }
  const LogLayout& layout() const { return *layout_; }
  const std::string& run_id() const { return run_id_; }
  // The progress heartbeats' server; null with --straggler-factor 0 and none of --worker-timeout,
  // --worker-start-timeout, --report-file, --inject-faults.
  HeartbeatServer* heartbeat() { return heartbeat_.get(); }
  // Gives `builder` what this runtime adds to every worker: --numa-binding's CPUs and memory
  // node, TORCHELASTIC_TIMER_FILE when the FileTimer watchdog runs, ELRUN_HEARTBEAT_FILE when
  // the heartbeat channel is open, --auto-heartbeat's variables and the forkserver mark; with
  // --start-method forkserver it then starts the server with the builder's environment, so that
  // the server imports torch while the job forms. Call once, before the first attempt.
  void PrepareBuilder(AttemptBuilder& builder) const;

  // --keep-survivors: gives each launch of `attempt` ELRUN_CONTROL_FILE, the control FIFO of its
  // local rank (control_fifos.h), and ELRUN_GENERATION=<attempt>, the generation it says ready
  // in. Call on every attempt's launches; nothing without --keep-survivors.
  absl::Status AddControlFiles(std::vector<WorkerLaunch>& launches, int attempt);
  // --keep-survivors: tells the process started as `started_as` (its control FIFO) the contract
  // of `launch` (its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
  // TORCHELASTIC_RESTART_COUNT) as generation ELRUN_GENERATION (trainer/runtime/control_channel.h).
  // False, with a warning, when it cannot.
  bool SendRegroup(const WorkerLaunch& started_as, const WorkerLaunch& launch);
  // --keep-survivors: the launch of a standby spare (standby_worker.h) made from a worker's: local
  // rank kStandbyLocalRank, a control FIFO of its own, ELRUN_STANDBY=1. FailedPrecondition, saying
  // why, where a spare cannot stand in for any worker: streams to per-rank log files, CPU
  // binding, a forkserver.
  absl::StatusOr<WorkerLaunch> StandbyLaunch(const WorkerLaunch& base);
  // --keep-survivors: a supervisor's hooks onto this node's standby spare (standby_worker.h: made
  // by StandbyLaunch, told by SendRegroup), made on first use. The runtime keeps the spare's own
  // exit from on_exit.
  Supervisor::Standby StandbyHooks();

  // Called when the FileTimer watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1) signals a process of
  // a worker's group, or a hung worker (heartbeat.h) is killed: the worker's pid and one line
  // saying why.
  void OnWatchdogSignal(std::function<void(int pid, const std::string& why)> handler) {
    on_watchdog_signal_ = std::move(handler);
  }

  // A fault for the goodput report (goodput.h): what kind, one line of detail, and when it
  // happened (CLOCK_MONOTONIC seconds; unset: now). Part of the open fault if one is open.
  void NoteFault(const std::string& kind, const std::string& detail, std::optional<double> at = std::nullopt);
  // At the job's end: the goodput line (a warning after faults, else at INFO) and --report-file.
  void ReportGoodput();
  // The goodput report so far.
  GoodputReport GoodputNow() const;

  // Calls `on_signal` for each handled signal that arrives.
  absl::Status HandleSignals(std::function<void(int signo)> on_signal);

  // Runs the loop until `done()`; when `deadline()` passes, calls `on_deadline`.
  absl::Status RunUntil(const std::function<bool()>& done, const std::function<std::optional<TimePoint>()>& deadline,
                        const std::function<void()>& on_deadline);

 private:
  JobRuntime() = default;
  // Create's steps, in order; each returns the error that ends the creation.
  absl::Status StartProcesses(const JobSpec& spec, ExitHandler on_exit);
  absl::Status StartPython(const JobSpec& spec, const std::map<std::string, std::string>& env);
  absl::Status StartFileTimer(const std::map<std::string, std::string>& env);
  absl::Status StartHeartbeat(const JobSpec& spec, const std::map<std::string, std::string>& env);
  absl::Status StartControl(const JobSpec& spec, const std::map<std::string, std::string>& env);
  absl::Status StartInjector(const JobSpec& spec);
  // The worker process group `pid` belongs to, or nullopt for a process outside this job's
  // workers: the watchdogs act only on these.
  std::optional<int> WorkerGroupOf(int pid) const;

  std::string run_id_;
  std::vector<CpuBinding> bindings_;
  std::string log_dir_;
  bool temp_logs_ = false;
  std::unique_ptr<LogLayout> layout_;
  std::unique_ptr<Guardian> guardian_;
  int signal_fd_ = -1;
  std::unique_ptr<EventLoop> loop_;
  std::unique_ptr<PosixProcessTable> table_;
  std::unique_ptr<FileTimerServer> file_timer_;
  std::unique_ptr<HeartbeatServer> heartbeat_;
  std::unique_ptr<ControlFifos> control_;   // --keep-survivors.
  int standbys_ = 0;                        // Standby spares made so far: their FIFO slots.
  std::unique_ptr<StandbyWorker> standby_;  // StandbyHooks'.
  std::function<void(int pid, const std::string& why)> on_watchdog_signal_;
  std::unique_ptr<PythonDir> python_dir_;  // --start-method forkserver, --auto-heartbeat.
  bool fork_server_ = false;
  bool auto_heartbeat_ = false;
  std::optional<std::string> user_pythonpath_;
  std::unique_ptr<GoodputTracker> goodput_;
  std::string report_file_;
  bool injecting_ = false;
  std::unique_ptr<FaultInjector> injector_;  // After what its hooks reach: destroyed first.
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_JOB_JOB_RUNTIME_H_
