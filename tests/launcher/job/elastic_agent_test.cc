// The elastic agent without a network: the test plays the coordinator (its messages, its proofs),
// the process table is a fake whose workers end when the test says, and time is a fake clock.
#include "launcher/job/elastic_agent.h"

#include <doctest/doctest.h>

#include <csignal>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "agent/coordinator/coordinator.h"
#include "agent/coordinator/session_auth.h"
#include "launcher/worker/log_layout.h"
#include "tests/launcher/job/fake_process_table.h"
#include "tests/port_probe.h"
#include "tests/temp_dir.h"

namespace elrun {
namespace {

namespace v1 = rdzv::v1;
using std::chrono::milliseconds;

class RecordingSession : public RendezvousSession {
 public:
  void Send(const v1::AgentMessage& message) override { sent.push_back(message); }
  std::vector<v1::AgentMessage> sent;
};

std::string Env(const WorkerLaunch& launch, const std::string& name) {
  for (const std::string& entry : launch.env) {
    if (entry.rfind(name + "=", 0) == 0) return entry.substr(name.size() + 1);
  }
  return "<unset>";
}

struct Fixture {
  std::string dir = testing::MakeTempDir("agent");
  JobSpec spec = [] {
    JobSpec s;
    s.nproc_per_node = 2;
    s.min_nodes = 1;
    s.max_nodes = 2;
    s.max_restarts = 1;
    s.rdzv_backend = "grpc";
    s.rdzv_id = "job";
    return s;
  }();
  RdzvSettings rdzv = [] {
    RdzvSettings r;
    r.host = "127.0.0.1";
    r.port = 29400;
    r.token = "s3cret";
    return r;
  }();
  FakeProcessTable table;
  FakeClock clock;
  RecordingSession session;
  LogLayout layout{dir, "job"};
  std::map<std::string, std::string> env{{"PATH", "/bin"}};
  std::vector<int> offered;  // Each port the agent reserved for a Join, in order.
  AttemptBuilder builder{spec, {"/bin/worker"}, "job", layout, env, [] { return PortReservation::Take(); }};
  ElasticAgent agent{spec, rdzv, table, clock, session, builder, "10.0.0.7", "nodeA", [this] {
                       auto held = PortReservation::Take();
                       if (held.ok()) offered.push_back(held->port());
                       return held;
                     }};
  std::string server_nonce = std::string(rdzv::kNonceBytes, 'S');

