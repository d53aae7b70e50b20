#include "launcher/job/job_runtime.h"

#include <sched.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>

#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "launcher/inject/fault_plan.h"
#include "launcher/os/atomic_file.h"
#include "launcher/os/clock.h"
#include "launcher/os/host_info.h"
#include "launcher/spec/value_parsers.h"
#include "launcher/worker/entrypoint.h"

namespace elrun {
namespace {

// $TMPDIR of `env`, else /tmp: where elrun makes its temp log dir and its FIFOs.
std::string TempDir(const std::map<std::string, std::string>& env) {
  auto tmp = env.find("TMPDIR");
  return tmp == env.end() || tmp->second.empty() ? "/tmp" : tmp->second;
}

absl::StatusOr<std::string> MakeTempLogDir(const std::map<std::string, std::string>& env) {
  std::string pattern = absl::StrCat(TempDir(env), "/elrun-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("mkdtemp ", pattern, ": ", std::strerror(errno)));
  }
  return pattern;
}

// Takes over the handled signals: default disposition (an inherited SIG_IGN would make the
// kernel drop them before signalfd sees them), blocked, reported through a signalfd.
absl::StatusOr<int> TakeOverSignals(const std::vector<int>& signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int signo : signals) {
    ::signal(signo, SIG_DFL);
    sigaddset(&set, signo);
  }
  if (::sigprocmask(SIG_BLOCK, &set, nullptr) != 0) {
    return absl::InternalError(absl::StrCat("sigprocmask: ", std::strerror(errno)));
  }
  int fd = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (fd < 0) return absl::InternalError(absl::StrCat("signalfd: ", std::strerror(errno)));
  return fd;
}

}  // namespace

namespace {

// --numa-binding on this machine: its topology under /, the CPUs elrun may use.
absl::StatusOr<std::vector<CpuBinding>> PlanWorkerBinding(const JobSpec& spec,
                                                          const std::map<std::string, std::string>& env) {
  std::set<int> allowed;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof(mask), &mask) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &mask)) allowed.insert(cpu);
    }
  }
  auto visible = env.find("CUDA_VISIBLE_DEVICES");
  auto plan =
      PlanNumaBinding(*ParseNumaMode(spec.numa_binding), spec.nproc_per_node,
                      visible == env.end() ? std::nullopt : std::optional<std::string>(visible->second), "/", allowed);
  if (!plan.ok()) return plan.status();
  if (!plan->note.empty()) spdlog::warn("{}", plan->note);
  for (size_t i = 0; i < plan->workers.size(); ++i) {
    spdlog::info("--numa-binding {}: local rank {} on CPUs {}, memory preferred on NUMA node {}", spec.numa_binding, i,
                 FormatCpuList(plan->workers[i].cpus), plan->workers[i].memory_node);
  }
  return plan->workers;
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobRuntime>> JobRuntime::Create(const JobSpec& spec,
                                                               const std::map<std::string, std::string>& env,
                                                               std::string run_id, ExitHandler on_exit) {
  std::unique_ptr<JobRuntime> runtime(new JobRuntime());
  if (!spec.report_file.empty()) {
    // Fail before the job runs, not after it: the report's directory must take a file.
    absl::Status writable = WriteFileAtomically(spec.report_file, "{}\n");
    if (!writable.ok()) return absl::InvalidArgumentError(absl::StrCat("--report-file: ", writable.message()));
  }
  runtime->run_id_ = std::move(run_id);
  runtime->goodput_ = std::make_unique<GoodputTracker>(MonotonicSeconds());
  runtime->report_file_ = spec.report_file;
  runtime->injecting_ = !spec.inject_faults.empty();
  if (!spec.numa_binding.empty()) {
    auto bindings = PlanWorkerBinding(spec, env);
    if (!bindings.ok()) return bindings.status();
    runtime->bindings_ = *std::move(bindings);
  }
  runtime->temp_logs_ = spec.log_dir.empty();
  runtime->log_dir_ = spec.log_dir;
  if (runtime->temp_logs_) {
    auto made = MakeTempLogDir(env);
    if (!made.ok()) return made.status();
    runtime->log_dir_ = *made;
  }
  runtime->layout_ = std::make_unique<LogLayout>(runtime->log_dir_, runtime->run_id_);

  JobRuntime& self = *runtime;
  absl::Status status = self.StartProcesses(spec, std::move(on_exit));
  if (status.ok()) status = self.StartPython(spec, env);
  if (status.ok()) status = self.StartFileTimer(env);
  if (status.ok()) status = self.StartHeartbeat(spec, env);
  if (status.ok()) status = self.StartControl(spec, env);
  if (status.ok()) status = self.StartInjector(spec);
  if (!status.ok()) return status;
  return runtime;
}

