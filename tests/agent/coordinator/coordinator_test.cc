#include "agent/coordinator/coordinator.h"

#include "agent/coordinator/session_auth.h"

#include <doctest/doctest.h>

#include <cmath>

#include <deque>
#include <memory>
#include <thread>

namespace elrun::rdzv {
namespace {

using std::chrono::milliseconds;

class RecordingSink : public SessionSink {
 public:
  void Send(const v1::CoordinatorMessage& message) override { messages.push_back(message); }
  void Close(const absl::Status& status) override { closed = status; }

  // Pops the oldest message; fails the test when there is none.
  v1::CoordinatorMessage Pop() {
    REQUIRE_FALSE(messages.empty());
    v1::CoordinatorMessage m = messages.front();
    messages.pop_front();
    return m;
  }
  std::deque<v1::CoordinatorMessage> messages;
  std::optional<absl::Status> closed;
};

v1::JobSettings Settings(int min, int max, int max_restarts = 0) {
  v1::JobSettings s;
  s.set_min_nodes(min);
  s.set_max_nodes(max);
  s.set_max_restarts(max_restarts);
  s.set_last_call_timeout_ms(1000);
  s.set_join_timeout_ms(60000);
  s.set_heartbeat_timeout_ms(5000);
  s.set_close_timeout_ms(30000);
  return s;
}

struct Agent {
  SessionId id;
  std::unique_ptr<RecordingSink> sink = std::make_unique<RecordingSink>();
};

struct Harness {
  Harness() = default;
  explicit Harness(Coordinator::Options options) : coordinator(std::move(options)) {}
  Coordinator coordinator;
  TimePoint now{std::chrono::seconds(100)};
  std::map<int, Agent> agents;
  v1::JobSettings settings = Settings(2, 2);
  std::string run_id = "job";

  v1::Join MakeJoin(int n, int nproc = 1, int hint = -1, int port = 0) {
    v1::Join join;
    join.set_protocol_version(kProtocolVersion);
    join.set_run_id(run_id);
    join.set_node_id("node" + std::to_string(n));
    join.set_nproc(nproc);
    join.set_role("default");
    join.set_rank_hint(hint);
    join.set_master_addr("127.0.0." + std::to_string(n + 1));
    join.set_master_port(port ? port : 20000 + n);
    *join.mutable_settings() = settings;
    return join;
  }
  RecordingSink& Connect(int n) {
    Agent& agent = agents[n];
    agent.id = 1000 + n;
    coordinator.OnConnect(agent.id, agent.sink.get(), now);
    return *agent.sink;
  }
  absl::Status Send(int n, const v1::AgentMessage& message) {
    return coordinator.OnMessage(agents.at(n).id, message, now);
  }
  absl::Status Join(int n, int nproc = 1, int hint = -1) {
    if (!agents.count(n)) Connect(n);
    v1::AgentMessage m;
    *m.mutable_join() = MakeJoin(n, nproc, hint);
    return Send(n, m);
  }
  // A session's first Join signed with the run key of `secret` (as elrun does with its
  // run_token); `sign_as` signs with another key than the one it presents.
  absl::Status JoinWithRunSecret(int n, const std::string& secret, const std::string& sign_as = "") {
    RecordingSink& sink = agents.count(n) ? Sink(n) : Connect(n);
    std::string server_nonce = sink.messages.front().challenge().nonce();
    v1::AgentMessage m;
    *m.mutable_join() = MakeJoin(n);
    std::string client_nonce = RandomNonce();
    RunKey key = DeriveRunKey(secret, run_id);
    RunKey signer = DeriveRunKey(sign_as.empty() ? secret : sign_as, run_id);
    m.mutable_join()->set_client_nonce(client_nonce);
    m.mutable_join()->set_run_key(key.public_key);
    m.mutable_join()->set_run_signature(SignJoin(signer, server_nonce, client_nonce, run_id, m.join().node_id()));
    return Send(n, m);
  }
  absl::Status Ended(int n, uint64_t round, bool success) {
    v1::AgentMessage m;
    m.mutable_workers_ended()->set_round(round);
    m.mutable_workers_ended()->set_success(success);
    m.mutable_workers_ended()->set_failure(success ? "" : "local_rank 0 exit code 1");
    return Send(n, m);
  }
  absl::Status Heartbeat(int n) {
    v1::AgentMessage m;
    m.mutable_heartbeat();
    return Send(n, m);
  }
  RecordingSink& Sink(int n) { return *agents.at(n).sink; }
  // The last message of a kind, after dropping the others.
  v1::RoundStarted Started(int n) {
    auto& messages = Sink(n).messages;
    for (auto it = messages.rbegin(); it != messages.rend(); ++it) {
      if (it->has_round_started()) return it->round_started();
    }
    FAIL("no RoundStarted for node ", n);
    return {};
  }
  bool Has(int n, v1::CoordinatorMessage::BodyCase kind) {
    for (const auto& m : Sink(n).messages) {
      if (m.body_case() == kind) return true;
    }
    return false;
  }
  bool View0Done() { return !coordinator.View(run_id) || coordinator.View(run_id)->done; }
  void Clear() {
    for (auto& [n, agent] : agents) agent.sink->messages.clear();
  }
  void Advance(milliseconds by) {
    now += by;
    coordinator.Tick(now);
  }
};

TEST_CASE("a round completes when max nodes have joined") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  CHECK(h.Has(0, v1::CoordinatorMessage::kWaiting));
  CHECK_FALSE(h.Has(0, v1::CoordinatorMessage::kRoundStarted));
  REQUIRE(h.Join(1).ok());
  v1::RoundStarted a = h.Started(0), b = h.Started(1);
  CHECK(a.round() == 1);
  CHECK(a.group_world_size() == 2);
  CHECK(a.world_size() == 2);
  CHECK(a.group_rank() != b.group_rank());
  CHECK(a.master_port() == b.master_port());
  CHECK(a.restart_count() == 0);
}

TEST_CASE("first joiner is group rank 0 and hosts the store") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  CHECK(h.Started(0).group_rank() == 0);
  CHECK(h.Started(1).master_addr() == "127.0.0.1");
  CHECK(h.Started(1).master_port() == 20000);
}

