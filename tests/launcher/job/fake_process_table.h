// Fakes of the OS side for supervisor tests: a process table whose workers never run (the test
// decides when and how each ends) and a clock the test sets.
#ifndef ELRUN_TESTS_LAUNCHER_JOB_FAKE_PROCESS_TABLE_H_
#define ELRUN_TESTS_LAUNCHER_JOB_FAKE_PROCESS_TABLE_H_

#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "launcher/os/clock.h"
#include "launcher/os/process_table.h"

namespace elrun {

class FakeProcessTable : public ProcessTable {
 public:
  absl::StatusOr<int> Spawn(const WorkerLaunch& launch) override {
    if (fail_spawn_of_rank_ == launch.local_rank) {
      fail_spawn_of_rank_.reset();
      return absl::FailedPreconditionError("cannot execute /x: Permission denied");
    }
    int pid = next_pid_++;
    spawned_.push_back({pid, launch});
    alive_.insert(pid);
    return pid;
  }
  void SignalGroup(int pid, int signo) override { signals_.emplace_back(pid, signo); }
  void Relabel(int pid, int local_rank, int rank) override { relabels_.push_back({pid, local_rank, rank}); }

  // The next Spawn of this local rank fails.
  void FailSpawnOf(int local_rank) { fail_spawn_of_rank_ = local_rank; }
  // Marks a worker dead; the test then tells the supervisor.
  void Exit(int pid) { alive_.erase(pid); }

  const std::vector<std::pair<int, WorkerLaunch>>& spawned() const { return spawned_; }
  const std::vector<std::pair<int, int>>& signals() const { return signals_; }
  bool WasSignaled(int pid, int signo) const {
    for (const auto& [p, s] : signals_) {
      if (p == pid && s == signo) return true;
    }
    return false;
  }
  const std::set<int>& alive() const { return alive_; }
  struct Relabelled {
    int pid, local_rank, rank;
  };
  const std::vector<Relabelled>& relabels() const { return relabels_; }

 private:
  int next_pid_ = 100;
  std::optional<int> fail_spawn_of_rank_;
  std::vector<std::pair<int, WorkerLaunch>> spawned_;
  std::vector<std::pair<int, int>> signals_;
  std::set<int> alive_;
  std::vector<Relabelled> relabels_;
};

class FakeClock : public Clock {
 public:
  std::chrono::steady_clock::time_point SteadyNow() const override { return steady_; }
  std::chrono::system_clock::time_point WallNow() const override { return wall_; }
  void Advance(std::chrono::milliseconds by) {
    steady_ += by;
    wall_ += by;
  }

 private:
  std::chrono::steady_clock::time_point steady_{std::chrono::seconds(1000)};
  std::chrono::system_clock::time_point wall_{std::chrono::seconds(1700000000)};
};

}  // namespace elrun

#endif  // ELRUN_TESTS_LAUNCHER_JOB_FAKE_PROCESS_TABLE_H_