// Signals, the guardian, the event loop and the process table (which outlives its callback: it
// is this object's).
absl::Status JobRuntime::StartProcesses(const JobSpec& spec, ExitHandler on_exit) {
  ::signal(SIGPIPE, SIG_IGN);
  // An inherited SIG_IGN for SIGCHLD would make the kernel reap workers before we read their
  // exit status.
  ::signal(SIGCHLD, SIG_DFL);
  auto guardian = Guardian::Start();
  if (!guardian.ok()) return guardian.status();
  guardian_ = *std::move(guardian);
  auto signal_fd = TakeOverSignals(spec.signals_to_handle);
  if (!signal_fd.ok()) return signal_fd.status();
  signal_fd_ = *signal_fd;
  auto loop = EventLoop::Create();
  if (!loop.ok()) return loop.status();
  loop_ = *std::move(loop);
  table_ = std::make_unique<PosixProcessTable>(loop_.get(), guardian_.get(), spec.signals_to_handle,
                                               [this, on_exit = std::move(on_exit)](int pid, ExitStatus status) {
                                                 if (standby_ && standby_->OnExit(pid, status)) return;
                                                 on_exit(pid, status);
                                               });
  return absl::OkStatus();
}

// Python workers: the forkserver (--start-method forkserver) and --auto-heartbeat's site directory.
absl::Status JobRuntime::StartPython(const JobSpec& spec, const std::map<std::string, std::string>& env) {
  const bool python = RunsPython(spec);
  if (spec.start_method == "forkserver" && !python) {
    spdlog::warn("--start-method forkserver applies to Python workers; these are exec'd");
  }
  fork_server_ = spec.start_method == "forkserver" && python;
  auto_heartbeat_ = spec.auto_heartbeat && python;
  if (fork_server_ || auto_heartbeat_) {
    auto dir = PythonDir::Create(TempDir(env), *guardian_);
    if (!dir.ok()) return dir.status();
    python_dir_ = *std::move(dir);
    if (auto it = env.find("PYTHONPATH"); it != env.end()) user_pythonpath_ = it->second;
  }
  if (fork_server_) {
    ForkServerOptions options;
    options.script = python_dir_->forkserver();
    // torch and what its first distributed use imports lazily (DDP's constructor alone pulls in
    // torch._dynamo: ~1 s here).
    options.preload = {"torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.optim"};
    options.preload.insert(options.preload.end(), spec.preload.begin(), spec.preload.end());
    absl::Status enabled = table_->EnableForkServer(std::move(options));
    if (!enabled.ok()) return enabled;
  }
  return absl::OkStatus();
}

// torchelastic's file timer, when TORCHELASTIC_ENABLE_FILE_TIMER=1.
absl::Status JobRuntime::StartFileTimer(const std::map<std::string, std::string>& env) {
  auto enabled = env.find("TORCHELASTIC_ENABLE_FILE_TIMER");
  if (enabled != env.end() && enabled->second == "1") {
    auto path = env.find("TORCHELASTIC_TIMER_FILE");
    std::string fifo = path != env.end() && !path->second.empty()
                           ? path->second
                           : absl::StrCat(TempDir(env), "/watchdog_timer_", RandomRunId());
    auto server = FileTimerServer::Start(
        fifo, loop_.get(), [this](int pid) { return WorkerGroupOf(pid); },
        [this](int group, const std::string& why) {
          if (on_watchdog_signal_) on_watchdog_signal_(group, why);
        });
    if (!server.ok()) return server.status();
    file_timer_ = *std::move(server);
    guardian_->RemoveOnDeath(file_timer_->path());  // Even after a kill -9.
  }
  return absl::OkStatus();
}

