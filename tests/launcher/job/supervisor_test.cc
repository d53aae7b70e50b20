#include "launcher/job/supervisor.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <csignal>

#include "tests/launcher/job/fake_process_table.h"

namespace elrun {
namespace {

using std::chrono::milliseconds;

struct Harness {
  FakeProcessTable table;
  FakeClock clock;
  std::vector<int> prepared_restart_counts;
  std::vector<int> observed_failed_attempts;
  bool fail_prepare = false;
  Supervisor supervisor;

  Harness(int nproc, int max_restarts, milliseconds timeout = milliseconds(500), bool keep_survivors = false,
          bool hold_survivors = false)
      : supervisor(
            SupervisorOptions{max_restarts, timeout, keep_survivors, hold_survivors}, &table, &clock,
            [this, nproc](int attempt, int restart_count) -> absl::StatusOr<std::vector<WorkerLaunch>> {
              if (fail_prepare) return absl::FailedPreconditionError("cannot create log directory");
              prepared_restart_counts.push_back(restart_count);
              std::vector<WorkerLaunch> launches(nproc);
              for (int i = 0; i < nproc; ++i) {
                launches[i].local_rank = i;
                launches[i].rank = 10 + i;
                launches[i].error_file = "attempt_" + std::to_string(attempt);
              }
              return launches;
            },
            [this](int attempt, const std::vector<WorkerFailure>&) { observed_failed_attempts.push_back(attempt); }) {}

  // pids of the current attempt's workers, by local rank.
  std::vector<int> CurrentPids(int nproc) const {
    std::vector<int> pids;
    const auto& spawned = table.spawned();
    for (size_t i = spawned.size() - nproc; i < spawned.size(); ++i) pids.push_back(spawned[i].first);
    return pids;
  }
  void End(int pid, ExitStatus status) {
    table.Exit(pid);
    supervisor.OnWorkerExit(pid, status);
  }
};

TEST_CASE("all workers succeed: exit 0, nothing signalled") {
  Harness h(3, 0);
  h.supervisor.Start();
  REQUIRE(h.table.spawned().size() == 3);
  for (int pid : h.CurrentPids(3)) {
    CHECK_FALSE(h.supervisor.done());
    h.End(pid, ExitStatus::Exited(0));
  }
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitSuccess);
  CHECK(h.table.signals().empty());
  CHECK_FALSE(h.supervisor.deadline().has_value());
}

TEST_CASE("a failure stops the others with SIGTERM and arms the shutdown deadline") {
  Harness h(3, 0, milliseconds(750));
  h.supervisor.Start();
  auto pids = h.CurrentPids(3);
  h.End(pids[1], ExitStatus::Exited(3));
  CHECK(h.table.WasSignaled(pids[0], SIGTERM));
  CHECK(h.table.WasSignaled(pids[2], SIGTERM));
  CHECK_FALSE(h.table.WasSignaled(pids[1], SIGTERM));
  REQUIRE(h.supervisor.deadline().has_value());
  CHECK(*h.supervisor.deadline() == h.clock.SteadyNow() + milliseconds(750));
  CHECK_FALSE(h.supervisor.done());
}

TEST_CASE("no restarts left: exit 1 with the first failure as root cause") {
  Harness h(2, 0);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.End(pids[1], ExitStatus::Exited(7));
  h.End(pids[0], ExitStatus::Signaled(SIGTERM));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitJobFailed);
  const auto& failures = h.supervisor.failures();
  REQUIRE(failures.size() == 2);
  CHECK(failures[0].local_rank == 1);
  CHECK(failures[0].rank == 11);
  CHECK(failures[0].pid == pids[1]);
  CHECK(failures[0].status == ExitStatus::Exited(7));
  CHECK_FALSE(failures[0].stopped_by_elrun);
  CHECK(failures[1].stopped_by_elrun);
  CHECK(failures[1].status == ExitStatus::Signaled(SIGTERM));
}

