#include "launcher/job/supervisor.h"

#include <csignal>
#include <utility>

namespace elrun {

Supervisor::Supervisor(SupervisorOptions options, ProcessTable* table, const Clock* clock, AttemptPreparer prepare,
                       AttemptObserver on_restart)
    : options_(options),
      table_(table),
      clock_(clock),
      prepare_(std::move(prepare)),
      on_restart_(std::move(on_restart)) {}

void Supervisor::Start(int attempt, int restart_count, bool join_live) {
  attempt_ = attempt;
  restart_count_ = restart_count;
  StartAttempt(join_live);
}

void Supervisor::StartAttempt(bool join_live) {
  state_ = State::kRunning;
  succeeded_ = 0;
  failures_.clear();
  live_.clear();
  ready_.clear();
  started_as_.clear();
  deadline_.reset();

  auto launches = prepare_(attempt_, restart_count_);
  if (!launches.ok()) {
    launches_.clear();
    WorkerFailure failure;
    failure.start_error = std::string(launches.status().message());
    failure.time = clock_->WallNow();
    failures_.push_back(failure);
    state_ = State::kDone;
    exit_code_ = kExitJobFailed;
    return;
  }
  launches_ = *std::move(launches);
  for (const WorkerLaunch& launch : launches_) {
    if (join_live) {
      if (!StartReplacement(launch.local_rank)) {
        BeginStop(StopReason::kFailure, SIGTERM);
        return;
      }
      continue;
    }
    auto pid = table_->Spawn(launch);
    if (!pid.ok()) {
      RecordFailure(launch.local_rank, 0, ExitStatus::Exited(127), std::string(pid.status().message()));
      BeginStop(StopReason::kFailure, SIGTERM);
      return;
    }
    live_[*pid] = launch.local_rank;
    if (options_.keep_survivors) started_as_[*pid] = launch;
  }
  if (launches_.empty()) {
    state_ = State::kDone;
    exit_code_ = kExitSuccess;
  }
}

void Supervisor::RecordFailure(int local_rank, int pid, ExitStatus status, std::string start_error) {
  WorkerFailure failure;
  failure.local_rank = local_rank;
  const WorkerLaunch* launch = LaunchOf(local_rank);
  failure.rank = launch != nullptr ? launch->rank : local_rank;
  failure.pid = pid;
  failure.status = status;
  failure.time = clock_->WallNow();
  failure.stopped_by_elrun = state_ == State::kStopping;
  failure.start_error = std::move(start_error);
  auto cause = causes_.find(pid);
  if (cause != causes_.end()) {
    failure.cause = std::move(cause->second);
    causes_.erase(cause);
  }
  if (state_ == State::kRunning && on_failure_) on_failure_(failure);
  failures_.push_back(std::move(failure));
}

void Supervisor::NoteSignalled(int pid, std::string why) {
  if (live_.count(pid) > 0) causes_[pid] = std::move(why);
}

bool Supervisor::AllReady() const {
  for (const auto& [pid, local_rank] : live_) {
    auto ready = ready_.find(pid);
    if (ready == ready_.end() || ready->second != attempt_) return false;
  }
  return true;
}

bool Supervisor::CanHold() const {
  return options_.keep_survivors && options_.hold_survivors && regroup_ && state_ == State::kRunning &&
         succeeded_ == 0 && !live_.empty() && AllReady();
}

void Supervisor::OnWorkerReady(int pid, int64_t generation) {
  if (live_.count(pid) == 0) return;
  ready_[pid] = generation;
  if (state_ != State::kRunning || !standby_.on_all_ready || all_ready_told_ == attempt_ || succeeded_ > 0 ||
      launches_.empty()) {
    return;
  }
  if (!AllReady()) return;
  all_ready_told_ = attempt_;
  standby_.on_all_ready(launches_.front());
}

bool Supervisor::TellSurvivors() {
  for (const auto& [pid, local_rank] : live_) {
    const WorkerLaunch* launch = LaunchOf(local_rank);
    auto started_as = started_as_.find(pid);
    if (launch == nullptr || started_as == started_as_.end() || !regroup_(pid, started_as->second, *launch)) {
      return false;
    }
    table_->Relabel(pid, launch->local_rank, launch->rank);
  }
  return true;
}

const WorkerLaunch* Supervisor::LaunchOf(int local_rank) const {
  for (const WorkerLaunch& launch : launches_) {
    if (launch.local_rank == local_rank) return &launch;
  }
  return nullptr;
}

bool Supervisor::StartReplacement(int local_rank) {
  const WorkerLaunch* launch = LaunchOf(local_rank);
  if (launch == nullptr) return false;
  if (standby_.take) {
    if (auto spare = standby_.take(*launch)) {  // Told, and already started.
      live_[spare->first] = local_rank;
      started_as_[spare->first] = std::move(spare->second);
      return true;
    }
  }
  WorkerLaunch replacement = *launch;
  replacement.env.push_back("ELRUN_JOIN_LIVE=1");  // Its state comes from the survivors.
  auto pid = table_->Spawn(replacement);
  if (!pid.ok()) {
    RecordFailure(local_rank, 0, ExitStatus::Exited(127), std::string(pid.status().message()));
    return false;
  }
  live_[*pid] = local_rank;
  started_as_[*pid] = std::move(replacement);
  return true;
}

bool Supervisor::Hold() {
  if (!CanHold()) return false;
  state_ = State::kHeld;
  return true;
}

void Supervisor::Regroup(int attempt, int restart_count) {
  if (state_ != State::kHeld) return;
  auto launches = prepare_(attempt, restart_count);
  state_ = State::kRunning;
  if (!launches.ok() || launches->size() != launches_.size()) {
    if (!launches.ok()) {
      WorkerFailure failure;
      failure.start_error = std::string(launches.status().message());
      failure.time = clock_->WallNow();
      failures_.push_back(std::move(failure));
    }
    BeginStop(StopReason::kFailure, SIGTERM);
    return;
  }
  attempt_ = attempt;
  restart_count_ = restart_count;
  launches_ = *std::move(launches);
  failures_.clear();
  if (!TellSurvivors()) {
    BeginStop(StopReason::kFailure, SIGTERM);
    return;
  }
  std::vector<int> missing;
  for (const WorkerLaunch& launch : launches_) {
    bool alive = false;
    for (const auto& [pid, local_rank] : live_) alive |= local_rank == launch.local_rank;
    if (!alive) missing.push_back(launch.local_rank);
  }
  for (int local_rank : missing) {
    if (!StartReplacement(local_rank)) {
      BeginStop(StopReason::kFailure, SIGTERM);
      return;
    }
  }
}

bool Supervisor::TryRegroup(int failed_local_rank) {
  if (!options_.keep_survivors || !regroup_ || restart_count_ >= options_.max_restarts || succeeded_ > 0 ||
      live_.empty()) {
    return false;
  }
  if (!AllReady()) return false;
  auto launches = prepare_(attempt_ + 1, restart_count_ + 1);
  if (!launches.ok() || launches->size() != launches_.size()) return false;  // The group restart says why.
  if (on_regroup_) on_regroup_(attempt_, failures_.back(), static_cast<int>(live_.size()));
  // What the group restart needs should a survivor not be told after all.
  const int attempt_before = attempt_;
  std::vector<WorkerFailure> failures_before = std::move(failures_);
  ++attempt_;
  ++restart_count_;
  launches_ = *std::move(launches);
  failures_.clear();
  if (!TellSurvivors()) {
    // A survivor could not be told: the group restarts instead, from the failure that began
    // this, and this regroup spends no restart (the survivors told are stopped with the rest).
    attempt_ = attempt_before;
    --restart_count_;
    failures_ = std::move(failures_before);
    BeginStop(StopReason::kFailure, SIGTERM);
    return true;
  }
  if (!StartReplacement(failed_local_rank)) BeginStop(StopReason::kFailure, SIGTERM);
  return true;
}

void Supervisor::OnWorkerExit(int pid, ExitStatus status) {
  auto it = live_.find(pid);
  if (it == live_.end() || state_ == State::kDone) return;
  int local_rank = it->second;
  live_.erase(it);
  ready_.erase(pid);
  started_as_.erase(pid);

  if (state_ == State::kRunning) {
    if (status.success()) {
      if (++succeeded_ == static_cast<int>(launches_.size())) {
        state_ = State::kDone;
        exit_code_ = kExitSuccess;
      }
      return;
    }
    RecordFailure(local_rank, pid, status, "");
    if (TryRegroup(local_rank)) return;
    if (CanHold()) {  // The next round regroups the others.
      state_ = State::kHeld;
      return;
    }
    BeginStop(StopReason::kFailure, SIGTERM);
    return;
  }
  if (state_ == State::kHeld) {  // A kept worker ended before its regroup: none is kept.
    if (!status.success()) RecordFailure(local_rank, pid, status, "");
    BeginStop(StopReason::kFailure, SIGTERM);
    return;
  }
  // Stopping: a worker that still failed on its own is reported too.
  if (!status.success()) RecordFailure(local_rank, pid, status, "");
  if (live_.empty()) FinishStop();
}

void Supervisor::OnSignal(int signo) {
  if (state_ == State::kDone) return;
  if (state_ == State::kStopping && stop_reason_ == StopReason::kSignal) {
    // A second signal while stopping: stop waiting for a graceful exit.
    for (const auto& [pid, rank] : live_) table_->SignalGroup(pid, SIGKILL);
    return;
  }
  stop_reason_ = StopReason::kSignal;
  stop_signal_ = signo;
  if (state_ == State::kStopping) {
    // Already stopping after a failure: pass the user's signal on, keep the deadline.
    for (const auto& [pid, rank] : live_) table_->SignalGroup(pid, signo);
    return;
  }
  BeginStop(StopReason::kSignal, signo);
}

void Supervisor::BeginStop(StopReason reason, int signo) {
  state_ = State::kStopping;
  stop_reason_ = reason;
  if (reason == StopReason::kSignal) stop_signal_ = signo;
  if (live_.empty()) {
    FinishStop();
    return;
  }
  for (const auto& [pid, rank] : live_) table_->SignalGroup(pid, signo);
  deadline_ = clock_->SteadyNow() + options_.shutdown_timeout;
}

void Supervisor::Stop() {
  if (state_ == State::kHeld && !failures_.empty()) {  // Its local failure stays the cause.
    BeginStop(StopReason::kFailure, SIGTERM);
    return;
  }
  if (state_ != State::kRunning && state_ != State::kHeld) return;
  BeginStop(StopReason::kRequested, SIGTERM);
}

void Supervisor::OnDeadline() {
  if (state_ != State::kStopping || !deadline_ || clock_->SteadyNow() < *deadline_) return;
  for (const auto& [pid, rank] : live_) table_->SignalGroup(pid, SIGKILL);
  deadline_.reset();
}

void Supervisor::FinishStop() {
  deadline_.reset();
  if (stop_reason_ == StopReason::kSignal) {
    state_ = State::kDone;
    exit_code_ = 128 + stop_signal_;
    return;
  }
  if (stop_reason_ == StopReason::kRequested) {
    state_ = State::kDone;
    exit_code_ = kExitStopped;
    return;
  }
  if (restart_count_ < options_.max_restarts) {
    if (on_restart_) on_restart_(attempt_, failures_);
    ++restart_count_;
    ++attempt_;
    StartAttempt(/*join_live=*/false);
    return;
  }
  state_ = State::kDone;
  exit_code_ = kExitJobFailed;
}

}  // namespace elrun
