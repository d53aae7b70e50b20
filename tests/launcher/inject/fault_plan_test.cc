#include "launcher/inject/fault_plan.h"

#include <doctest/doctest.h>

#include <string>

namespace elrun {
namespace {

TEST_CASE("a plan names kinds, ranks, times and steps, once or again") {
  auto plan = ParseFaultPlan("kill-worker@20-40s, stop-worker:1@step100,kill-agent@every30s,kill-worker@everystep5-9");
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 4);
  const FaultItem& a = (*plan)[0];
  CHECK(a.kind == FaultKind::kKillWorker);
  CHECK_FALSE(a.local_rank);
  CHECK_FALSE(a.by_step);
  CHECK_FALSE(a.every);
  CHECK(a.from == 20);
  CHECK(a.to == 40);
  CHECK(a.text == "kill-worker@20-40s");
  const FaultItem& b = (*plan)[1];
  CHECK(b.kind == FaultKind::kStopWorker);
  CHECK(*b.local_rank == 1);
  CHECK(b.by_step);
  CHECK(b.from == 100);
  CHECK((*plan)[2].kind == FaultKind::kKillAgent);
  CHECK((*plan)[2].every);
  CHECK((*plan)[3].every);
  CHECK((*plan)[3].by_step);
  CHECK((*plan)[3].to == 9);
  CHECK(ParseFaultPlan("kill-worker@0.5s")->at(0).from == 0.5);
}

TEST_CASE("a bad plan is one error naming the item") {
  for (const char* bad : {"",
                          "kill-worker",
                          "kill-worker@",
                          "kill-worker@20",
                          "nuke-worker@1s",
                          "kill-worker@-1s",
                          "kill-worker@40-20s",
                          "kill-worker@nans",
                          "kill-worker@infs",
                          "kill-worker@1e9s",
                          "kill-worker:x@1s",
                          "kill-worker:-1@1s",
                          "kill-agent:0@1s",
                          "kill-worker@step1.5",
                          "kill-worker@every0s",
                          "kill-worker@everystep0",
                          "kill-worker@1s,",
                          "kill-worker@1s\n",
                          "kill-worker@step+3",
                          "kill-worker@1-2-3s"}) {
    const std::string item = bad;
    CAPTURE(item);
    auto plan = ParseFaultPlan(bad);
    REQUIRE_FALSE(plan.ok());
    CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(plan.status().message()).find('\n') == std::string::npos);
  }
  std::string many;
  for (int i = 0; i < 65; ++i) many += i ? ",kill-worker@1s" : "kill-worker@1s";
  CHECK_FALSE(ParseFaultPlan(many).ok());
  CHECK(std::string(ParseFaultPlan("nuke@1s").status().message()).find("'nuke@1s': unknown kind") == 0);
}

TEST_CASE("faults fall due once at their time or step; every-faults again after a new gap") {
  FaultSchedule schedule(*ParseFaultPlan("kill-worker@5s,stop-worker:1@step10,kill-worker@every3s"), 7);
  CHECK(*schedule.NextTime() == 3);
  CHECK(schedule.TakeDue(2.9, -1).empty());
  auto due = schedule.TakeDue(3.0, 4);
  REQUIRE(due.size() == 1);
  CHECK(due[0].text == "kill-worker@every3s");
  CHECK(*schedule.NextTime() == 5);
  due = schedule.TakeDue(5.5, 9);
  REQUIRE(due.size() == 1);
  CHECK(due[0].text == "kill-worker@5s");
  CHECK(*schedule.NextTime() == 6);
  due = schedule.TakeDue(5.6, 10);
  REQUIRE(due.size() == 1);
  CHECK(due[0].kind == FaultKind::kStopWorker);
  CHECK(*due[0].local_rank == 1);
  CHECK(schedule.TakeDue(5.7, 50).empty());  // Step faults fire once.
  CHECK(schedule.TakeDue(6.0, 50).size() == 1);
  CHECK(*schedule.NextTime() == 9);
}

TEST_CASE("the same plan and seed draw the same schedule; another seed another one") {
  auto plan = *ParseFaultPlan("kill-worker@10-1000s,kill-worker@step0-1000000");
  FaultSchedule a(plan, 42), b(plan, 42), c(plan, 43);
  CHECK(a.Describe() == b.Describe());
  CHECK(a.Describe() != c.Describe());
  const double at = *a.NextTime();
  CHECK(at >= 10);
  CHECK(at <= 1000);
  int seen[3] = {0, 0, 0};
  for (int i = 0; i < 300; ++i) ++seen[a.DrawRank(3)];
  for (int n : seen) CHECK(n > 50);
  CHECK(a.DrawRank(1) == 0);
}

}  // namespace
}  // namespace elrun