TEST_CASE("a worker elrun signalled (the FileTimer watchdog) fails with that cause") {
  Harness h(2, 0);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.supervisor.NoteSignalled(pids[0], "FileTimer watchdog: timer step of pid 7 expired; sent SIGKILL");
  h.supervisor.NoteSignalled(12345, "not a worker: ignored");
  h.End(pids[0], ExitStatus::Signaled(SIGKILL));
  h.End(pids[1], ExitStatus::Signaled(SIGTERM));
  const auto& failures = h.supervisor.failures();
  REQUIRE(failures.size() == 2);
  CHECK(failures[0].cause == "FileTimer watchdog: timer step of pid 7 expired; sent SIGKILL");
  CHECK_FALSE(failures[0].stopped_by_elrun);
  CHECK(failures[1].cause.empty());
}

TEST_CASE("a worker that exits 0 while being stopped is not a failure") {
  Harness h(2, 0);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.End(pids[0], ExitStatus::Exited(1));
  h.End(pids[1], ExitStatus::Exited(0));
  CHECK(h.supervisor.failures().size() == 1);
}

TEST_CASE("failure with restarts left starts the next attempt with restart count + 1") {
  Harness h(2, 2);
  h.supervisor.Start();
  auto first = h.CurrentPids(2);
  h.End(first[0], ExitStatus::Exited(1));
  CHECK(h.table.spawned().size() == 2);  // Not restarted before the others have ended.
  h.End(first[1], ExitStatus::Signaled(SIGTERM));
  REQUIRE(h.table.spawned().size() == 4);
  CHECK(h.prepared_restart_counts == std::vector<int>{0, 1});
  CHECK(h.observed_failed_attempts == std::vector<int>{0});
  CHECK(h.supervisor.restart_count() == 1);
  CHECK(h.supervisor.attempt() == 1);
  CHECK_FALSE(h.supervisor.deadline().has_value());
  CHECK(h.supervisor.failures().empty());

  for (int pid : h.CurrentPids(2)) h.End(pid, ExitStatus::Exited(0));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitSuccess);
}

TEST_CASE("the restart budget is spent exactly") {
  Harness h(1, 2);
  h.supervisor.Start();
  for (int attempt = 0; attempt < 3; ++attempt) {
    REQUIRE_FALSE(h.supervisor.done());
    h.End(h.CurrentPids(1)[0], ExitStatus::Exited(1));
  }
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitJobFailed);
  CHECK(h.prepared_restart_counts == std::vector<int>{0, 1, 2});
  CHECK(h.supervisor.attempt() == 2);
}

TEST_CASE("workers ignoring SIGTERM get SIGKILL at the deadline, not before") {
  Harness h(2, 0, milliseconds(1000));
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.End(pids[0], ExitStatus::Exited(1));
  h.clock.Advance(milliseconds(999));
  h.supervisor.OnDeadline();
  CHECK_FALSE(h.table.WasSignaled(pids[1], SIGKILL));
  h.clock.Advance(milliseconds(1));
  h.supervisor.OnDeadline();
  CHECK(h.table.WasSignaled(pids[1], SIGKILL));
  h.End(pids[1], ExitStatus::Signaled(SIGKILL));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.failures()[1].stopped_by_elrun);
}

TEST_CASE("a signal is forwarded to every worker and the exit code is 128 + signo") {
  Harness h(2, 5);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.supervisor.OnSignal(SIGINT);
  CHECK(h.table.WasSignaled(pids[0], SIGINT));
  CHECK(h.table.WasSignaled(pids[1], SIGINT));
  h.End(pids[0], ExitStatus::Signaled(SIGINT));
  h.End(pids[1], ExitStatus::Exited(0));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == 128 + SIGINT);
  CHECK(h.table.spawned().size() == 2);  // A signal never restarts, whatever the budget.
}