// The heartbeat server, when anything reads the workers' progress: the watchdogs, the report,
// injected faults, --auto-heartbeat, --keep-survivors.
absl::Status JobRuntime::StartHeartbeat(const JobSpec& spec, const std::map<std::string, std::string>& env) {
  const HeartbeatLimits limits{spec.worker_timeout_s, spec.worker_start_timeout_s, spec.straggler_factor};
  if (limits.any() || !spec.report_file.empty() || !spec.inject_faults.empty() || auto_heartbeat_ ||
      spec.keep_survivors) {
    std::string fifo = absl::StrCat(TempDir(env), "/elrun_heartbeat_", RandomRunId());
    auto server = HeartbeatServer::Start(
        fifo, loop_.get(), limits, [this](int pid) { return WorkerGroupOf(pid); },
        [this] {
          std::vector<HeartbeatServer::Worker> workers;
          for (const auto& w : table_->Workers()) {
            if (w.local_rank != kStandbyLocalRank) workers.push_back({w.pid, w.local_rank, w.rank});
          }
          return workers;
        },
        [this](int group, const std::string& why) {
          if (on_watchdog_signal_) on_watchdog_signal_(group, "heartbeat watchdog: " + why);
          table_->SignalGroup(group, SIGKILL);
        });
    if (!server.ok()) return server.status();
    heartbeat_ = *std::move(server);
    guardian_->RemoveOnDeath(heartbeat_->path());
    heartbeat_->OnBeat([this](int64_t step, int group) {
      const int64_t before = goodput_->step();
      goodput_->OnBeat(step, MonotonicSeconds(), group);
      if (injector_ && goodput_->step() > before) injector_->OnStep();
    });
    heartbeat_->OnHangFound([this](const std::string& what, double since) { NoteFault("hang", what, since); });
  }
  return absl::OkStatus();
}

// --keep-survivors' control FIFOs.
absl::Status JobRuntime::StartControl(const JobSpec& spec, const std::map<std::string, std::string>& env) {
  if (spec.keep_survivors) {
    auto fifos = ControlFifos::Create(TempDir(env));
    if (!fifos.ok()) return absl::UnavailableError(absl::StrCat("--keep-survivors: ", fifos.status().message()));
    control_ = *std::move(fifos);
    guardian_->RemoveOnDeath(control_->dir());
  }
  return absl::OkStatus();
}

// --inject-faults' injector.
absl::Status JobRuntime::StartInjector(const JobSpec& spec) {
  if (!spec.inject_faults.empty()) {
    if (spec.inject_faults.find("stop-worker") != std::string::npos && !spec.worker_timeout_s) {
      spdlog::warn("--inject-faults stop-worker without --worker-timeout: nothing will notice the stopped worker");
    }
    FaultInjector::Hooks hooks;
    hooks.workers = [this] {
      std::vector<std::pair<int, int>> workers;
      for (const auto& w : table_->Workers()) {
        if (w.local_rank != kStandbyLocalRank) workers.emplace_back(w.pid, w.local_rank);
      }
      return workers;
    };
    hooks.signal = [this](int pid, int signo, bool group) {
      if (group) {
        table_->SignalGroup(pid, signo);
      } else if (table_->HasWorker(pid)) {  // Unreaped: the pid is still that worker's.
        ::kill(pid, signo);
      }
    };
    hooks.note = [this](int pid, const std::string& why) {
      if (on_watchdog_signal_) on_watchdog_signal_(pid, why);
    };
    hooks.on_fault = [this](const std::string& kind, const std::string& detail) { NoteFault(kind, detail); };
    const double start = MonotonicSeconds();
    hooks.now = [start] { return MonotonicSeconds() - start; };
    hooks.step = [this] { return goodput_->step(); };
    auto injector = FaultInjector::Start(
        loop_.get(), FaultSchedule(*ParseFaultPlan(spec.inject_faults), spec.inject_seed), std::move(hooks));
    if (!injector.ok()) return injector.status();
    injector_ = *std::move(injector);
  }
  return absl::OkStatus();
}

