#include "launcher/job/standby_worker.h"

#include <spdlog/spdlog.h>

#include <csignal>

namespace elrun {

void StandbyWorker::Start(const WorkerLaunch& base) {
  if (pid_ > 0 || given_up_) return;
  absl::StatusOr<WorkerLaunch> launch = make_(base);
  if (!launch.ok()) {
    spdlog::info("--keep-survivors: no standby worker: {}; a replacement starts from scratch",
                 std::string(launch.status().message()));
    given_up_ = true;
    return;
  }
  absl::StatusOr<int> pid = table_->Spawn(*launch);
  if (!pid.ok()) {
    spdlog::warn("--keep-survivors: the standby worker did not start: {}", std::string(pid.status().message()));
    given_up_ = true;
    return;
  }
  pid_ = *pid;
  launch_ = *std::move(launch);
}

std::optional<std::pair<int, WorkerLaunch>> StandbyWorker::Take(const WorkerLaunch& launch) {
  if (pid_ <= 0) return std::nullopt;
  const int pid = pid_;
  pid_ = 0;
  if (!tell_(launch_, launch)) {
    table_->SignalGroup(pid, SIGKILL);  // Its exit comes later; OnExit no longer knows it.
    return std::nullopt;
  }
  table_->Relabel(pid, launch.local_rank, launch.rank);
  return std::make_pair(pid, std::move(launch_));
}

bool StandbyWorker::OnExit(int pid, ExitStatus status) {
  if (pid_ <= 0 || pid != pid_) return false;
  pid_ = 0;
  if (++deaths_ >= 2) given_up_ = true;
  spdlog::warn("--keep-survivors: the standby worker (pid {}) ended on its own ({}){}", pid, status.Describe(),
               given_up_ ? "; no more standby workers" : "");
  return true;
}

}  // namespace elrun