TEST_CASE("a second signal while stopping kills at once") {
  Harness h(1, 0);
  h.supervisor.Start();
  int pid = h.CurrentPids(1)[0];
  h.supervisor.OnSignal(SIGTERM);
  CHECK_FALSE(h.table.WasSignaled(pid, SIGKILL));
  h.supervisor.OnSignal(SIGTERM);
  CHECK(h.table.WasSignaled(pid, SIGKILL));
}

TEST_CASE("a signal during a failure stop ends the job without restart") {
  Harness h(2, 3);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.End(pids[0], ExitStatus::Exited(1));
  h.supervisor.OnSignal(SIGHUP);
  CHECK(h.table.WasSignaled(pids[1], SIGHUP));
  h.End(pids[1], ExitStatus::Signaled(SIGHUP));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == 128 + SIGHUP);
  CHECK(h.table.spawned().size() == 2);
}

TEST_CASE("a worker that cannot start is a failure; the started ones are stopped") {
  Harness h(3, 0);
  h.table.FailSpawnOf(1);
  h.supervisor.Start();
  REQUIRE(h.table.spawned().size() == 1);
  int pid0 = h.table.spawned()[0].first;
  CHECK(h.table.WasSignaled(pid0, SIGTERM));
  h.End(pid0, ExitStatus::Signaled(SIGTERM));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitJobFailed);
  REQUIRE_FALSE(h.supervisor.failures().empty());
  CHECK(h.supervisor.failures()[0].local_rank == 1);
  CHECK(h.supervisor.failures()[0].start_error.find("Permission denied") != std::string::npos);
}

TEST_CASE("an attempt that cannot be prepared fails the job") {
  Harness h(2, 3);
  h.fail_prepare = true;
  h.supervisor.Start();
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitJobFailed);
  CHECK(h.table.spawned().empty());
  REQUIRE(h.supervisor.failures().size() == 1);
  CHECK(h.supervisor.failures()[0].start_error == "cannot create log directory");
}

TEST_CASE("exits of unknown pids are ignored") {
  Harness h(1, 0);
  h.supervisor.Start();
  h.supervisor.OnWorkerExit(99999, ExitStatus::Exited(1));
  CHECK_FALSE(h.supervisor.done());
  CHECK(h.table.signals().empty());
}

TEST_CASE("failure times come from the clock") {
  Harness h(1, 0);
  h.supervisor.Start();
  h.clock.Advance(milliseconds(2500));
  h.End(h.CurrentPids(1)[0], ExitStatus::Exited(2));
  CHECK(h.supervisor.failures()[0].time ==
        std::chrono::system_clock::time_point(std::chrono::milliseconds(1700000002500)));
}

}  // namespace
}  // namespace elrun

namespace elrun {
namespace {

TEST_CASE("Stop ends the group without a failure or a restart") {
  Harness h(2, 3);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.supervisor.Stop();
  CHECK(h.table.WasSignaled(pids[0], SIGTERM));
  CHECK(h.table.WasSignaled(pids[1], SIGTERM));
  REQUIRE(h.supervisor.deadline().has_value());
  h.End(pids[0], ExitStatus::Signaled(SIGTERM));
  h.End(pids[1], ExitStatus::Exited(0));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitStopped);
  CHECK(h.table.spawned().size() == 2);
  CHECK(h.supervisor.restart_count() == 0);
}

TEST_CASE("Stop during a failure stop changes nothing") {
  Harness h(2, 0);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.End(pids[0], ExitStatus::Exited(1));
  h.supervisor.Stop();
  h.End(pids[1], ExitStatus::Signaled(SIGTERM));
  CHECK(h.supervisor.exit_code() == kExitJobFailed);
}

TEST_CASE("a signal during a requested stop still ends with 128 + signo") {
  Harness h(1, 0);
  h.supervisor.Start();
  int pid = h.CurrentPids(1)[0];
  h.supervisor.Stop();
  h.supervisor.OnSignal(SIGINT);
  h.End(pid, ExitStatus::Signaled(SIGINT));
  CHECK(h.supervisor.exit_code() == 128 + SIGINT);
}

}  // namespace
}  // namespace elrun