TEST_CASE("--node-rank hints are honoured") {
  Harness h;
  REQUIRE(h.Join(0, 1, 1).ok());
  REQUIRE(h.Join(1, 1, 0).ok());
  CHECK(h.Started(0).group_rank() == 1);
  CHECK(h.Started(1).group_rank() == 0);
  CHECK(h.Started(0).master_addr() == "127.0.0.2");
}

TEST_CASE("different nproc: world size is the sum, offsets are prefix sums") {
  Harness h;
  h.settings = Settings(3, 3);
  REQUIRE(h.Join(0, 2).ok());
  REQUIRE(h.Join(1, 3).ok());
  REQUIRE(h.Join(2, 1).ok());
  CHECK(h.Started(0).world_size() == 6);
  CHECK(h.Started(0).rank_offset() == 0);
  CHECK(h.Started(1).rank_offset() == 2);
  CHECK(h.Started(2).rank_offset() == 5);
  CHECK(h.Started(2).role_world_size() == 6);
  CHECK(h.Started(2).role_rank_offset() == 5);
}

TEST_CASE("between min and max the round waits for last call") {
  Harness h;
  h.settings = Settings(2, 4);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  CHECK_FALSE(h.Has(0, v1::CoordinatorMessage::kRoundStarted));
  REQUIRE(h.coordinator.NextDeadline().has_value());
  h.Advance(milliseconds(999));
  CHECK_FALSE(h.Has(0, v1::CoordinatorMessage::kRoundStarted));
  h.Advance(milliseconds(1));
  CHECK(h.Started(0).group_world_size() == 2);
}

TEST_CASE("join timeout ends the job when min is never reached") {
  Harness h;
  h.settings = Settings(2, 2);
  h.settings.set_join_timeout_ms(3000);
  REQUIRE(h.Join(0).ok());
  h.Advance(milliseconds(2999));
  CHECK_FALSE(h.Has(0, v1::CoordinatorMessage::kJobEnded));
  REQUIRE(h.Heartbeat(0).ok());
  h.Advance(milliseconds(1));
  REQUIRE(h.Has(0, v1::CoordinatorMessage::kJobEnded));
  CHECK_FALSE(h.Sink(0).messages.back().job_ended().success());
  CHECK(h.Sink(0).messages.back().job_ended().detail().find("min 2") != std::string::npos);
}

TEST_CASE("a lost node ends the round for the survivors, who form the next one at once") {
  Harness h;
  h.settings = Settings(2, 3);
  for (int n = 0; n < 3; ++n) REQUIRE(h.Join(n).ok());
  REQUIRE(h.Started(2).group_rank() == 2);
  h.Clear();
  h.coordinator.OnDisconnect(h.agents[1].id, h.now);
  for (int n : {0, 2}) {
    v1::CoordinatorMessage m = h.Sink(n).Pop();
    REQUIRE(m.has_round_ended());
    CHECK(m.round_ended().reason() == v1::RoundEnded::NODE_LOST);
    CHECK(m.round_ended().detail().find("node1") != std::string::npos);
  }
  REQUIRE(h.Join(0).ok());
  CHECK_FALSE(h.Has(0, v1::CoordinatorMessage::kRoundStarted));  // Waits for node 2 only.
  REQUIRE(h.Join(2).ok());
  v1::RoundStarted a = h.Started(0), c = h.Started(2);
  CHECK(a.round() == 2);
  CHECK(a.group_world_size() == 2);
  CHECK(a.group_rank() == 0);     // Rank 0 survives as rank 0.
  CHECK(c.group_rank() == 1);     // Rank 2 no longer fits and takes the free place.
  CHECK(a.restart_count() == 0);  // Membership changes spend no restart.
}

TEST_CASE("a node that kept its workers alive makes the next round keep survivors; a newcomer cannot") {
  Harness h;
  h.settings = Settings(2, 3, /*max_restarts=*/2);
  h.settings.set_keep_survivors(true);
  auto join_holding = [&h](int n) {
    if (!h.agents.count(n)) h.Connect(n);
    v1::AgentMessage m;
    *m.mutable_join() = h.MakeJoin(n);
    m.mutable_join()->set_holds_survivors(true);
    return h.Send(n, m);
  };
  REQUIRE(join_holding(0).ok());  // A first Join that claims survivors: it has none.
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Join(2).ok());
  CHECK_FALSE(h.Started(0).keep_survivors());
  h.Clear();
  REQUIRE(h.Ended(1, 1, false).ok());  // A worker failed on node 1.
  REQUIRE(join_holding(0).ok());       // Node 0 kept its workers,
  REQUIRE(h.Join(1).ok());             // node 1 lost its only one,
  REQUIRE(h.Join(2).ok());             // node 2 could not keep them.
  for (int n = 0; n < 3; ++n) {
    CHECK(h.Started(n).round() == 2);
    CHECK(h.Started(n).keep_survivors());
    CHECK(h.Started(n).restart_count() == 1);
  }
  h.Clear();
  REQUIRE(h.Ended(2, 2, false).ok());  // Nobody holds any now.
  for (int n = 0; n < 3; ++n) REQUIRE(h.Join(n).ok());
  CHECK(h.Started(0).round() == 3);
  CHECK_FALSE(h.Started(0).keep_survivors());
}

