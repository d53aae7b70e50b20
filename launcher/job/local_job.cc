#include "launcher/job/local_job.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "launcher/job/job_report.h"
#include "launcher/job/job_runtime.h"
#include "launcher/job/supervisor.h"
#include "launcher/os/host_info.h"
#include "launcher/os/port_reservation.h"
#include "launcher/report/console.h"
#include "launcher/worker/attempt_builder.h"
#include "launcher/worker/entrypoint.h"

namespace elrun {

int RunLocalJob(const JobSpec& spec, const std::map<std::string, std::string>& env,
                const std::vector<std::string>& argv_template) {
  std::string run_id = spec.rdzv_id_generated ? RandomRunId() : spec.rdzv_id;
  Supervisor* supervisor_ptr = nullptr;
  auto runtime = JobRuntime::Create(
      spec, env, run_id, [&supervisor_ptr](int pid, ExitStatus status) { supervisor_ptr->OnWorkerExit(pid, status); });
  if (!runtime.ok()) {
    PrintError(std::string(runtime.status().message()));
    return kExitJobFailed;
  }
  JobRuntime& rt = **runtime;

  RealClock clock;
  AttemptBuilder builder(spec, argv_template, run_id, rt.layout(), env, PortReservation::Take);
  rt.PrepareBuilder(builder);
  Supervisor supervisor(
      SupervisorOptions{spec.max_restarts, spec.shutdown_timeout, spec.keep_survivors}, &rt.table(), &clock,
      [&](int attempt, int restart_count) -> absl::StatusOr<std::vector<WorkerLaunch>> {
        auto launches = builder.Build(attempt, restart_count);
        if (launches.ok()) {
          if (absl::Status added = rt.AddControlFiles(*launches, attempt); !added.ok()) return added;
          spdlog::info("attempt {}: {} workers, run_id {}, world size {}, master {}:{}, logs {}", attempt,
                       launches->size(), run_id, builder.node().world_size, builder.node().master_addr,
                       builder.node().master_port, rt.layout().AttemptDir(attempt));
        }
        return launches;
      },
      [&](int attempt, const std::vector<WorkerFailure>& failures) {
        spdlog::warn("attempt {} failed: {}; restarting the worker group (restart {} of {})", attempt,
                     DescribeFirstFailure(failures), supervisor_ptr->restart_count() + 1, spec.max_restarts);
      });
  supervisor_ptr = &supervisor;
  if (spec.keep_survivors) {
    supervisor.SetRegrouper(
        [&rt](int, const WorkerLaunch& started_as, const WorkerLaunch& launch) {
          return rt.SendRegroup(started_as, launch);
        },
        [&](int attempt, const WorkerFailure& failure, int survivors) {
          spdlog::warn(
              "attempt {} failed: {}; restarting local rank {} alone, {} worker{} regroup{} in place "
              "(restart {} of {})",
              attempt, DescribeFirstFailure({failure}), failure.local_rank, survivors, survivors == 1 ? "" : "s",
              survivors == 1 ? "s" : "", supervisor_ptr->restart_count() + 1, spec.max_restarts);
        });
    if (rt.heartbeat()) {
      rt.heartbeat()->OnReady(
          [&supervisor](int pid, int64_t generation) { supervisor.OnWorkerReady(pid, generation); });
    }
    supervisor.SetStandby(rt.StandbyHooks());
  }
  supervisor.OnFailure(
      [&rt](const WorkerFailure& failure) { rt.NoteFault("worker failed", DescribeFirstFailure({failure})); });
  rt.OnWatchdogSignal([&supervisor](int pid, const std::string& why) { supervisor.NoteSignalled(pid, why); });

  absl::Status status = rt.HandleSignals([&](int signo) { supervisor.OnSignal(signo); });
  if (status.ok()) {
    supervisor.Start();
    status = rt.RunUntil([&] { return supervisor.done(); }, [&] { return supervisor.deadline(); },
                         [&] {
                           spdlog::warn(
                               "workers still running {} ms after being told to stop; "
                               "sending SIGKILL",
                               spec.shutdown_timeout.count());
                           supervisor.OnDeadline();
                         });
  }
  if (!status.ok()) {
    PrintError(std::string(status.message()));
    return kExitJobFailed;
  }
  rt.ReportGoodput();
  if (supervisor.exit_code() == kExitJobFailed) {
    PrintFailureReport(spec, supervisor, run_id, builder.node().group_rank, env);
  }
  return supervisor.exit_code();
}

}  // namespace elrun