namespace elrun {
namespace {

// --keep-survivors: what the regrouper was told, and a harness whose workers can regroup.
struct Regroups {
  std::vector<std::pair<int, WorkerLaunch>> told;  // (survivor pid, its new launch)
  std::vector<int> counts;
  std::vector<std::pair<int, int>> observed;  // (failed attempt, survivors)
  bool refuse = false;
};

struct KeepHarness : Harness {
  Regroups regroups;
  KeepHarness(int nproc, int max_restarts, bool hold = false)
      : Harness(nproc, max_restarts, milliseconds(500), true, hold) {
    supervisor.SetRegrouper(
        [this](int pid, const WorkerLaunch&, const WorkerLaunch& launch) {
          if (regroups.refuse) return false;
          regroups.told.emplace_back(pid, launch);
          regroups.counts.push_back(supervisor.restart_count());
          return true;
        },
        [this](int attempt, const WorkerFailure&, int survivors) {
          regroups.observed.emplace_back(attempt, survivors);
        });
  }
  void AllReady(const std::vector<int>& pids, int generation) {
    for (int pid : pids) supervisor.OnWorkerReady(pid, generation);
  }
};

bool HasEnv(const WorkerLaunch& launch, const std::string& entry) {
  return std::find(launch.env.begin(), launch.env.end(), entry) != launch.env.end();
}

TEST_CASE("keep-survivors: a failed worker is restarted alone and the survivors are told the new attempt") {
  KeepHarness h(3, 2);
  h.supervisor.Start();
  auto pids = h.CurrentPids(3);
  h.AllReady(pids, 0);
  h.End(pids[1], ExitStatus::Signaled(SIGKILL));
  CHECK(h.table.signals().empty());  // Nobody stopped.
  REQUIRE(h.table.spawned().size() == 4);
  const WorkerLaunch& replacement = h.table.spawned().back().second;
  CHECK(replacement.local_rank == 1);
  CHECK(replacement.error_file == "attempt_1");
  CHECK(HasEnv(replacement, "ELRUN_JOIN_LIVE=1"));
  REQUIRE(h.regroups.told.size() == 2);
  CHECK(h.regroups.told[0].first == pids[0]);
  CHECK(h.regroups.told[0].second.local_rank == 0);
  CHECK(h.regroups.told[1].first == pids[2]);
  CHECK(h.regroups.told[1].second.error_file == "attempt_1");
  CHECK(!HasEnv(h.regroups.told[1].second, "ELRUN_JOIN_LIVE=1"));
  CHECK(h.regroups.counts == std::vector<int>{1, 1});
  REQUIRE(h.regroups.observed.size() == 1);
  CHECK(h.regroups.observed[0] == std::make_pair(0, 2));
  CHECK(h.supervisor.restart_count() == 1);
  CHECK(h.supervisor.attempt() == 1);
  CHECK(h.prepared_restart_counts == std::vector<int>{0, 1});

  // The job then ends as any other: all three, the replacement included, succeed.
  const int replacement_pid = h.table.spawned().back().first;
  for (int pid : {pids[0], pids[2], replacement_pid}) h.End(pid, ExitStatus::Exited(0));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitSuccess);
}

TEST_CASE("keep-survivors: a worker that never said it can regroup makes the group restart") {
  KeepHarness h(3, 2);
  h.supervisor.Start();
  auto pids = h.CurrentPids(3);
  h.AllReady({pids[0], pids[1]}, 0);
  h.End(pids[1], ExitStatus::Exited(1));
  CHECK(h.regroups.told.empty());
  CHECK(h.table.WasSignaled(pids[0], SIGTERM));
  CHECK(h.table.WasSignaled(pids[2], SIGTERM));
}

TEST_CASE("keep-survivors: a failure before the last regroup completed restarts the group") {
  KeepHarness h(2, 3);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.AllReady(pids, 0);
  h.End(pids[0], ExitStatus::Exited(1));
  REQUIRE(h.regroups.told.size() == 1);
  const int replacement = h.table.spawned().back().first;
  // The survivor fails before the replacement said ready in generation 1 (it says so once the
  // new group holds the live state); being ready in an older generation does not count.
  h.supervisor.OnWorkerReady(replacement, 0);
  h.End(pids[1], ExitStatus::Exited(1));
  CHECK(h.regroups.told.size() == 1);
  CHECK(h.table.WasSignaled(replacement, SIGTERM));
  h.End(replacement, ExitStatus::Signaled(SIGTERM));
  CHECK(h.supervisor.restart_count() == 2);  // The group restart spent one more.
  CHECK(h.table.spawned().size() == 5);      // 2 + the replacement + a new group of 2.
}

TEST_CASE("keep-survivors: a regroup once everyone is ready again in the new generation") {
  KeepHarness h(2, 3);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.AllReady(pids, 0);
  h.End(pids[0], ExitStatus::Exited(1));
  const int replacement = h.table.spawned().back().first;
  h.AllReady({pids[1], replacement}, 1);
  h.End(replacement, ExitStatus::Exited(1));
  CHECK(h.table.signals().empty());
  CHECK(h.regroups.counts == std::vector<int>{1, 2});
  CHECK(h.supervisor.restart_count() == 2);
}

TEST_CASE("keep-survivors: no restart left fails the job as without it") {
  KeepHarness h(2, 0);
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.AllReady(pids, 0);
  h.End(pids[0], ExitStatus::Exited(7));
  CHECK(h.regroups.told.empty());
  CHECK(h.table.WasSignaled(pids[1], SIGTERM));
  h.End(pids[1], ExitStatus::Signaled(SIGTERM));
  CHECK(h.supervisor.done());
  CHECK(h.supervisor.exit_code() == kExitJobFailed);
  REQUIRE(!h.supervisor.failures().empty());
  CHECK(h.supervisor.failures()[0].status.code == 7);
}

TEST_CASE("keep-survivors: a survivor that cannot be told, or one that already finished, restarts the group") {
  SUBCASE("cannot be told") {
    KeepHarness h(2, 2);
    h.regroups.refuse = true;
    h.supervisor.Start();
    auto pids = h.CurrentPids(2);
    h.AllReady(pids, 0);
    h.End(pids[0], ExitStatus::Exited(1));
    CHECK(h.table.WasSignaled(pids[1], SIGTERM));
    CHECK(h.table.spawned().size() == 2);
    CHECK(h.supervisor.restart_count() == 0);  // The regroup that did not happen spent nothing.
    h.End(pids[1], ExitStatus::Signaled(SIGTERM));
    CHECK(h.supervisor.restart_count() == 1);  // The group restart did.
    CHECK(h.supervisor.attempt() == 1);
    CHECK(h.observed_failed_attempts == std::vector<int>{0});
  }
  SUBCASE("finished") {
    KeepHarness h(3, 2);
    h.supervisor.Start();
    auto pids = h.CurrentPids(3);
    h.AllReady(pids, 0);
    h.End(pids[2], ExitStatus::Exited(0));
    h.End(pids[0], ExitStatus::Exited(1));
    CHECK(h.regroups.told.empty());
    CHECK(h.table.WasSignaled(pids[1], SIGTERM));
  }
}

}  // namespace
}  // namespace elrun