std::optional<int> JobRuntime::WorkerGroupOf(int pid) const {
  pid_t group = ::getpgid(pid);
  if (group > 0 && table_->HasWorker(group)) return group;
  return std::nullopt;
}

void JobRuntime::NoteFault(const std::string& kind, const std::string& detail, std::optional<double> at) {
  goodput_->OnFault(kind, detail, at.value_or(MonotonicSeconds()));
}

GoodputReport JobRuntime::GoodputNow() const { return goodput_->Report(MonotonicSeconds()); }

void JobRuntime::ReportGoodput() {
  GoodputReport report = GoodputNow();
  spdlog::log(report.faults.empty() && !injecting_ ? spdlog::level::info : spdlog::level::warn, "{}", report.Summary());
  if (report_file_.empty()) return;
  std::string json = report.Json(HostName(), run_id_);
  json += "\n";
  absl::Status written = WriteFileAtomically(report_file_, json);
  if (!written.ok()) spdlog::warn("--report-file: {}", std::string(written.message()));
}

absl::Status JobRuntime::AddControlFiles(std::vector<WorkerLaunch>& launches, int attempt) {
  if (!control_) return absl::OkStatus();
  for (WorkerLaunch& launch : launches) {
    absl::StatusOr<std::string> path = control_->PathFor(launch.local_rank);
    if (!path.ok()) return path.status();
    launch.env.push_back("ELRUN_CONTROL_FILE=" + *path);
    launch.env.push_back(absl::StrCat("ELRUN_GENERATION=", attempt));
  }
  return absl::OkStatus();
}

namespace {

// The value of `name` in a launch's environment ("" when unset; the last entry counts).
std::string EnvOf(const WorkerLaunch& launch, const std::string& name) {
  const std::string prefix = name + "=";
  for (auto it = launch.env.rbegin(); it != launch.env.rend(); ++it) {
    if (absl::StartsWith(*it, prefix)) return it->substr(prefix.size());
  }
  return "";
}

}  // namespace

absl::StatusOr<WorkerLaunch> JobRuntime::StandbyLaunch(const WorkerLaunch& base) {
  if (!control_) return absl::FailedPreconditionError("no control channel (--keep-survivors)");
  if (base.out.target != StreamTarget::kInherit || base.err.target != StreamTarget::kInherit) {
    return absl::FailedPreconditionError("workers' streams go to log files (--redirects, --tee)");
  }
  if (!base.cpus.empty() || base.memory_node >= 0)
    return absl::FailedPreconditionError("workers are bound (--numa-binding)");
  if (base.fork_from_server) return absl::FailedPreconditionError("workers are forked (--start-method forkserver)");
  absl::StatusOr<std::string> path = control_->PathFor(-(++standbys_));
  if (!path.ok()) return path.status();
  WorkerLaunch spare = base;
  spare.local_rank = kStandbyLocalRank;
  spare.rank = kStandbyLocalRank;
  spare.env.push_back("ELRUN_CONTROL_FILE=" + *path);
  spare.env.push_back("ELRUN_STANDBY=1");
  return spare;
}

Supervisor::Standby JobRuntime::StandbyHooks() {
  if (!standby_) {
    standby_ = std::make_unique<StandbyWorker>(
        table_.get(), [this](const WorkerLaunch& base) { return StandbyLaunch(base); },
        [this](const WorkerLaunch& spare, const WorkerLaunch& launch) { return SendRegroup(spare, launch); });
  }
  Supervisor::Standby hooks;
  hooks.take = [spare = standby_.get()](const WorkerLaunch& launch) { return spare->Take(launch); };
  hooks.on_all_ready = [spare = standby_.get()](const WorkerLaunch& base) { spare->Start(base); };
  return hooks;
}