  void Send(const v1::CoordinatorMessage& message) { agent.OnMessage(message); }
  // The coordinator's side of the session's start; returns the agent's first Join.
  v1::Join Handshake(bool prove = true) {
    agent.Start();
    v1::CoordinatorMessage challenge;
    challenge.mutable_challenge()->set_nonce(server_nonce);
    Send(challenge);
    REQUIRE(session.sent.size() == 1);
    v1::Join join = session.sent[0].join();
    v1::CoordinatorMessage welcome;
    welcome.mutable_welcome()->set_proof(
        prove ? rdzv::CoordinatorProof(rdzv::TokenKey("s3cret"), server_nonce, join.client_nonce())
              : std::string(32, 'x'));
    Send(welcome);
    return join;
  }
  v1::CoordinatorMessage Round(uint64_t round, int restart_count = 0) {
    v1::CoordinatorMessage m;
    v1::RoundStarted* r = m.mutable_round_started();
    r->set_round(round);
    r->set_group_rank(1);
    r->set_group_world_size(2);
    r->set_rank_offset(2);
    r->set_world_size(4);
    r->set_role_rank_offset(2);
    r->set_role_world_size(4);
    r->set_master_addr("10.0.0.1");
    r->set_master_port(29500);
    r->set_restart_count(restart_count);
    return m;
  }
  void ExitAll(ExitStatus status) {
    std::vector<int> pids(table.alive().begin(), table.alive().end());
    for (int pid : pids) {
      table.Exit(pid);
      agent.OnWorkerExit(pid, status);
    }
  }
};

TEST_CASE("nothing before the Challenge; the first Join proves the token without sending it") {
  Fixture f;
  f.agent.Start();
  f.clock.Advance(milliseconds(5000));
  f.agent.OnDeadline();
  CHECK(f.session.sent.empty());  // No heartbeat before the session's Join.
  v1::Join join = f.Handshake();
  CHECK(join.protocol_version() == rdzv::kProtocolVersion);
  CHECK(join.client_nonce().size() == rdzv::kNonceBytes);
  CHECK(join.proof() ==
        rdzv::AgentProof(rdzv::TokenKey("s3cret"), f.server_nonce, join.client_nonce(), "job", "nodeA"));
  CHECK(join.proof().find("s3cret") == std::string::npos);
  CHECK(join.nproc() == 2);
  CHECK(join.master_addr() == "10.0.0.7");
  REQUIRE(f.offered.size() == 1);
  CHECK(join.master_port() == f.offered[0]);
  CHECK(testing::PortHeld(f.offered[0]));  // Nothing else on the host takes it before rank 0 binds.
  CHECK(join.settings().max_restarts() == 1);
  CHECK_FALSE(f.agent.done());
}

TEST_CASE("the first Join signs with the run key of run_token, else of the token") {
  Fixture f;
  v1::Join join = f.Handshake();
  CHECK(join.run_key() == rdzv::DeriveRunKey("s3cret", "job").public_key);
  CHECK(rdzv::VerifyJoinSignature(join.run_key(), join.run_signature(), f.server_nonce, join.client_nonce(), "job",
                                  "nodeA"));
  Fixture g;
  g.rdzv.run_token = "run-only";
  join = g.Handshake();
  CHECK(join.run_key() == rdzv::DeriveRunKey("run-only", "job").public_key);
  CHECK(join.run_key() != rdzv::DeriveRunKey("run-only", "other-job").public_key);
  CHECK(rdzv::VerifyJoinSignature(join.run_key(), join.run_signature(), g.server_nonce, join.client_nonce(), "job",
                                  "nodeA"));
  CHECK_FALSE(rdzv::VerifyJoinSignature(join.run_key(), join.run_signature(), g.server_nonce, join.client_nonce(),
                                        "job", "nodeB"));
}

TEST_CASE("heartbeats every heartbeat_interval once joined") {
  Fixture f;
  f.Handshake();
  REQUIRE(f.agent.Deadline().has_value());
  f.clock.Advance(f.rdzv.heartbeat_interval);
  f.agent.OnDeadline();
  REQUIRE(f.session.sent.size() == 2);
  CHECK(f.session.sent[1].has_heartbeat());
}

TEST_CASE("while a round runs the node's goodput goes with a heartbeat every pace interval, and a fault is told") {
  Fixture f;
  std::vector<std::pair<std::string, std::string>> faults;
  f.agent.SetFaultSink([&](const std::string& kind, const std::string& detail) { faults.emplace_back(kind, detail); });
  f.agent.SetProgressSource([] {
    v1::Progress progress;
    progress.set_step(41);
    progress.set_goodput(0.97);
    return progress;
  });
  f.Handshake();
  auto progress_sent = [&] {
    int n = 0;
    for (const v1::AgentMessage& m : f.session.sent) n += m.has_progress();
    return n;
  };
  f.clock.Advance(ElasticAgent::kPaceInterval);
  f.agent.OnDeadline();
  CHECK(progress_sent() == 0);  // No round yet.
  f.Send(f.Round(3));
  f.clock.Advance(ElasticAgent::kPaceInterval);
  f.agent.OnDeadline();
  REQUIRE(progress_sent() == 1);
  const v1::Progress& sent = f.session.sent.back().progress();
  CHECK(sent.round() == 3);
  CHECK(sent.step() == 41);
  CHECK(sent.goodput() == doctest::Approx(0.97));
  // A worker of this node fails: the fault is told once, with its description.
  int pid = *f.table.alive().begin();
  f.table.Exit(pid);
  f.agent.OnWorkerExit(pid, ExitStatus::Exited(3));
  REQUIRE(faults.size() == 1);
  CHECK(faults[0].first == "worker failed");
  CHECK(faults[0].second.find("exit code 3") != std::string::npos);
  v1::CoordinatorMessage ended;
  ended.mutable_round_ended()->set_round(3);
  ended.mutable_round_ended()->set_reason(v1::RoundEnded::NODE_LOST);
  ended.mutable_round_ended()->set_detail("node b: no heartbeat");
  f.Send(ended);
  REQUIRE(faults.size() == 2);
  CHECK(faults[1].first == "new round");
  CHECK(faults[1].second == "round 3 ended: a node was lost: node b: no heartbeat");
}

TEST_CASE("a coordinator that cannot prove the token is left before any worker starts") {
  Fixture f;
  f.Handshake(/*prove=*/false);
  f.Send(f.Round(1));
  CHECK(f.agent.done());
  CHECK(f.agent.exit_code() == kExitJobFailed);
  CHECK(f.agent.rendezvous_error().find("could not prove it knows the token") != std::string::npos);
  CHECK(f.table.spawned().empty());
}

TEST_CASE("a round before the Welcome is not trusted") {
  Fixture f;
  f.agent.Start();
  v1::CoordinatorMessage challenge;
  challenge.mutable_challenge()->set_nonce(f.server_nonce);
  f.Send(challenge);
  f.Send(f.Round(1));
  CHECK(f.agent.done());
  CHECK(f.agent.rendezvous_error().find("before proving it knows the token") != std::string::npos);
  CHECK(f.table.spawned().empty());
}

TEST_CASE("an invalid round is refused, naming the field, and starts nothing") {
  Fixture f;
  f.Handshake();
  v1::CoordinatorMessage round = f.Round(1);
  round.mutable_round_started()->set_world_size(-3);
  f.Send(round);
  CHECK(f.agent.done());
  CHECK(f.agent.rendezvous_error().find("world_size = -3") != std::string::npos);
  CHECK(f.table.spawned().empty());
}

TEST_CASE("a round runs the workers with the assigned ranks; success is reported, then the end") {
  Fixture f;
  f.Handshake();
  f.Send(f.Round(1));
  REQUIRE(f.table.spawned().size() == 2);
  const WorkerLaunch& second = f.table.spawned()[1].second;
  CHECK(Env(second, "RANK") == "3");
  CHECK(Env(second, "LOCAL_RANK") == "1");
  CHECK(Env(second, "WORLD_SIZE") == "4");
  CHECK(Env(second, "MASTER_ADDR") == "10.0.0.1");
  CHECK(Env(second, "MASTER_PORT") == "29500");
  f.ExitAll(ExitStatus::Exited(0));
  REQUIRE(f.session.sent.back().has_workers_ended());
  CHECK(f.session.sent.back().workers_ended().round() == 1);
  CHECK(f.session.sent.back().workers_ended().success());
  CHECK_FALSE(f.agent.done());
  v1::CoordinatorMessage end;
  end.mutable_job_ended()->set_success(true);
  f.Send(end);
  CHECK(f.agent.done());
  CHECK(f.agent.exit_code() == kExitSuccess);
}

TEST_CASE("RoundEnded stops the workers, then the agent rejoins without a second proof") {
  Fixture f;
  f.Handshake();
  f.Send(f.Round(1));
  int first = f.table.spawned()[0].first;
  v1::CoordinatorMessage ended;
  ended.mutable_round_ended()->set_round(1);
  ended.mutable_round_ended()->set_reason(v1::RoundEnded::NODE_LOST);
  ended.mutable_round_ended()->set_detail("node B lost\x1b[2J");
  f.Send(ended);
  CHECK(f.table.WasSignaled(first, SIGTERM));
  size_t before = f.session.sent.size();
  f.ExitAll(ExitStatus::Signaled(SIGTERM));
  REQUIRE(f.session.sent.size() == before + 1);
  const v1::Join& rejoin = f.session.sent.back().join();
  CHECK(rejoin.run_id() == "job");
  CHECK(rejoin.proof().empty());
  CHECK(rejoin.client_nonce().empty());
  REQUIRE(f.offered.size() == 2);  // A fresh port; the first round's goes back.
  CHECK(rejoin.master_port() == f.offered[1]);
  CHECK(testing::PortHeld(f.offered[1]));
  CHECK_FALSE(testing::PortHeld(f.offered[0]));
  f.Send(f.Round(2, 0));
  CHECK(f.table.spawned().size() == 4);
  f.Send(f.Round(2, 0));  // An old round again: ignored while running.
  CHECK(f.table.spawned().size() == 4);
}

// The --history-file lines, as parsed values: event names in order, and each line's fields.
std::vector<std::string> HistoryEvents(const std::string& path) {
  std::vector<std::string> events;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    size_t at = line.find("\"event\":\"");
    REQUIRE(at != std::string::npos);
    at += 9;
    events.push_back(line.substr(at, line.find('"', at) - at));
  }
  return events;
}

TEST_CASE("--history-file: each line says what the node was told and did, in order, with a wall time") {
  Fixture f;
  const std::string path = f.dir + "/history.jsonl";
  auto history = RoundHistory::Open(path, "nodeA", f.clock);
  REQUIRE(history.ok());
  f.agent.SetHistory(history->get());
  f.Handshake();
  f.Send(f.Round(1));
  v1::CoordinatorMessage ended;
  ended.mutable_round_ended()->set_round(1);
  ended.mutable_round_ended()->set_reason(v1::RoundEnded::NODE_LOST);
  f.Send(ended);
  f.ExitAll(ExitStatus::Signaled(SIGTERM));
  f.Send(f.Round(2, 0));
  f.rdzv.rejoin_timeout = std::chrono::milliseconds(0);
  f.agent.OnSessionEnded(absl::UnavailableError("keepalive watchdog timeout"));
  f.ExitAll(ExitStatus::Signaled(SIGTERM));
  REQUIRE(f.agent.done());
  CHECK(HistoryEvents(path) == std::vector<std::string>{"join", "round", "workers_started", "round_ended",
                                                        "workers_gone", "join", "round", "workers_started",
                                                        "coordinator_lost", "workers_gone", "left"});
  std::ifstream in(path);
  std::string line;
  for (int i = 0; i < 2; ++i) std::getline(in, line);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(f.clock.WallNow().time_since_epoch()).count();
  CHECK(line == "{\"t_ms\":" + std::to_string(ms) +
                    ",\"node\":\"nodeA\",\"event\":\"round\",\"round\":1,\"group_rank\":1,\"groups\":2,"
                    "\"world\":4,\"rank_offset\":2,\"nproc\":2,\"restarts\":0,\"master\":\"10.0.0.1:29500\","
                    "\"keep\":false,\"coordinator\":\"\"}");
  CHECK_FALSE(RoundHistory::Open(f.dir + "/no/such/dir/h.jsonl", "nodeA", f.clock).ok());
}

TEST_CASE("a failure is reported with its description; the job's end then fails this node") {
  Fixture f;
  f.Handshake();
  f.Send(f.Round(1));
  int first = f.table.spawned()[0].first;
  f.table.Exit(first);
  f.agent.OnWorkerExit(first, ExitStatus::Exited(3));
  f.ExitAll(ExitStatus::Signaled(SIGTERM));  // The other one, stopped by the agent.
  REQUIRE(f.session.sent.back().has_workers_ended());
  CHECK_FALSE(f.session.sent.back().workers_ended().success());
  CHECK(f.session.sent.back().workers_ended().failure().find("exit code 3") != std::string::npos);
  v1::CoordinatorMessage end;
  end.mutable_job_ended()->set_success(false);
  end.mutable_job_ended()->set_detail("no restarts left\n");
  f.Send(end);
  CHECK(f.agent.done());
  CHECK(f.agent.exit_code() == kExitJobFailed);
  CHECK(f.agent.end_detail() == "no restarts left\\n");  // Escaped.
  CHECK(f.agent.failed() != nullptr);
}

TEST_CASE("with rejoin_timeout 0, losing the session while workers run stops them and fails this node") {
  Fixture f;
  f.rdzv.rejoin_timeout = std::chrono::milliseconds(0);
  f.Handshake();
  f.Send(f.Round(1));
  f.agent.OnSessionEnded(absl::UnavailableError("keepalive watchdog timeout"));
  CHECK(f.table.WasSignaled(f.table.spawned()[0].first, SIGTERM));
  CHECK_FALSE(f.agent.done());  // Not before the workers are gone.
  f.ExitAll(ExitStatus::Signaled(SIGTERM));
  CHECK(f.agent.done());
  CHECK(f.agent.exit_code() == kExitJobFailed);
  CHECK(f.agent.rendezvous_error() == "lost the rendezvous coordinator at 127.0.0.1:29400: keepalive watchdog timeout");
}

TEST_CASE("a lost session: the workers stop, then the agent rejoins through a new session as a new node id") {
  Fixture f;
  f.Handshake();
  f.Send(f.Round(1));
  const int first = f.table.spawned()[0].first;
  f.agent.OnSessionEnded(absl::UnavailableError("recvmsg:Connection timed out"));
  CHECK(f.table.WasSignaled(first, SIGTERM));
  CHECK_FALSE(f.agent.wants_session());  // Not before the workers are gone.
  f.ExitAll(ExitStatus::Signaled(SIGTERM));
  CHECK(f.agent.wants_session());
  CHECK_FALSE(f.agent.done());
  CHECK(f.agent.rejoin_deadline() == f.clock.SteadyNow() + f.rdzv.heartbeat_timeout);  // The default.
  f.session.sent.clear();
  f.agent.OnNewSession("nodeA-r1");
  CHECK_FALSE(f.agent.wants_session());
  v1::Join join = f.Handshake();  // The new session proves the token again, as the new id.
  CHECK(join.node_id() == "nodeA-r1");
  CHECK(join.proof() ==
        rdzv::AgentProof(rdzv::TokenKey("s3cret"), f.server_nonce, join.client_nonce(), "job", "nodeA-r1"));
  f.Send(f.Round(3, 0));  // The round the others formed meanwhile was 2.
  CHECK(f.table.spawned().size() == 4);
  // Lost again later: a new time to rejoin starts from that loss.
  f.clock.Advance(std::chrono::seconds(60));
  f.agent.OnSessionEnded(absl::UnavailableError("keepalive watchdog timeout"));
  f.ExitAll(ExitStatus::Signaled(SIGTERM));
  CHECK(f.agent.wants_session());
  CHECK(f.agent.rejoin_deadline() == f.clock.SteadyNow() + f.rdzv.heartbeat_timeout);
}

TEST_CASE("rejoining: a round, or word that the job runs on, is due within rejoin_timeout of the loss") {
  for (bool job_running : {false, true}) {
    CAPTURE(job_running);
    Fixture f;
    f.rdzv.rejoin_timeout = std::chrono::milliseconds(2000);
    f.Handshake();
    f.agent.OnSessionEnded(absl::UnavailableError("keepalive watchdog timeout"));
    REQUIRE(f.agent.wants_session());
    f.agent.OnNewSession("nodeA-r1");
    f.session.sent.clear();
    f.Handshake();
    v1::CoordinatorMessage waiting;
    waiting.mutable_waiting()->set_job_running(job_running);  // No: the run id began anew (the job ended).
    f.Send(waiting);
    f.clock.Advance(std::chrono::milliseconds(2100));
    f.agent.OnDeadline();
    CHECK(f.agent.done() == !job_running);  // A running job: waits for its place up to join_timeout.
    if (!job_running) {
      CHECK(f.agent.rendezvous_error() ==
            "lost the rendezvous coordinator at 127.0.0.1:29400: keepalive watchdog timeout; could not rejoin the job "
            "within rejoin_timeout (2 s)");
    }
  }
}

TEST_CASE("a rejoin that finds the coordinator restarted accepts its rounds from 1 again; the same one does not") {
  for (bool restarted : {false, true}) {
    CAPTURE(restarted);
    Fixture f;
    auto welcome_with = [&](const std::string& incarnation) {
      v1::Join join = f.session.sent.back().join();
      v1::CoordinatorMessage welcome;
      welcome.mutable_welcome()->set_proof(
          rdzv::CoordinatorProof(rdzv::TokenKey("s3cret"), f.server_nonce, join.client_nonce()));
      welcome.mutable_welcome()->set_incarnation(incarnation);
      f.Send(welcome);
    };
    auto challenge = [&] {
      v1::CoordinatorMessage c;
      c.mutable_challenge()->set_nonce(f.server_nonce);
      f.Send(c);
    };
    f.agent.Start();
    challenge();
    welcome_with("first");
    f.Send(f.Round(3));
    REQUIRE(f.table.spawned().size() == 2);
    f.agent.OnSessionEnded(absl::UnavailableError("Socket closed"));
    f.ExitAll(ExitStatus::Signaled(SIGTERM));
    REQUIRE(f.agent.wants_session());
    f.agent.OnNewSession("nodeA-r1");
    challenge();
    welcome_with(restarted ? "second" : "first");
    f.Send(f.Round(1));  // A restarted coordinator counts from 1; the same one never goes back.
    CHECK(f.table.spawned().size() == (restarted ? 4u : 2u));
    CHECK(f.agent.done() == !restarted);
  }
}

TEST_CASE("a lost session that cannot be replaced within rejoin_timeout: the agent leaves, naming the loss") {
  Fixture f;
  f.rdzv.rejoin_timeout = std::chrono::milliseconds(2000);
  f.Handshake();
  f.Send(f.Round(1));
  f.agent.OnSessionEnded(absl::UnavailableError("keepalive watchdog timeout"));
  f.ExitAll(ExitStatus::Signaled(SIGTERM));
  REQUIRE(f.agent.wants_session());
  f.agent.OnNewSession("nodeA-r1");
  f.clock.Advance(std::chrono::milliseconds(2100));  // The new session never connects.
  f.agent.OnSessionEnded(absl::UnavailableError("could not connect within 0.1 s"));
  CHECK(f.agent.done());
  CHECK(f.agent.exit_code() == kExitJobFailed);
  CHECK(f.agent.rendezvous_error() ==
        "lost the rendezvous coordinator at 127.0.0.1:29400: keepalive watchdog timeout; could not rejoin: could not "
        "connect within 0.1 s");
  Fixture g;  // Or a new session cannot be opened at all.
  g.Handshake();
  g.agent.OnSessionEnded(absl::UnavailableError("keepalive watchdog timeout"));
  REQUIRE(g.agent.wants_session());  // No workers ran: at once.
  g.agent.OnNewSessionFailed(absl::UnavailableError("etcd unreachable"));
  CHECK(g.agent.done());
  CHECK(g.agent.rendezvous_error() ==
        "lost the rendezvous coordinator at 127.0.0.1:29400: keepalive watchdog timeout; could not rejoin: etcd "
        "unreachable");
}

TEST_CASE("no round within join_timeout: the agent gives up") {
  Fixture f;
  f.rdzv.join_timeout = milliseconds(2000);
  f.Handshake();
  f.clock.Advance(milliseconds(7001));  // join_timeout + 5 s of grace.
  f.agent.OnDeadline();
  CHECK(f.agent.done());
  CHECK(f.agent.rendezvous_error().find("no rendezvous round formed") != std::string::npos);
}

// --keep-survivors across nodes: a control channel per launch, the regroups the agent sends.
struct KeepFixture : Fixture {
  std::vector<std::pair<int, WorkerLaunch>> told;  // (kept pid, its launch in the new round)
  KeepFixture() {
    spec.keep_survivors = true;
    agent.KeepSurvivors(
        [](std::vector<WorkerLaunch>& launches, int attempt) {
          for (WorkerLaunch& launch : launches) launch.env.push_back("ELRUN_GENERATION=" + std::to_string(attempt));
          return absl::OkStatus();
        },
        [this](int pid, const WorkerLaunch&, const WorkerLaunch& launch) {
          told.emplace_back(pid, launch);
          return true;
        });
  }
  void Ready(const std::vector<int>& pids, int generation) {
    for (int pid : pids) agent.OnWorkerReady(pid, generation);
  }
  // Joined, round 1 running, both workers ready in generation 0: their pids.
  std::vector<int> StartReady() {
    Handshake();
    Send(Round(1));
    std::vector<int> pids{table.spawned()[0].first, table.spawned()[1].first};
    Ready(pids, 0);
    return pids;
  }
  v1::CoordinatorMessage Ended(uint64_t round) {
    v1::CoordinatorMessage m;
    m.mutable_round_ended()->set_round(round);
    m.mutable_round_ended()->set_reason(v1::RoundEnded::WORKER_FAILED);
    return m;
  }
  v1::CoordinatorMessage KeepRound(uint64_t round, int restart_count, bool keep) {
    v1::CoordinatorMessage m = Round(round, restart_count);
    m.mutable_round_started()->set_keep_survivors(keep);
    m.mutable_round_started()->set_group_rank(0);  // The other node was lost: ranks move down.
    m.mutable_round_started()->set_rank_offset(0);
    return m;
  }
};

TEST_CASE("keep-survivors: a round ended elsewhere keeps the ready workers; the next round regroups them") {
  KeepFixture f;
  std::vector<int> pids = f.StartReady();
  CHECK(Env(f.table.spawned()[0].second, "ELRUN_GENERATION") == "0");
  CHECK(Env(f.table.spawned()[0].second, "ELRUN_JOIN_LIVE") == "<unset>");
  f.Send(f.Ended(1));
  CHECK(f.table.signals().empty());
  REQUIRE(f.session.sent.back().has_join());
  CHECK(f.session.sent.back().join().holds_survivors());
  f.Send(f.KeepRound(2, 1, true));
  CHECK(f.table.spawned().size() == 2);  // Nothing started: both kept.
  REQUIRE(f.told.size() == 2);
  CHECK(f.told[0].first == pids[0]);
  CHECK(Env(f.told[1].second, "RANK") == "1");  // Rank 3 before: its node is group rank 0 now.
  CHECK(Env(f.told[1].second, "ELRUN_GENERATION") == "1");
  CHECK(Env(f.told[1].second, "TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK(Env(f.told[1].second, "MASTER_PORT") == "29500");

  // Until the watchdog looks again, a kept worker may still be known by its old rank (3): only
  // this round's ranks (0 and 1) go to the coordinator, which refuses a rank of another node.
  f.agent.SetPaceSource(
      [] {
        std::vector<v1::RankPace> paces(3);
        paces[0].set_rank(3);
        paces[1].set_rank(1);
        paces[2].set_rank(2);
        return paces;
      },
      [](const v1::JobPace&) {});
  f.clock.Advance(ElasticAgent::kPaceInterval);
  f.agent.OnDeadline();
  REQUIRE(f.session.sent.back().has_paces());
  REQUIRE(f.session.sent.back().paces().ranks_size() == 1);
  CHECK(f.session.sent.back().paces().ranks(0).rank() == 1);
}

TEST_CASE("keep-survivors: a local failure keeps the other worker; the failed one rejoins from the live state") {
  KeepFixture f;
  std::vector<int> pids = f.StartReady();
  f.table.Exit(pids[1]);
  f.agent.OnWorkerExit(pids[1], ExitStatus::Signaled(SIGKILL));
  CHECK(f.table.signals().empty());
  REQUIRE(f.session.sent.back().has_workers_ended());
  CHECK_FALSE(f.session.sent.back().workers_ended().success());
  CHECK(f.session.sent.back().workers_ended().failure().find("SIGKILL") != std::string::npos);
  f.Send(f.Ended(1));
  REQUIRE(f.session.sent.back().has_join());
  CHECK(f.session.sent.back().join().holds_survivors());
  f.Send(f.KeepRound(2, 1, true));
  REQUIRE(f.told.size() == 1);
  CHECK(f.told[0].first == pids[0]);
  REQUIRE(f.table.spawned().size() == 3);
  const WorkerLaunch& replacement = f.table.spawned()[2].second;
  CHECK(replacement.local_rank == 1);
  CHECK(Env(replacement, "RANK") == "1");
  CHECK(Env(replacement, "ELRUN_JOIN_LIVE") == "1");
  CHECK(Env(replacement, "ELRUN_GENERATION") == "1");
}

TEST_CASE("keep-survivors: a round that keeps none stops the held workers first; a node without any joins live") {
  SUBCASE("held, but the round keeps none: stopped, then started afresh") {
    KeepFixture f;
    std::vector<int> pids = f.StartReady();
    f.Send(f.Ended(1));
    f.Send(f.KeepRound(2, 1, false));
    CHECK(f.table.WasSignaled(pids[0], SIGTERM));
    CHECK(f.table.spawned().size() == 2);  // Not before the kept ones are gone.
    f.ExitAll(ExitStatus::Signaled(SIGTERM));
    REQUIRE(f.table.spawned().size() == 4);
    CHECK(Env(f.table.spawned()[3].second, "ELRUN_JOIN_LIVE") == "<unset>");
    CHECK(f.told.empty());
  }
  SUBCASE("not ready: stopped as before, the Join holds nothing, and a keeping round starts them live") {
    KeepFixture f;
    f.Handshake();
    f.Send(f.Round(1));
    f.Send(f.Ended(1));
    CHECK(f.table.WasSignaled(f.table.spawned()[0].first, SIGTERM));
    f.ExitAll(ExitStatus::Signaled(SIGTERM));
    REQUIRE(f.session.sent.back().has_join());
    CHECK_FALSE(f.session.sent.back().join().holds_survivors());
    f.Send(f.KeepRound(2, 1, true));  // Another node kept its workers.
    REQUIRE(f.table.spawned().size() == 4);
    CHECK(Env(f.table.spawned()[2].second, "ELRUN_JOIN_LIVE") == "1");
    CHECK(Env(f.table.spawned()[3].second, "ELRUN_JOIN_LIVE") == "1");
  }
  SUBCASE("the job ends while a worker here failed and the other is held: this node failed") {
    KeepFixture f;
    std::vector<int> pids = f.StartReady();
    f.table.Exit(pids[1]);
    f.agent.OnWorkerExit(pids[1], ExitStatus::Exited(3));
    v1::CoordinatorMessage end;
    end.mutable_job_ended()->set_success(false);
    end.mutable_job_ended()->set_detail("no restarts left");
    f.Send(end);
    CHECK(f.table.WasSignaled(pids[0], SIGTERM));
    CHECK_FALSE(f.agent.done());
    f.ExitAll(ExitStatus::Signaled(SIGTERM));
    CHECK(f.agent.done());
    CHECK(f.agent.exit_code() == kExitJobFailed);
    REQUIRE(f.agent.failed() != nullptr);
    CHECK(f.agent.failed()->failures().front().local_rank == 1);
  }
}

}  // namespace
}  // namespace elrun