namespace elrun {
namespace {

TEST_CASE("keep-survivors: a standby spare is handed the failed worker and a new one starts once all are ready") {
  KeepHarness h(2, 3);
  std::vector<int> all_ready;  // Generations told.
  std::vector<WorkerLaunch> taken;
  const int spare_pid = 999;
  h.supervisor.SetStandby({[&](const WorkerLaunch& launch) -> std::optional<std::pair<int, WorkerLaunch>> {
                             taken.push_back(launch);
                             if (taken.size() > 1) return std::nullopt;  // No spare the second time.
                             WorkerLaunch spare;
                             spare.local_rank = kStandbyLocalRank;
                             return std::make_pair(spare_pid, spare);
                           },
                           [&](const WorkerLaunch& base) {
                             CHECK(base.local_rank == 0);
                             all_ready.push_back(h.supervisor.restart_count());
                           }});
  h.supervisor.Start();
  auto pids = h.CurrentPids(2);
  h.supervisor.OnWorkerReady(pids[0], 0);
  CHECK(all_ready.empty());
  h.supervisor.OnWorkerReady(pids[1], 0);
  h.supervisor.OnWorkerReady(pids[1], 0);  // Told once per generation.
  CHECK(all_ready == std::vector<int>{0});

  h.End(pids[1], ExitStatus::Signaled(SIGKILL));
  CHECK(h.table.spawned().size() == 2);  // The spare took its place: nothing started.
  REQUIRE(taken.size() == 1);
  CHECK(taken[0].local_rank == 1);
  CHECK(!HasEnv(taken[0], "ELRUN_JOIN_LIVE=1"));
  h.supervisor.OnWorkerReady(pids[0], 1);
  h.supervisor.OnWorkerReady(spare_pid, 1);
  CHECK(all_ready == std::vector<int>{0, 1});

  // The spare is a worker now: its failure regroups again; with no spare left a process starts.
  h.table.Exit(spare_pid);
  h.supervisor.OnWorkerExit(spare_pid, ExitStatus::Exited(1));
  CHECK(h.regroups.told.size() == 2);
  CHECK(h.supervisor.restart_count() == 2);
  REQUIRE(h.table.spawned().size() == 3);
  CHECK(h.table.spawned().back().second.local_rank == 1);
  CHECK(HasEnv(h.table.spawned().back().second, "ELRUN_JOIN_LIVE=1"));
}

// A multi-node agent's group (hold_survivors): the rendezvous spends restarts and forms rounds.
TEST_CASE("hold: a failed worker leaves the others held, and the next round regroups them") {
  KeepHarness h(3, 0, /*hold=*/true);
  h.supervisor.Start(/*attempt=*/4, /*restart_count=*/2);
  auto pids = h.CurrentPids(3);
  CHECK(h.table.spawned()[0].second.error_file == "attempt_4");
  h.AllReady(pids, 4);
  h.End(pids[1], ExitStatus::Signaled(SIGKILL));
  CHECK(h.supervisor.held());
  CHECK_FALSE(h.supervisor.done());
  CHECK(h.table.signals().empty());              // Nobody stopped,
  CHECK(h.table.spawned().size() == 3);          // nobody started: the round decides.
  REQUIRE(h.supervisor.failures().size() == 1);  // For the agent's report.
  CHECK(h.supervisor.failures()[0].local_rank == 1);

  h.supervisor.Regroup(/*attempt=*/5, /*restart_count=*/3);
  CHECK_FALSE(h.supervisor.held());
  CHECK(h.supervisor.attempt() == 5);
  CHECK(h.supervisor.restart_count() == 3);
  CHECK(h.supervisor.failures().empty());
  REQUIRE(h.regroups.told.size() == 2);
  CHECK(h.regroups.told[0].first == pids[0]);
  CHECK(h.regroups.told[0].second.error_file == "attempt_5");
  CHECK(h.regroups.told[1].first == pids[2]);
  CHECK(h.table.relabels().size() == 2);
  REQUIRE(h.table.spawned().size() == 4);
  CHECK(h.table.spawned().back().second.local_rank == 1);
  CHECK(HasEnv(h.table.spawned().back().second, "ELRUN_JOIN_LIVE=1"));
  CHECK(h.regroups.observed.empty());  // Not a local regroup: no restart line of its own.

  // Generation 5 now: the kept workers must say ready again before they can be held again.
  h.AllReady({pids[0], pids[2]}, 4);
  CHECK_FALSE(h.supervisor.Hold());
  h.AllReady({pids[0], pids[2], h.table.spawned().back().first}, 5);
  CHECK(h.supervisor.Hold());  // A round ended elsewhere.
  CHECK(h.supervisor.held());
  CHECK(h.supervisor.failures().empty());
}

TEST_CASE("hold: a worker not ready, a held worker that dies, a stop while held") {
  SUBCASE("a failure with a worker not ready stops the group as before") {
    KeepHarness h(2, 0, true);
    h.supervisor.Start(1, 0);
    auto pids = h.CurrentPids(2);
    h.AllReady({pids[0]}, 0);  // An old generation: not ready in attempt 1.
    h.End(pids[1], ExitStatus::Exited(1));
    CHECK_FALSE(h.supervisor.held());
    CHECK(h.table.WasSignaled(pids[0], SIGTERM));
    CHECK_FALSE(h.supervisor.Hold());
  }
  SUBCASE("the last worker's failure holds nothing") {
    KeepHarness h(1, 0, true);
    h.supervisor.Start();
    auto pids = h.CurrentPids(1);
    h.AllReady(pids, 0);
    h.End(pids[0], ExitStatus::Exited(1));
    CHECK(h.supervisor.done());
    CHECK(h.supervisor.exit_code() == kExitJobFailed);
  }
  SUBCASE("a held worker that ends before its regroup stops the rest: nothing is kept") {
    KeepHarness h(3, 0, true);
    h.supervisor.Start();
    auto pids = h.CurrentPids(3);
    h.AllReady(pids, 0);
    REQUIRE(h.supervisor.Hold());
    h.End(pids[0], ExitStatus::Exited(1));
    CHECK_FALSE(h.supervisor.held());
    CHECK(h.table.WasSignaled(pids[1], SIGTERM));
    h.End(pids[1], ExitStatus::Signaled(SIGTERM));
    h.End(pids[2], ExitStatus::Signaled(SIGTERM));
    CHECK(h.supervisor.done());
    CHECK(h.supervisor.exit_code() == kExitJobFailed);
  }
  SUBCASE("stopped while held: after its own failure the job failed here, else it was only stopped") {
    for (bool failed_here : {true, false}) {
      KeepHarness h(2, 0, true);
      h.supervisor.Start();
      auto pids = h.CurrentPids(2);
      h.AllReady(pids, 0);
      if (failed_here) {
        h.End(pids[1], ExitStatus::Exited(3));
      } else {
        REQUIRE(h.supervisor.Hold());
      }
      REQUIRE(h.supervisor.held());
      h.supervisor.Stop();
      for (size_t i = 0; i < (failed_here ? 1u : 2u); ++i) h.End(pids[i], ExitStatus::Signaled(SIGTERM));
      CHECK(h.supervisor.done());
      CHECK(h.supervisor.exit_code() == (failed_here ? kExitJobFailed : kExitStopped));
    }
  }
  SUBCASE("a survivor that cannot be told stops the group as a failure") {
    KeepHarness h(2, 0, true);
    h.supervisor.Start();
    auto pids = h.CurrentPids(2);
    h.AllReady(pids, 0);
    h.End(pids[1], ExitStatus::Exited(1));
    h.regroups.refuse = true;
    h.supervisor.Regroup(1, 1);
    CHECK(h.table.WasSignaled(pids[0], SIGTERM));
    CHECK(h.table.spawned().size() == 2);
    h.End(pids[0], ExitStatus::Signaled(SIGTERM));
    CHECK(h.supervisor.done());
    CHECK(h.supervisor.exit_code() == kExitJobFailed);
  }
  SUBCASE("without hold_survivors a lone failure stops the group (the single-node path needs a restart)") {
    KeepHarness h(2, 0);
    h.supervisor.Start();
    auto pids = h.CurrentPids(2);
    h.AllReady(pids, 0);
    CHECK_FALSE(h.supervisor.Hold());
    h.End(pids[1], ExitStatus::Exited(1));
    CHECK_FALSE(h.supervisor.held());
    CHECK(h.table.WasSignaled(pids[0], SIGTERM));
  }
}

}  // namespace
}  // namespace elrun