bool JobRuntime::SendRegroup(const WorkerLaunch& started_as, const WorkerLaunch& launch) {
  if (!control_) return false;
  std::string line = absl::StrCat("regroup ", EnvOf(launch, "ELRUN_GENERATION"));
  for (const char* name :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"}) {
    absl::StrAppend(&line, " ", name, "=", EnvOf(launch, name));
  }
  absl::Status sent = control_->Send(EnvOf(started_as, "ELRUN_CONTROL_FILE"), line);
  if (!sent.ok()) spdlog::warn("--keep-survivors: {}", std::string(sent.message()));
  return sent.ok();
}

void JobRuntime::PrepareBuilder(AttemptBuilder& builder) const {
  builder.BindWorkers(bindings_);
  if (file_timer_) builder.SetWorkerEnv("TORCHELASTIC_TIMER_FILE", file_timer_->path());
  if (heartbeat_) builder.SetWorkerEnv("ELRUN_HEARTBEAT_FILE", heartbeat_->path());
  if (fork_server_) builder.ForkFromServer();
  if (auto_heartbeat_) {
    builder.SetWorkerEnv("ELRUN_AUTO_HEARTBEAT", "1");
    if (!fork_server_) {  // Exec'd: sitecustomize installs the hook (launcher/python/site).
      builder.SetWorkerEnv("PYTHONPATH", python_dir_->site() + (user_pythonpath_ ? ":" + *user_pythonpath_ : ""));
      if (user_pythonpath_) builder.SetWorkerEnv("ELRUN_USER_PYTHONPATH", *user_pythonpath_);
    }
  }
  // Now that the builder has everything: the server imports torch while the job forms.
  if (fork_server_) {
    if (absl::Status started = table_->PrestartForkServer(builder.Preview()); !started.ok()) {
      spdlog::warn("{}; trying again at the first worker", std::string(started.message()));
    }
  }
}

JobRuntime::~JobRuntime() {
  injector_.reset();
  if (heartbeat_) {
    // Shown by default when the job had stragglers, else with LOGLEVEL=INFO.
    std::string summary = heartbeat_->PaceSummary();
    if (!summary.empty())
      spdlog::log(heartbeat_->saw_stragglers() ? spdlog::level::warn : spdlog::level::info, "{}", summary);
  }
  heartbeat_.reset();
  file_timer_.reset();
  table_.reset();
  if (signal_fd_ >= 0) {
    loop_->Remove(signal_fd_);
    ::close(signal_fd_);
  }
  loop_.reset();
  guardian_.reset();
  if (temp_logs_ && layout_) {
    layout_->RemoveEmptyDirs();
    ::rmdir(log_dir_.c_str());
  }
}

absl::Status JobRuntime::HandleSignals(std::function<void(int signo)> on_signal) {
  return loop_->Add(signal_fd_, [this, on_signal = std::move(on_signal)] {
    signalfd_siginfo info;
    while (::read(signal_fd_, &info, sizeof(info)) == sizeof(info)) {
      spdlog::warn("received {}; forwarding it to the workers", SignalName(info.ssi_signo));
      on_signal(static_cast<int>(info.ssi_signo));
    }
  });
}

absl::Status JobRuntime::RunUntil(const std::function<bool()>& done,
                                  const std::function<std::optional<TimePoint>()>& deadline,
                                  const std::function<void()>& on_deadline) {
  while (!done()) {
    absl::Status status = loop_->RunOnce(deadline());
    if (!status.ok()) return status;
    std::optional<TimePoint> due = deadline();
    if (due && std::chrono::steady_clock::now() >= *due) on_deadline();
  }
  return absl::OkStatus();
}

}  // namespace elrun
