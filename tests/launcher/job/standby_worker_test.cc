#include "launcher/job/standby_worker.h"

#include <doctest/doctest.h>

#include <csignal>

#include "tests/launcher/job/fake_process_table.h"

namespace elrun {
namespace {

WorkerLaunch Launch(int local_rank, const std::string& tag) {
  WorkerLaunch launch;
  launch.local_rank = local_rank;
  launch.rank = 10 + local_rank;
  launch.env = {"TAG=" + tag};
  return launch;
}

struct Harness {
  FakeProcessTable table;
  bool refuse_make = false;
  bool refuse_tell = false;
  std::vector<std::pair<std::string, WorkerLaunch>> told;  // (the spare's TAG, the launch)
  StandbyWorker standby{&table,
                        [this](const WorkerLaunch& base) -> absl::StatusOr<WorkerLaunch> {
                          if (refuse_make) return absl::FailedPreconditionError("workers are bound");
                          WorkerLaunch spare = base;
                          spare.local_rank = kStandbyLocalRank;
                          spare.env.push_back("ELRUN_STANDBY=1");
                          return spare;
                        },
                        [this](const WorkerLaunch& spare, const WorkerLaunch& launch) {
                          told.emplace_back(spare.env[0], launch);
                          return !refuse_tell;
                        }};
};

TEST_CASE("a standby spare starts once and becomes the failed worker it is handed") {
  Harness h;
  h.standby.Start(Launch(0, "base"));
  h.standby.Start(Launch(0, "again"));  // One runs: nothing.
  REQUIRE(h.table.spawned().size() == 1);
  const auto& [pid, spare] = h.table.spawned()[0];
  CHECK(spare.local_rank == kStandbyLocalRank);
  CHECK(spare.env.back() == "ELRUN_STANDBY=1");
  CHECK(h.standby.pid() == pid);

  auto taken = h.standby.Take(Launch(1, "failed"));
  REQUIRE(taken.has_value());
  CHECK(taken->first == pid);
  CHECK(taken->second.env.back() == "ELRUN_STANDBY=1");  // What it was started as.
  REQUIRE(h.told.size() == 1);
  CHECK(h.told[0].first == "TAG=base");
  CHECK(h.told[0].second.local_rank == 1);
  REQUIRE(h.table.relabels().size() == 1);
  CHECK(h.table.relabels()[0].pid == pid);
  CHECK(h.table.relabels()[0].local_rank == 1);
  CHECK(h.table.relabels()[0].rank == 11);
  CHECK(h.standby.pid() == 0);
  CHECK(!h.standby.OnExit(pid, ExitStatus::Exited(0)));     // A worker now, not the spare.
  CHECK(!h.standby.Take(Launch(1, "failed")).has_value());  // None left until the next Start.
  h.standby.Start(Launch(0, "next"));
  CHECK(h.table.spawned().size() == 2);
}

TEST_CASE("a spare that cannot be told is killed and none is handed out") {
  Harness h;
  h.refuse_tell = true;
  h.standby.Start(Launch(0, "base"));
  const int pid = h.table.spawned()[0].first;
  CHECK(!h.standby.Take(Launch(1, "failed")).has_value());
  CHECK(h.table.WasSignaled(pid, SIGKILL));
  CHECK(h.table.relabels().empty());
}

TEST_CASE("no spare where none can stand in, and none after two died on their own") {
  Harness refused;
  refused.refuse_make = true;
  refused.standby.Start(Launch(0, "base"));
  refused.refuse_make = false;
  refused.standby.Start(Launch(0, "base"));  // Given up for good.
  CHECK(refused.table.spawned().empty());

  Harness dying;
  dying.standby.Start(Launch(0, "base"));
  CHECK(dying.standby.OnExit(dying.table.spawned()[0].first, ExitStatus::Exited(1)));
  dying.standby.Start(Launch(0, "base"));
  REQUIRE(dying.table.spawned().size() == 2);
  CHECK(dying.standby.OnExit(dying.table.spawned()[1].first, ExitStatus::Signaled(SIGSEGV)));
  dying.standby.Start(Launch(0, "base"));
  CHECK(dying.table.spawned().size() == 2);
  CHECK(!dying.standby.OnExit(12345, ExitStatus::Exited(1)));  // Not the spare.
}

}  // namespace
}  // namespace elrun
