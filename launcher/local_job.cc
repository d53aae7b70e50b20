#include "launcher/local_job.h"

#include <sys/signalfd.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "launcher/attempt_builder.h"
#include "launcher/entrypoint.h"
#include "launcher/event_loop.h"
#include "launcher/guardian.h"
#include "launcher/host_info.h"
#include "launcher/log_layout.h"
#include "launcher/posix_process_table.h"
#include "launcher/supervisor.h"

namespace elrun {
namespace {

void UsageError(const std::string& message) {
  std::string line = absl::StrCat("elrun: ", message, "\n");
  WriteAll(STDERR_FILENO, line.data(), line.size());
}

void SetUpLogging(const std::map<std::string, std::string>& env) {
  auto logger = spdlog::stderr_logger_st("elrun");
  logger->set_pattern("[elrun] %l: %v");
  // torchrun's logger honours LOGLEVEL and shows warnings by default; so do we.
  auto level = env.find("LOGLEVEL");
  logger->set_level(level == env.end() ? spdlog::level::warn
                                       : spdlog::level::from_str(absl::AsciiStrToLower(level->second)));
  spdlog::set_default_logger(logger);
}

// A temp directory for the logs when --log-dir is not given.
absl::StatusOr<std::string> MakeTempLogDir(const std::map<std::string, std::string>& env) {
  auto tmp = env.find("TMPDIR");
  std::string pattern = absl::StrCat(tmp == env.end() || tmp->second.empty() ? "/tmp" : tmp->second,
                                     "/elrun-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("mkdtemp ", pattern, ": ", std::strerror(errno)));
  }
  return pattern;
}

// Blocks the handled signals and returns a signalfd that reports them.
absl::StatusOr<int> HandleSignals(const std::vector<int>& signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int signo : signals) {
    // An inherited SIG_IGN would make the kernel drop the signal before signalfd sees it.
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

std::string DescribeFirstFailure(const std::vector<WorkerFailure>& failures) {
  for (const WorkerFailure& f : failures) {
    if (f.stopped_by_elrun) continue;
    if (!f.start_error.empty()) return absl::StrCat("local_rank ", f.local_rank, ": ", f.start_error);
    return absl::StrCat("local_rank ", f.local_rank, " (rank ", f.rank, ", pid ", f.pid, ") ended with ",
                        f.status.Describe());
  }
  return "no failure recorded";
}

}  // namespace

int RunLocalJob(const JobSpec& spec, const std::map<std::string, std::string>& env) {
  SetUpLogging(env);
  if (spec.rdzv_backend != "static" && spec.max_nodes > 1) {
    UsageError(absl::StrCat("--rdzv-backend=", spec.rdzv_backend,
                            " with --nnodes=", spec.min_nodes, ":", spec.max_nodes,
                            ": multi-node rendezvous is not available in this build; use "
                            "--rdzv-backend static with --node-rank on each node"));
    return kExitUsage;
  }
  auto argv_template = ResolveEntrypoint(spec, env);
  if (!argv_template.ok()) {
    UsageError(std::string(argv_template.status().message()));
    return kExitUsage;
  }

  std::string run_id = spec.rdzv_id_generated ? RandomRunId() : spec.rdzv_id;
  bool temp_logs = spec.log_dir.empty();
  std::string log_dir = spec.log_dir;
  if (temp_logs) {
    auto made = MakeTempLogDir(env);
    if (!made.ok()) {
      UsageError(std::string(made.status().message()));
      return kExitJobFailed;
    }
    log_dir = *made;
  }
  LogLayout layout(log_dir, run_id);
  if (DefaultsOmpThreads(spec, env)) {
    spdlog::warn(
        "setting OMP_NUM_THREADS=1 for each worker to avoid overloading the machine; set it "
        "yourself to tune performance");
  }

  ::signal(SIGPIPE, SIG_IGN);
  // An inherited SIG_IGN for SIGCHLD would make the kernel reap workers before we read their
  // exit status.
  ::signal(SIGCHLD, SIG_DFL);
  auto guardian = Guardian::Start();
  if (!guardian.ok()) {
    UsageError(std::string(guardian.status().message()));
    return kExitJobFailed;
  }
  auto signal_fd = HandleSignals(spec.signals_to_handle);
  auto loop = EventLoop::Create();
  if (!signal_fd.ok() || !loop.ok()) {
    UsageError(std::string(!signal_fd.ok() ? signal_fd.status().message() : loop.status().message()));
    return kExitJobFailed;
  }

  RealClock clock;
  AttemptBuilder builder(spec, *argv_template, run_id, layout, env, PickFreePort);
  Supervisor* supervisor_ptr = nullptr;
  PosixProcessTable table(loop->get(), guardian->get(), spec.signals_to_handle,
                          [&supervisor_ptr](int pid, ExitStatus status) {
                            supervisor_ptr->OnWorkerExit(pid, status);
                          });
  Supervisor supervisor(
      SupervisorOptions{spec.max_restarts, spec.shutdown_timeout}, &table, &clock,
      [&](int attempt, int restart_count) {
        auto launches = builder.Build(attempt, restart_count);
        if (launches.ok()) {
          spdlog::info("attempt {}: {} workers, run_id {}, world size {}, master {}:{}, logs {}",
                       attempt, launches->size(), run_id, builder.node().world_size,
                       builder.node().master_addr, builder.node().master_port,
                       layout.AttemptDir(attempt));
        }
        return launches;
      },
      [&](int attempt, const std::vector<WorkerFailure>& failures) {
        spdlog::warn("attempt {} failed: {}; restarting the worker group (restart {} of {})",
                     attempt, DescribeFirstFailure(failures), supervisor_ptr->restart_count() + 1,
                     spec.max_restarts);
      });
  supervisor_ptr = &supervisor;

  absl::Status added = (*loop)->Add(*signal_fd, [&] {
    signalfd_siginfo info;
    while (::read(*signal_fd, &info, sizeof(info)) == sizeof(info)) {
      spdlog::warn("received {}; forwarding it to the workers", SignalName(info.ssi_signo));
      supervisor.OnSignal(static_cast<int>(info.ssi_signo));
    }
  });
  if (!added.ok()) {
    UsageError(std::string(added.message()));
    return kExitJobFailed;
  }

  supervisor.Start();
  while (!supervisor.done()) {
    absl::Status status = (*loop)->RunOnce(supervisor.deadline());
    if (!status.ok()) {
      UsageError(std::string(status.message()));
      return kExitJobFailed;
    }
    if (supervisor.deadline() && clock.SteadyNow() >= *supervisor.deadline()) {
      spdlog::warn("workers still running {} ms after being told to stop; sending SIGKILL",
                   spec.shutdown_timeout.count());
      supervisor.OnDeadline();
    }
  }

  int code = supervisor.exit_code();
  if (code == kExitJobFailed) {
    std::vector<WorkerFailure> failures = supervisor.failures();
    for (WorkerFailure& failure : failures) {
      for (const WorkerLaunch& launch : supervisor.launches()) {
        if (launch.local_rank == failure.local_rank) AttachWorkerFiles(launch, &failure);
      }
    }
    JobSummary summary{spec.training_script, HostName(), run_id, builder.node().group_rank,
                       supervisor.attempt() + 1, spec.max_restarts};
    std::string report = FormatFailureReport(summary, failures);
    WriteAll(STDERR_FILENO, report.data(), report.size());
  }
  if (temp_logs) {
    layout.RemoveEmptyDirs();
    ::rmdir(log_dir.c_str());
  }
  return code;
}

}  // namespace elrun