TEST_CASE("every node of a job must agree on --keep-survivors; without it no round keeps any") {
  Harness h;
  h.settings = Settings(2, 2, /*max_restarts=*/1);
  REQUIRE(h.Join(0).ok());
  h.settings.set_keep_survivors(true);
  absl::Status refused = h.Join(1);
  CHECK(refused.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(refused.message()).find("--keep-survivors (the job has not)") != std::string::npos);
  h.settings.set_keep_survivors(false);
  REQUIRE(h.Join(2).ok());
  h.Clear();
  REQUIRE(h.Ended(2, 1, false).ok());
  v1::AgentMessage m;
  *m.mutable_join() = h.MakeJoin(0);
  m.mutable_join()->set_holds_survivors(true);  // Claimed, in a job without the option: ignored.
  REQUIRE(h.Send(0, m).ok());
  REQUIRE(h.Join(2).ok());
  CHECK(h.Started(0).round() == 2);
  CHECK_FALSE(h.Started(0).keep_survivors());
}

TEST_CASE("survivors keep their group ranks") {
  Harness h;
  h.settings = Settings(1, 4);
  h.settings.set_last_call_timeout_ms(0);
  REQUIRE(h.Join(0).ok());
  for (int n = 1; n < 4; ++n) {
    REQUIRE(h.Join(n).ok());  // Each arrival is a scale-up.
    for (int m = 0; m < n; ++m) {
      if (h.Has(m, v1::CoordinatorMessage::kRoundEnded)) REQUIRE(h.Join(m).ok());
    }
    h.Clear();
  }
  h.Clear();
  h.coordinator.OnDisconnect(h.agents[0].id, h.now);  // Rank 0 dies.
  for (int n = 1; n < 4; ++n) REQUIRE(h.Join(n).ok());
  std::set<int> ranks;
  for (int n = 1; n < 4; ++n) ranks.insert(h.Started(n).group_rank());
  CHECK(ranks == std::set<int>{0, 1, 2});
  CHECK(h.Started(1).group_rank() == 1);
  CHECK(h.Started(2).group_rank() == 2);
  CHECK(h.Started(3).group_rank() == 0);
}

TEST_CASE("a node arriving while the job runs scales it up") {
  Harness h;
  h.settings = Settings(2, 3);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  h.Advance(milliseconds(1000));
  REQUIRE(h.Started(0).group_world_size() == 2);
  h.Advance(milliseconds(1000));  // One last call after the round started: no damping.
  h.Clear();
  REQUIRE(h.Join(2).ok());
  CHECK(h.Sink(0).Pop().round_ended().reason() == v1::RoundEnded::NODE_JOINED);
  CHECK(h.Sink(1).Pop().round_ended().reason() == v1::RoundEnded::NODE_JOINED);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());  // All three are in: max reached.
  CHECK(h.Started(2).group_world_size() == 3);
  CHECK(h.Started(2).group_rank() == 2);
  CHECK(h.Started(0).restart_count() == 0);
}

TEST_CASE("nodes beyond max wait, and get a place when one frees up") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  h.Clear();
  REQUIRE(h.Join(2).ok());
  REQUIRE(h.Has(2, v1::CoordinatorMessage::kWaiting));
  CHECK(h.Sink(2).messages.back().waiting().wait_listed());
  CHECK(h.Sink(2).messages.back().waiting().job_running());  // A rejoining node knows the job lives on.
  CHECK(h.Sink(0).messages.empty());                         // The running round is not disturbed.
  h.coordinator.OnDisconnect(h.agents[1].id, h.now);
  REQUIRE(h.Join(0).ok());
  CHECK(h.Started(2).group_world_size() == 2);
  CHECK(h.Started(0).group_rank() == 0);
  CHECK(h.Started(2).group_rank() == 1);
}

TEST_CASE("a worker failure restarts every node with the same restart count") {
  Harness h;
  h.settings = Settings(2, 2, 1);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  h.Clear();
  REQUIRE(h.Ended(1, 1, false).ok());
  for (int n : {0, 1}) {
    v1::CoordinatorMessage m = h.Sink(n).Pop();
    CHECK(m.round_ended().reason() == v1::RoundEnded::WORKER_FAILED);
  }
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  CHECK(h.Started(0).restart_count() == 1);
  CHECK(h.Started(1).restart_count() == 1);
  CHECK(h.coordinator.View("job")->restart_count == 1);
  h.Clear();
  REQUIRE(h.Ended(0, 2, false).ok());  // Budget spent: the job fails everywhere.
  for (int n : {0, 1}) {
    v1::CoordinatorMessage m = h.Sink(n).Pop();
    REQUIRE(m.has_job_ended());
    CHECK_FALSE(m.job_ended().success());
    CHECK(m.job_ended().detail().find("no restarts left") != std::string::npos);
  }
}

