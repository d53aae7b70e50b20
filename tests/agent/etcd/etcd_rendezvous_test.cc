// The etcd-v3 backend on a fake etcd and a clock the test moves: a round forms through etcd,
// the lead passes on when the leader leaves, a node cut off from etcd loses its lease and its
// place, timeouts fall due in log time, and what etcd hands back is checked before use (forged
// times, lease-less presence and tail keys included). (The
// same backend against a real 3-member etcd cluster: tests/integration/rdzv_etcd_test.py.)
#include "agent/etcd/etcd_rendezvous.h"

#include <poll.h>

#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "agent/coordinator/protocol_version.h"
#include "tests/agent/etcd/fake_etcd.h"

namespace elrun::rdzv {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kLeaseTtl{3000};
constexpr milliseconds kRenewEvery{1000};  // The renewer's period: a third of the TTL.
constexpr milliseconds kRetryFor{2000};
// Real time: how long a test waits for the backend's threads before it fails.
constexpr milliseconds kPatience{20000};

v1::JobSettings Settings(int min_nodes, int max_nodes) {
  v1::JobSettings settings;
  settings.set_min_nodes(min_nodes);
  settings.set_max_nodes(max_nodes);
  settings.set_last_call_timeout_ms(5000);
  settings.set_join_timeout_ms(600000);
  settings.set_heartbeat_timeout_ms(kLeaseTtl.count());
  settings.set_close_timeout_ms(30000);
  return settings;
}

struct Node {
  std::string id;
  std::unique_ptr<EtcdRendezvous> rdzv;
  std::deque<v1::CoordinatorMessage> inbox;

  // The next message `want` accepts, skipping the others; fails the test after kPatience.
  v1::CoordinatorMessage Await(const std::function<bool(const v1::CoordinatorMessage&)>& want, const char* what) {
    const auto give_up = std::chrono::steady_clock::now() + kPatience;
    while (true) {
      for (v1::CoordinatorMessage& message : rdzv->Take()) inbox.push_back(std::move(message));
      while (!inbox.empty()) {
        v1::CoordinatorMessage message = std::move(inbox.front());
        inbox.pop_front();
        if (want(message)) return message;
      }
      const auto left = std::chrono::duration_cast<milliseconds>(give_up - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      pollfd ready{rdzv->event_fd(), POLLIN, 0};
      (void)::poll(&ready, 1, static_cast<int>(left.count()));
    }
    FAIL(id, " got no ", std::string(what), " within ", kPatience.count(), " ms");
    return {};
  }
  v1::RoundStarted AwaitRound() {
    return Await([](const v1::CoordinatorMessage& m) { return m.has_round_started(); }, "RoundStarted").round_started();
  }
  v1::RoundEnded AwaitRoundEnded() {
    return Await([](const v1::CoordinatorMessage& m) { return m.has_round_ended(); }, "RoundEnded").round_ended();
  }
  // How the session ended; fails the test when it does not within kPatience.
  absl::Status AwaitEnded() {
    const auto give_up = std::chrono::steady_clock::now() + kPatience;
    while (!rdzv->ended()) {
      const auto left = std::chrono::duration_cast<milliseconds>(give_up - std::chrono::steady_clock::now());
      REQUIRE_MESSAGE(left.count() > 0, id, "'s session did not end");
      (void)rdzv->Take();
      pollfd ready{rdzv->event_fd(), POLLIN, 0};
      (void)::poll(&ready, 1, static_cast<int>(left.count()));
    }
    return *rdzv->ended();
  }
  // The session id the node's Challenge carries (its connect entry's create revision).
  uint64_t Session() {
    v1::CoordinatorMessage challenge =
        Await([](const v1::CoordinatorMessage& m) { return m.has_challenge(); }, "Challenge");
    uint64_t session = 0;
    std::memcpy(&session, challenge.challenge().nonce().data(), sizeof(session));
    inbox.push_front(challenge);
    return session;
  }
};

struct Job {
  std::shared_ptr<FakeClock> clock = std::make_shared<FakeClock>();
  FakeEtcd etcd{clock, kRetryFor};
  std::map<std::string, Node> nodes;
  v1::JobSettings settings = Settings(3, 3);
  milliseconds first_join_timeout{600000};

  ~Job() {
    for (auto& [id, node] : nodes) etcd.Restore(id);  // Nothing waits on a cut when it leaves.
    for (auto& [id, node] : nodes) node.rdzv.reset();
  }