TEST_CASE("the budget is the job's, not a node's: rejoining does not refill it") {
  Harness h;
  h.settings = Settings(2, 2, 1);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Ended(0, 1, false).ok());
  h.coordinator.OnDisconnect(h.agents[1].id, h.now);  // Node 1 leaves and comes back.
  h.agents.erase(1);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  h.Clear();
  REQUIRE(h.Ended(1, h.coordinator.View("job")->round, false).ok());
  CHECK(h.Sink(0).Pop().has_job_ended());
}

TEST_CASE("exit barrier: the job succeeds when every node's workers succeeded") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  h.Clear();
  REQUIRE(h.Ended(0, 1, true).ok());
  CHECK(h.Sink(0).messages.empty());
  REQUIRE(h.Ended(1, 1, true).ok());
  for (int n : {0, 1}) {
    v1::CoordinatorMessage m = h.Sink(n).Pop();
    REQUIRE(m.has_job_ended());
    CHECK(m.job_ended().success());
  }
  CHECK(h.coordinator.View("job")->done);
}

TEST_CASE("reports about an old round are ignored") {
  Harness h;
  h.settings = Settings(2, 2, 3);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Ended(0, 1, false).ok());
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Ended(1, 1, false).ok());  // Round 1 is over: no second restart.
  CHECK(h.coordinator.View("job")->restart_count == 1);
  CHECK(h.coordinator.View("job")->running);
}

TEST_CASE("a hung agent is removed after the heartbeat timeout") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  h.Clear();
  for (int i = 0; i < 6; ++i) {
    h.Advance(milliseconds(1000));
    REQUIRE(h.Heartbeat(0).ok());  // Node 1 is frozen.
  }
  REQUIRE(h.Sink(1).closed.has_value());
  CHECK(h.Sink(1).closed->code() == absl::StatusCode::kUnavailable);
  CHECK(h.Sink(0).Pop().round_ended().reason() == v1::RoundEnded::NODE_LOST);
  CHECK(h.Heartbeat(1).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("without heartbeats (the etcd backend's replicas) silence evicts nobody; a disconnect names its cause") {
  Coordinator::Options options;
  options.heartbeats = false;
  Harness h(std::move(options));
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  h.Clear();
  h.Advance(milliseconds(60000));  // Twelve heartbeat timeouts without a beat.
  CHECK_FALSE(h.Sink(0).closed.has_value());
  CHECK_FALSE(h.Sink(1).closed.has_value());
  CHECK(h.Sink(0).messages.empty());
  h.coordinator.OnDisconnect(h.agents[1].id, h.now, "its etcd lease ended");
  v1::CoordinatorMessage m = h.Sink(0).Pop();
  CHECK(m.round_ended().reason() == v1::RoundEnded::NODE_LOST);
  CHECK(m.round_ended().detail().find("its etcd lease ended") != std::string::npos);
}

TEST_CASE("paces: each report is answered with the job's median over every active rank and its slowest") {
  Harness h;
  REQUIRE(h.Join(0, 2).ok());
  REQUIRE(h.Join(1, 1).ok());
  const int offset0 = h.Started(0).rank_offset();
  const int offset1 = h.Started(1).rank_offset();
  const uint64_t round = h.Started(0).round();
  h.Clear();
  auto paces = [&](int n, std::vector<std::pair<int, double>> ranks, uint64_t r) {
    v1::AgentMessage m;
    m.mutable_paces()->set_round(r);
    for (auto [rank, ms] : ranks) {
      v1::RankPace* pace = m.mutable_paces()->add_ranks();
      pace->set_rank(rank);
      pace->set_median_step_ms(ms);
      pace->set_host("host" + std::to_string(n));
    }
    return h.Send(n, m);
  };
  REQUIRE(paces(0, {{offset0, 30}, {offset0 + 1, 32}}, round).ok());
  v1::JobPace first = h.Sink(0).Pop().job_pace();
  CHECK(first.ranks() == 2);
  CHECK(first.median_step_ms() == doctest::Approx(31));
  REQUIRE(paces(1, {{offset1, 120}}, round).ok());
  v1::JobPace job = h.Sink(1).Pop().job_pace();
  CHECK(job.round() == round);
  CHECK(job.ranks() == 3);
  CHECK(job.median_step_ms() == doctest::Approx(32));
  REQUIRE(job.slowest_size() == 3);
  CHECK(job.slowest(0).rank() == offset1);
  CHECK(job.slowest(0).host() == "host1");
  CHECK(h.Sink(0).messages.empty());  // Answered to the reporter only.
  // A report about another round is ignored; one about ranks that are not the node's is refused.
  CHECK(paces(1, {{offset1, 10}}, round + 1).ok());
  CHECK(h.Sink(1).messages.empty());
  CHECK(paces(1, {{offset0, 10}}, round).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("progress reports are kept per node for the status page; malformed ones are refused") {
  Harness h;
  REQUIRE(h.Join(0, 1).ok());
  REQUIRE(h.Join(1, 1).ok());
  const uint64_t round = h.Started(0).round();
  h.Clear();
  auto send = [&](int n, auto fill) {
    v1::AgentMessage m;
    v1::Progress* p = m.mutable_progress();
    p->set_round(round);
    p->set_step(120);
    p->set_goodput(0.95);
    p->set_lost_s(1.5);
    p->set_faults(2);
    p->set_wall_s(60);
    fill(*p);
    return h.Send(n, m).code();
  };
  CHECK(send(0, [](v1::Progress&) {}) == absl::StatusCode::kOk);
  CHECK(send(1, [](v1::Progress& p) { p.set_goodput(-1), p.set_step(-1); }) == absl::StatusCode::kOk);
  CoordinatorSnapshot snapshot = h.coordinator.Snapshot();
  REQUIRE(snapshot.jobs.size() == 1);
  int seen = 0;
  for (const NodeStatus& node : snapshot.jobs[0].nodes) {
    REQUIRE(node.progress.has_value());
    seen += node.progress->step() == 120 && node.progress->goodput() == doctest::Approx(0.95) &&
            node.progress->faults() == 2;
    seen += node.progress->step() == -1 && node.progress->goodput() == -1;
  }
  CHECK(seen == 2);
  CHECK(h.Sink(0).messages.empty());  // Shown, never answered or acted on.
  CHECK(h.Sink(1).messages.empty());
  for (auto bad : std::vector<std::function<void(v1::Progress&)>>{
           [](v1::Progress& p) { p.set_goodput(1.5); }, [](v1::Progress& p) { p.set_goodput(std::nan("")); },
           [](v1::Progress& p) { p.set_goodput(-0.5); }, [](v1::Progress& p) { p.set_step(-2); },
           [](v1::Progress& p) { p.set_lost_s(-1); }, [](v1::Progress& p) { p.set_wall_s(1e300); },
           [](v1::Progress& p) { p.set_faults(-1); }, [](v1::Progress& p) { p.set_round(p.round() + 1); }}) {
    CHECK(send(0, bad) == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("malformed paces are refused") {
  Harness h;
  REQUIRE(h.Join(0, 1).ok());
  REQUIRE(h.Join(1, 1).ok());
  const uint64_t round = h.Started(0).round();
  const int rank = h.Started(0).rank_offset();
  auto send = [&](auto fill) {
    v1::AgentMessage m;
    m.mutable_paces()->set_round(round);
    fill(*m.mutable_paces());
    return h.Send(0, m).code();
  };
  auto one = [&](double ms, std::string host) {
    return [=](v1::Paces& p) {
      v1::RankPace* pace = p.add_ranks();
      pace->set_rank(rank);
      pace->set_median_step_ms(ms);
      pace->set_host(host);
    };
  };
  CHECK(send(one(std::nan(""), "h")) == absl::StatusCode::kInvalidArgument);
  CHECK(send(one(-1, "h")) == absl::StatusCode::kInvalidArgument);
  CHECK(send(one(1e12, "h")) == absl::StatusCode::kInvalidArgument);
  CHECK(send(one(10, std::string(300, 'x'))) == absl::StatusCode::kInvalidArgument);
  CHECK(send([&](v1::Paces& p) {
          one(10, "h")(p);
          one(11, "h")(p);
        }) == absl::StatusCode::kInvalidArgument);  // Two paces from a node of one worker.
  CHECK(send(one(10, "h")) == absl::StatusCode::kOk);
}

TEST_CASE("jobs are isolated by run id") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  h.run_id = "other";
  REQUIRE(h.Join(1).ok());
  CHECK(h.coordinator.job_count() == 2);
  CHECK_FALSE(h.Has(0, v1::CoordinatorMessage::kRoundStarted));
  // A session of one run cannot act in another.
  v1::AgentMessage m;
  *m.mutable_join() = h.MakeJoin(0);
  CHECK(h.Send(0, m).code() == absl::StatusCode::kPermissionDenied);
}

TEST_CASE("nodes must agree on the job's settings") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  h.settings = Settings(2, 3);
  absl::Status status = h.Join(1);
  CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(status.message()).find("max_nodes 3 (the job has 2)") != std::string::npos);
  CHECK(h.coordinator.View("job")->pending == 1);
}

TEST_CASE("a node id can be in a job only once") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  h.Connect(5);
  v1::AgentMessage m;
  *m.mutable_join() = h.MakeJoin(0);
  CHECK(h.Send(5, m).code() == absl::StatusCode::kAlreadyExists);
}

TEST_CASE("a second Join before RoundEnded is refused") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  CHECK(h.Join(0).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("messages before Join are refused") {
  Harness h;
  h.Connect(0);
  CHECK(h.Heartbeat(0).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(h.Ended(0, 1, true).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(h.coordinator.OnMessage(424242, v1::AgentMessage(), h.now).code() == absl::StatusCode::kNotFound);
}

TEST_CASE("malformed joins are refused without a trace") {
  Harness h;
  h.Connect(0);
  auto refuse = [&](auto mutate) {
    v1::AgentMessage m;
    *m.mutable_join() = h.MakeJoin(0);
    mutate(*m.mutable_join());
    CHECK_FALSE(h.Send(0, m).ok());
  };
  refuse([](v1::Join& j) { j.set_protocol_version(1); });
  refuse([](v1::Join& j) { j.set_run_id(""); });
  refuse([](v1::Join& j) { j.set_run_id(std::string(200, 'a')); });
  refuse([](v1::Join& j) { j.set_run_id("a/b"); });
  refuse([](v1::Join& j) { j.set_nproc(0); });
  refuse([](v1::Join& j) { j.set_master_port(70000); });
  refuse([](v1::Join& j) { j.set_master_addr(""); });
  refuse([](v1::Join& j) { j.set_master_addr("10.0.0.1\nLD_PRELOAD=/tmp/x.so"); });
  refuse([](v1::Join& j) { j.set_master_addr(std::string("10.0.0.1\0\n[elrun] error: FORGED LINE", 36)); });
  refuse([](v1::Join& j) { j.set_master_addr("\x1b]0;owned\x07"); });
  refuse([](v1::Join& j) { j.mutable_settings()->set_min_nodes(3); });
  refuse([](v1::Join& j) { j.mutable_settings()->set_heartbeat_timeout_ms(0); });
  refuse([](v1::Join& j) { j.mutable_settings()->set_close_timeout_ms(0); });
  refuse([](v1::Join& j) { j.set_run_key(std::string(31, 'k')); });
  refuse([](v1::Join& j) { j.set_run_signature(std::string(64, 's')); });
  CHECK(h.coordinator.job_count() == 0);
}

TEST_CASE("the run's first node fixes its credential; others of the run must prove the same") {
  Harness h;
  h.settings = Settings(2, 3);
  REQUIRE(h.JoinWithRunSecret(0, "run-secret").ok());
  // Another credential, or none, is refused naming the run; nothing of the job changes.
  absl::Status other = h.JoinWithRunSecret(1, "daemon-token-only");
  CHECK(other.code() == absl::StatusCode::kPermissionDenied);
  CHECK(std::string(other.message()).find("run job is bound to another run credential") != std::string::npos);
  absl::Status none = h.Join(2);
  CHECK(none.code() == absl::StatusCode::kPermissionDenied);
  CHECK(std::string(none.message()).find("this node has none") != std::string::npos);
  CHECK(h.coordinator.View("job")->pending == 1);
  // Presenting the run's public key without its private key does not verify.
  absl::Status forged = h.JoinWithRunSecret(3, "run-secret", "forger");
  CHECK(forged.code() == absl::StatusCode::kUnauthenticated);
  // The same credential is welcome; its later Joins on the session need no signature.
  REQUIRE(h.JoinWithRunSecret(4, "run-secret").ok());
  h.Advance(milliseconds(1000));
  CHECK(h.Started(4).group_world_size() == 2);
  REQUIRE(h.Ended(0, 1, false).ok());  // max_restarts 0: the job ends, as any failure would.
  CHECK(h.View0Done());
}

TEST_CASE("require_run_token: a run with no credential of its own, or only the token's, is refused") {
  Coordinator::Options options;
  options.token = "daemon-token";
  options.require_run_token = true;
  Harness h(options);
  // A session's first Join proving the token and signed with the run key of `secret`.
  auto join = [&](int n, const std::string& secret) {
    RecordingSink& sink = h.Connect(n);
    const std::string server_nonce = sink.messages.front().challenge().nonce();
    const std::string client_nonce = RandomNonce();
    v1::AgentMessage m;
    *m.mutable_join() = h.MakeJoin(n);
    m.mutable_join()->set_client_nonce(client_nonce);
    m.mutable_join()->set_proof(
        AgentProof(TokenKey("daemon-token"), server_nonce, client_nonce, h.run_id, m.join().node_id()));
    if (!secret.empty()) {
      RunKey key = DeriveRunKey(secret, h.run_id);
      m.mutable_join()->set_run_key(key.public_key);
      m.mutable_join()->set_run_signature(SignJoin(key, server_nonce, client_nonce, h.run_id, m.join().node_id()));
    }
    return h.Send(n, m);
  };
  for (const std::string& secret : {std::string(), std::string("daemon-token")}) {
    absl::Status refused = join(secret.empty() ? 0 : 1, secret);
    CHECK(refused.code() == absl::StatusCode::kPermissionDenied);
    CHECK(std::string(refused.message()) ==
          "run job has no credential of its own, and this coordinator requires one for every run "
          "(run_token_file=PATH or ELRUN_RUN_TOKEN on every node)");
  }
  CHECK(h.coordinator.job_count() == 0);
  REQUIRE(join(2, "run-secret").ok());  // Its own run_token: welcome.
  CHECK(h.coordinator.job_count() == 1);
}

TEST_CASE("an open run (first node without credential) refuses a node that brings one") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  CHECK(h.JoinWithRunSecret(1, "s").code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(h.Join(2).ok());
  CHECK(h.coordinator.View("job")->running);
}

TEST_CASE("a rejoining node keeps the key its session proved") {
  Harness h;
  h.settings.set_max_restarts(1);
  REQUIRE(h.JoinWithRunSecret(0, "k").ok());
  REQUIRE(h.JoinWithRunSecret(1, "k").ok());
  REQUIRE(h.Ended(1, 1, false).ok());
  REQUIRE(h.Join(0).ok());  // Unsigned: the session proved the key already.
  REQUIRE(h.Join(1).ok());
  CHECK(h.Started(0).round() == 2);
}

TEST_CASE("the snapshot and counters: jobs, nodes by rank, restarts, losses, refusals, evictions") {
  Harness h;
  h.settings.set_max_restarts(1);
  REQUIRE(h.Join(0, 2).ok());
  REQUIRE(h.Join(1, 3).ok());
  v1::AgentMessage bad;
  *bad.mutable_join() = h.MakeJoin(5);
  bad.mutable_join()->set_nproc(0);
  h.Connect(5);
  CHECK(h.Send(5, bad).code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(h.Ended(1, 1, false).ok());  // A restart.
  REQUIRE(h.Join(0, 2).ok());
  REQUIRE(h.Join(1, 3).ok());
  CoordinatorSnapshot snapshot = h.coordinator.Snapshot();
  CHECK(snapshot.counters.rounds_started == 2);
  CHECK(snapshot.counters.restarts == 1);
  CHECK(snapshot.counters.refused.at("invalid_argument") == 1);
  CHECK(snapshot.sessions == 3);
  REQUIRE(snapshot.jobs.size() == 1);
  const JobStatus& job = snapshot.jobs[0];
  CHECK(job.run_id == "job");
  CHECK(job.phase == "running");
  CHECK(job.round == 2);
  CHECK(job.restart_count == 1);
  CHECK(job.last_failure == "node node1 (group rank 1): local_rank 0 exit code 1");
  REQUIRE(job.nodes.size() == 2);
  CHECK(job.nodes[0].node_id == "node0");
  CHECK(job.nodes[0].group_rank == 0);
  CHECK(job.nodes[0].state == "active");
  CHECK(job.nodes[1].nproc == 3);
  CHECK(job.nodes[1].master_addr == "127.0.0.2");
  // A hung node: evicted, and its loss ends the round.
  h.Advance(milliseconds(4000));
  REQUIRE(h.Heartbeat(0).ok());
  h.Advance(milliseconds(1001));
  snapshot = h.coordinator.Snapshot();
  CHECK(snapshot.counters.evictions.at("no_heartbeat") == 1);
  CHECK(snapshot.counters.node_losses == 1);
  CHECK(snapshot.jobs[0].last_failure == "node node1 (group rank 1) lost: no heartbeat");
}

TEST_CASE("a job with nobody left is forgotten") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  h.coordinator.OnDisconnect(h.agents[0].id, h.now);
  CHECK(h.coordinator.job_count() == 0);
  CHECK_FALSE(h.coordinator.NextDeadline().has_value());
}

TEST_CASE("a node that succeeded and left does not restart the others") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Ended(0, 1, true).ok());
  h.Clear();
  h.coordinator.OnDisconnect(h.agents[0].id, h.now);
  CHECK(h.Sink(1).messages.empty());
  REQUIRE(h.Ended(1, 1, true).ok());
  CHECK(h.Sink(1).Pop().job_ended().success());
}

TEST_CASE("every setting must match the job's, refused naming the key and both values") {
  struct Case {
    void (*mutate)(v1::JobSettings&);
    const char* text;
  };
  for (Case c :
       {Case{[](v1::JobSettings& s) { s.set_heartbeat_timeout_ms(7LL * 24 * 3600 * 1000); },
             "heartbeat_timeout_ms 604800000 (the job has 5000)"},
        Case{[](v1::JobSettings& s) { s.set_join_timeout_ms(1); }, "join_timeout_ms 1 (the job has 60000)"},
        Case{[](v1::JobSettings& s) { s.set_last_call_timeout_ms(0); }, "last_call_timeout_ms 0 (the job has 1000)"},
        Case{[](v1::JobSettings& s) { s.set_close_timeout_ms(5); }, "close_timeout_ms 5 (the job has 30000)"},
        Case{[](v1::JobSettings& s) { s.set_max_restarts(9); }, "max_restarts 9 (the job has 0)"}}) {
    Harness h;
    REQUIRE(h.Join(0).ok());
    c.mutate(h.settings);
    absl::Status status = h.Join(1);
    CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_MESSAGE(std::string(status.message()).find(c.text) != std::string::npos, status.message());
    CHECK(h.coordinator.View("job")->pending == 1);
  }
}

TEST_CASE("a survivor keeps its place: wait-listed spares only fill the vacancy") {
  Harness h;  // 2:2.
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Join(2).ok());
  REQUIRE(h.Join(3).ok());
  REQUIRE(h.Sink(3).messages.back().waiting().wait_listed());
  h.Clear();
  h.coordinator.OnDisconnect(h.agents[1].id, h.now);             // Rank 1 dies; node 0 survives.
  CHECK_FALSE(h.Has(2, v1::CoordinatorMessage::kRoundStarted));  // Not before the survivor is back.
  CHECK_FALSE(h.Has(3, v1::CoordinatorMessage::kRoundStarted));
  REQUIRE(h.Join(0).ok());
  CHECK(h.Started(0).group_rank() == 0);
  CHECK(h.Started(2).group_rank() == 1);  // The earliest spare takes the vacancy.
  CHECK_FALSE(h.Has(3, v1::CoordinatorMessage::kRoundStarted));
  CHECK(h.Sink(3).messages.back().waiting().wait_listed());
}

TEST_CASE("newcomers to a running job never displace its survivors, rank 0 included") {
  Harness h;
  h.settings = Settings(2, 3);
  h.settings.set_last_call_timeout_ms(0);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Started(0).group_world_size() == 2);
  h.Clear();
  for (int n : {2, 3, 4}) REQUIRE(h.Join(n).ok());
  for (int n : {2, 3, 4}) CHECK_FALSE(h.Has(n, v1::CoordinatorMessage::kRoundStarted));
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Join(0).ok());
  CHECK(h.Started(0).group_rank() == 0);
  CHECK(h.Started(1).group_rank() == 1);
  CHECK(h.Started(2).group_rank() == 2);
  CHECK(h.Started(0).group_world_size() == 3);
  for (int n : {3, 4}) {
    CHECK_FALSE(h.Has(n, v1::CoordinatorMessage::kRoundStarted));
    CHECK(h.Sink(n).messages.back().waiting().wait_listed());
  }
}