  EtcdRendezvousOptions Options(const std::string& id) const {
    EtcdRendezvousOptions options;
    options.etcd.endpoints = {"fake"};
    options.etcd.retry_for = kRetryFor;
    options.run_id = "job";
    options.node_id = id;
    options.lease_ttl = kLeaseTtl;
    options.first_join_timeout = first_join_timeout;
    return options;
  }
  Node& Open(const std::string& id) {
    auto opened = EtcdRendezvous::Open(Options(id), etcd.Connect(id), clock);
    REQUIRE_MESSAGE(opened.ok(), opened.status().ToString());
    Node& node = nodes[id];
    node.id = id;
    node.rdzv = *std::move(opened);
    return node;
  }
  void Join(Node& node) {
    v1::AgentMessage message;
    v1::Join& join = *message.mutable_join();
    join.set_protocol_version(kProtocolVersion);
    join.set_run_id("job");
    join.set_node_id(node.id);
    join.set_nproc(2);
    join.set_role("default");
    join.set_rank_hint(-1);
    join.set_master_addr("127.0.0.1");
    join.set_master_port(29500);
    *join.mutable_settings() = settings;
    REQUIRE(node.rdzv->Write(message));
  }
  // Moves the clock on by `by`, a renewal period at a time, and lets every node in `live` renew
  // its lease as a live agent would, so that only the others' leases run out: after each step,
  // each has renewed within the last period (its renewer may have read the clock just after
  // the step, and then renews at the next).
  void Pass(milliseconds by, const std::vector<std::string>& live) {
    for (milliseconds done{0}; done < by; done += kRenewEvery) {
      clock->Advance(std::min(kRenewEvery, by - done));
      for (const std::string& id : live) {
        REQUIRE_MESSAGE(etcd.AwaitRenewal(id, clock->SteadyNow() - kRenewEvery, kPatience), id,
                        " did not renew its lease");
      }
      etcd.ExpireDue();
    }
  }
};

// The ranks of one round: every node in it, the same round, group ranks 0..n-1, rank offsets
// by nproc.
std::map<std::string, v1::RoundStarted> Form(Job& job, const std::vector<std::string>& ids) {
  std::map<std::string, v1::RoundStarted> round;
  for (const std::string& id : ids) round[id] = job.nodes.at(id).AwaitRound();
  std::set<int> group_ranks;
  for (const auto& [id, started] : round) {
    CHECK(started.round() == round.begin()->second.round());
    CHECK(started.group_world_size() == static_cast<int>(ids.size()));
    CHECK(started.world_size() == 2 * static_cast<int>(ids.size()));
    CHECK(started.rank_offset() == 2 * started.group_rank());
    group_ranks.insert(started.group_rank());
  }
  CHECK(group_ranks.size() == ids.size());
  return round;
}

TEST_CASE("three nodes form a round through etcd; the first to join leads, the others follow") {
  Job job;
  for (const char* id : {"a", "b", "c"}) job.Open(id);
  for (const char* id : {"a", "b", "c"}) {
    Node& node = job.nodes.at(id);
    node.Await([](const v1::CoordinatorMessage& m) { return m.has_challenge(); }, "Challenge");
    job.Join(node);
  }
  for (const char* id : {"a", "b", "c"}) {
    job.nodes.at(id).Await([](const v1::CoordinatorMessage& m) { return m.has_welcome(); }, "Welcome");
  }
  Form(job, {"a", "b", "c"});
  // One leader, named in etcd; every node's presence under its lease.
  std::vector<mvccpb::KeyValue> leader = job.etcd.Keys("/elrun/rdzv/job/leader", "");
  REQUIRE(leader.size() == 1);
  CHECK(leader[0].value() == "a");
  CHECK(job.etcd.Keys("/elrun/rdzv/job/nodes/", PrefixEnd("/elrun/rdzv/job/nodes/")).size() == 3);
}

TEST_CASE("the leader leaves: the next in line takes the lead, ends the round, and forms the next") {
  Job job;
  job.settings = Settings(2, 3);
  for (const char* id : {"a", "b", "c"}) job.Join(job.Open(id));
  Form(job, {"a", "b", "c"});

  job.nodes.at("a").rdzv.reset();  // Leaves cleanly: its lease is revoked at once.
  job.nodes.erase("a");
  for (const char* id : {"b", "c"}) {
    v1::RoundEnded ended = job.nodes.at(id).AwaitRoundEnded();
    CHECK(ended.reason() == v1::RoundEnded::NODE_LOST);
    job.Join(job.nodes.at(id));
  }
  // Two of at most three: the round starts once the last call (5 s of log time) is over. The
  // new leader logs the tick that ends it when the clock gets there.
  job.Pass(milliseconds(6000), {"b", "c"});
  std::map<std::string, v1::RoundStarted> round = Form(job, {"b", "c"});
  CHECK(round.at("b").round() == 2);
  std::vector<mvccpb::KeyValue> leader = job.etcd.Keys("/elrun/rdzv/job/leader", "");
  REQUIRE(leader.size() == 1);
  CHECK(leader[0].value() == "b");
}

TEST_CASE("a node cut off from etcd loses its lease: the others see it lost, and its session ends") {
  Job job;
  for (const char* id : {"a", "b", "c"}) job.Join(job.Open(id));
  Form(job, {"a", "b", "c"});

  job.etcd.Cut("c");
  job.Pass(kLeaseTtl + milliseconds(1000), {"a", "b"});
  for (const char* id : {"a", "b"}) {
    v1::RoundEnded ended = job.nodes.at(id).AwaitRoundEnded();
    CHECK(ended.reason() == v1::RoundEnded::NODE_LOST);
    CHECK(absl::StrContains(ended.detail(), "etcd lease"));
  }
  CHECK(job.etcd.Keys("/elrun/rdzv/job/nodes/c", "").empty());
  // c's renewals fail for a whole TTL (each after the retry time): it ends itself. Its renewer
  // may have fallen behind the clock (a loaded machine): a renewal it starts late waits its
  // retry time from then, so the clock moves on, a period at a time, until c's session ends.
  Node& c = job.nodes.at("c");
  job.Pass(kRetryFor + milliseconds(1000), {"a", "b"});
  const auto give_up = std::chrono::steady_clock::now() + kPatience;
  while (!c.rdzv->ended() && std::chrono::steady_clock::now() < give_up) {
    pollfd ready{c.rdzv->event_fd(), POLLIN, 0};
    if (::poll(&ready, 1, 50) > 0) (void)c.rdzv->Take();
    if (!c.rdzv->ended()) job.Pass(kRenewEvery, {"a", "b"});
  }
  absl::Status ended = c.AwaitEnded();
  CHECK(ended.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(ended.message(), "etcd"));
}

TEST_CASE("a session that never joins is closed when its first-join timeout falls due in log time") {
  Job job;
  job.first_join_timeout = milliseconds(10000);
  job.settings = Settings(1, 2);
  job.Join(job.Open("a"));
  Node& idle = job.Open("idle");  // Connects, never joins.
  job.Pass(milliseconds(9000), {"a", "idle"});
  CHECK_FALSE(idle.rdzv->ended());
  job.Pass(milliseconds(1000), {"a"});  // At 10 s: idle is closed, and renews no more.
  absl::Status ended = idle.AwaitEnded();
  CHECK_FALSE(ended.ok());
  CHECK_MESSAGE(absl::StrContains(ended.message(), "Join"), ended.ToString());
  // The node that joined was not touched: its one-node round started at the last call.
  CHECK(job.nodes.at("a").AwaitRound().group_world_size() == 1);
  CHECK_FALSE(job.nodes.at("a").rdzv->ended());
}

TEST_CASE("a log time far ahead of the reader's clock moves no timeout") {
  // Issue 31's attacks: a log entry at INT64_MAX ms, and a tick 30 days ahead, made every
  // timeout fall due at once. Here the idle session's first-join deadline must still wait its
  // 10 s of log time.
  Job job;
  job.first_join_timeout = milliseconds(10000);
  job.settings = Settings(1, 2);
  Node& a = job.Open("a");  // The job is live from here: the forged entries stay in its log.
  std::unique_ptr<EtcdKv> intruder = job.etcd.Connect("intruder");
  etcdpb::TxnRequest forged;
  int n = 0;
  for (int64_t time_ms : {std::numeric_limits<int64_t>::max(), job.clock->WallMs() + int64_t{30} * 24 * 3600 * 1000}) {
    v1::LogEntry tick;
    tick.set_time_ms(time_ms);
    tick.set_tick(true);
    auto* put = forged.add_success()->mutable_request_put();
    put->set_key(absl::StrCat("/elrun/rdzv/job/log/t/forged", n++));
    put->set_value(tick.SerializeAsString());
  }
  REQUIRE(intruder->Txn(forged).ok());
  job.Join(a);
  Node& idle = job.Open("idle");  // Connects after the forged entries, never joins.
  job.Pass(milliseconds(9000), {"a", "idle"});
  CHECK_FALSE(idle.rdzv->ended());
  job.Pass(milliseconds(1000), {"a"});  // At 10 s of log time, and not before.
  CHECK_FALSE(idle.AwaitEnded().ok());
  CHECK(job.nodes.at("a").AwaitRound().group_world_size() == 1);
}

// Puts `key` = `value` with no lease, as someone who can write the job's keys but is no node.
void PutWithoutLease(FakeEtcd& etcd, const std::string& key, const std::string& value) {
  std::unique_ptr<EtcdKv> intruder = etcd.Connect("intruder");
  etcdpb::TxnRequest put;
  put.add_success()->mutable_request_put()->set_key(key);
  put.mutable_success(0)->mutable_request_put()->set_value(value);
  REQUIRE(intruder->Txn(put).ok());
}

TEST_CASE("keys without a lease are no node and no hint: the first node finds its place and a round forms") {
  struct Forged {
    const char* key;
    const char* value;
    const char* attack;
  };
  for (const Forged& forged : {
           // Issue 31's ghost: it sat first in the line and never went, so no node took the lead.
           Forged{"/elrun/rdzv/job/nodes/ghost", "", "a presence key without a lease"},
           // Its forged tail: it named a key that never existed, and the first node waited on it.
           Forged{"/elrun/rdzv/job/tail", "/elrun/rdzv/job/nodes/nobody", "a tail without a lease"},
       }) {
    CAPTURE(forged.attack);
    Job job;
    job.settings = Settings(2, 2);
    PutWithoutLease(job.etcd, forged.key, forged.value);
    Node& a = job.Open("a");
    Node& b = job.Open("b");
    job.Join(a);
    job.Join(b);
    Form(job, {"a", "b"});
  }
}

TEST_CASE("what etcd hands back is checked: an unreadable output ends the session, a bad log entry is skipped") {
  Job job;
  job.settings = Settings(2, 2);
  Node& a = job.Open("a");
  Node& b = job.Open("b");
  std::unique_ptr<EtcdKv> intruder = job.etcd.Connect("intruder");
  const std::string garbage("\x0a\xff", 2);  // A field whose length runs past the end.
  REQUIRE_FALSE(v1::LogEntry().ParseFromString(garbage));
  REQUIRE_FALSE(v1::OutEntry().ParseFromString(garbage));
  etcdpb::TxnRequest put;
  put.add_success()->mutable_request_put()->set_key("/elrun/rdzv/job/log/m/1/0");
  put.add_success()->mutable_request_put()->set_key("/elrun/rdzv/job/log/m/1/1");
  put.mutable_success(0)->mutable_request_put()->set_value(garbage);
  put.mutable_success(1)->mutable_request_put()->set_value(garbage);
  REQUIRE(intruder->Txn(put).ok());
  const uint64_t session = b.Session();
  job.Join(a);
  job.Join(b);
  Form(job, {"a", "b"});  // Every replica skips the entry alike.

  etcdpb::TxnRequest output;
  auto* bad = output.add_success()->mutable_request_put();
  bad->set_key(absl::StrCat("/elrun/rdzv/job/out/", session, "/99"));
  bad->set_value(garbage);
  REQUIRE(intruder->Txn(output).ok());
  absl::Status ended = b.AwaitEnded();
  CHECK(ended.code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StrContains(ended.message(), "unreadable"));
}

TEST_CASE("Open refuses a run id that reaches into other keys, and fails when etcd stays unreachable") {
  Job job;
  EtcdRendezvousOptions options = job.Options("a");
  options.run_id = "job/../other";
  CHECK(EtcdRendezvous::Open(options, job.etcd.Connect("a"), job.clock).status().code() ==
        absl::StatusCode::kInvalidArgument);
  options.run_id = "";
  CHECK(EtcdRendezvous::Open(options, job.etcd.Connect("a"), job.clock).status().code() ==
        absl::StatusCode::kInvalidArgument);

  job.etcd.Cut("z");
  absl::Status status;
  std::thread open([&] { status = EtcdRendezvous::Open(job.Options("z"), job.etcd.Connect("z"), job.clock).status(); });
  REQUIRE(job.clock->AwaitWaiting(1, kPatience));
  job.clock->Advance(kRetryFor);
  open.join();
  CHECK(status.code() == absl::StatusCode::kUnavailable);
  CHECK(job.etcd.Keys("/elrun/rdzv/", PrefixEnd("/elrun/rdzv/")).empty());
}

}  // namespace
}  // namespace elrun::rdzv