TEST_CASE("a survivor that never rejoins is declared lost after join_timeout") {
  Harness g;
  g.settings = Settings(2, 3, 5);
  g.settings.set_join_timeout_ms(3000);
  REQUIRE(g.Join(0).ok());
  REQUIRE(g.Join(1).ok());
  REQUIRE(g.Join(2).ok());
  REQUIRE(g.Started(0).group_world_size() == 3);
  g.Clear();
  REQUIRE(g.Ended(2, 1, false).ok());  // Restart; node 2 keeps heartbeating but never rejoins.
  REQUIRE(g.Join(0).ok());
  REQUIRE(g.Join(1).ok());
  for (int i = 0; i < 3; ++i) {
    CHECK_FALSE(g.Has(0, v1::CoordinatorMessage::kRoundStarted));
    for (int n : {0, 1, 2}) REQUIRE(g.Heartbeat(n).ok());
    g.Advance(milliseconds(1000));
  }
  REQUIRE(g.Sink(2).closed.has_value());
  CHECK(g.Sink(2).closed->code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(g.Started(0).group_world_size() == 2);
  CHECK(g.Started(0).group_rank() == 0);
}

TEST_CASE("a scale-up ends the round at most once per last_call_timeout, however nodes flap") {
  Harness h;
  h.settings = Settings(1, 3);  // Last call 1000 ms.
  REQUIRE(h.Join(0).ok());
  h.Advance(milliseconds(1000));
  REQUIRE(h.Has(0, v1::CoordinatorMessage::kRoundStarted));
  h.Clear();
  int restarts = 0;
  // Three join-and-leave cycles within one last call: none of them restarts the job.
  for (int cycle = 0; cycle < 3; ++cycle) {
    int n = 10 + cycle;
    REQUIRE(h.Join(n).ok());
    CHECK_FALSE(h.Sink(n).messages.back().waiting().wait_listed());
    CHECK(h.Sink(n).messages.back().waiting().job_running());
    h.Advance(milliseconds(100));
    REQUIRE(h.Heartbeat(0).ok());
    h.coordinator.OnDisconnect(h.agents[n].id, h.now);
  }
  restarts += h.Has(0, v1::CoordinatorMessage::kRoundEnded);
  CHECK(restarts == 0);
  // A newcomer that stays gets its round once the last call since the round's start is over.
  REQUIRE(h.Join(20).ok());
  h.Advance(milliseconds(699));
  CHECK_FALSE(h.Has(0, v1::CoordinatorMessage::kRoundEnded));
  h.Advance(milliseconds(1));
  REQUIRE(h.Has(0, v1::CoordinatorMessage::kRoundEnded));
  CHECK(h.Sink(0).Pop().round_ended().reason() == v1::RoundEnded::NODE_JOINED);
  REQUIRE(h.Join(0).ok());
  CHECK(h.Started(20).group_world_size() == 2);
  CHECK(h.Started(0).group_rank() == 0);
  // The flapper is back at once: it waits for the next last call.
  h.Clear();
  REQUIRE(h.Join(21).ok());
  CHECK_FALSE(h.Has(0, v1::CoordinatorMessage::kRoundEnded));
  REQUIRE(h.coordinator.NextDeadline().has_value());
}

TEST_CASE("a session that never joins is closed after the first-join timeout") {
  Harness h;  // The coordinator's default: 10 s.
  h.settings.set_heartbeat_timeout_ms(60000);
  h.Connect(0);
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.coordinator.NextDeadline().has_value());
  h.Advance(milliseconds(9999));
  CHECK_FALSE(h.Sink(0).closed.has_value());
  h.Advance(milliseconds(1));
  REQUIRE(h.Sink(0).closed.has_value());
  CHECK(h.Sink(0).closed->code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_FALSE(h.Sink(1).closed.has_value());  // Joined in time: a member, kept.
}

TEST_CASE("an ended job is forgotten after close_timeout, whatever its sessions do") {
  Harness h;
  h.settings.set_close_timeout_ms(2000);
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  REQUIRE(h.Ended(0, 1, true).ok());
  REQUIRE(h.Ended(1, 1, true).ok());
  REQUIRE(h.Has(0, v1::CoordinatorMessage::kJobEnded));
  h.coordinator.OnDisconnect(h.agents[1].id, h.now);  // Node 0 stays, silent.
  h.Advance(milliseconds(1999));
  CHECK(h.coordinator.job_count() == 1);
  CHECK(h.Join(2).code() == absl::StatusCode::kFailedPrecondition);  // "has already ended".
  h.Advance(milliseconds(1));
  REQUIRE(h.Sink(0).closed.has_value());
  CHECK(h.Sink(0).closed->code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(h.coordinator.job_count() == 0);
  h.agents.erase(2);
  REQUIRE(h.Join(2).ok());  // The run id is free again.
  CHECK(h.coordinator.View("job")->pending == 1);
}

}  // namespace
}  // namespace elrun::rdzv

namespace elrun::rdzv {
namespace {

TEST_CASE("WaitUntilJobGone returns once every node has left, or at the deadline") {
  Harness h;
  REQUIRE(h.Join(0).ok());
  REQUIRE(h.Join(1).ok());
  auto soon = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
  CHECK_FALSE(h.coordinator.WaitUntilJobGone("job", soon));
  std::thread leaver([&] {
    h.coordinator.OnDisconnect(h.agents[0].id, h.now);
    h.coordinator.OnDisconnect(h.agents[1].id, h.now);
  });
  CHECK(h.coordinator.WaitUntilJobGone("job", std::chrono::steady_clock::now() + std::chrono::seconds(10)));
  leaver.join();
  CHECK(h.coordinator.WaitUntilJobGone("other", std::chrono::steady_clock::now()));
}

}  // namespace
}  // namespace elrun::rdzv
