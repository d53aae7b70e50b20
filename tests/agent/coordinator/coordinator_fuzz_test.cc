// Random and malformed traffic against the coordinator's handlers: no crash, no state change
// from a refused message, and every round it starts is consistent. Deterministic (fixed seeds).
#include <doctest/doctest.h>

#include <map>
#include <random>
#include <set>

#include "agent/coordinator/coordinator.h"

namespace elrun::rdzv {
namespace {

using std::chrono::milliseconds;

class CountingSink : public SessionSink {
 public:
  void Send(const v1::CoordinatorMessage& message) override { sent.push_back(message); }
  void Close(const absl::Status&) override { ++closed; }
  std::vector<v1::CoordinatorMessage> sent;
  int closed = 0;
};

struct Snapshot {
  size_t jobs = 0;
  std::map<std::string, std::tuple<uint64_t, bool, bool, int, int, int, int, int>> views;
  size_t messages = 0;
  bool operator==(const Snapshot& o) const { return jobs == o.jobs && views == o.views && messages == o.messages; }
};

class Fuzzer {
 public:
  explicit Fuzzer(uint32_t seed) : rng_(seed) {}

  void Step() {
    int session = Pick(0, kSessions - 1);
    int action = Pick(0, 99);
    if (!connected_.count(session)) {
      sinks_[session] = std::make_unique<CountingSink>();
      coordinator_.OnConnect(Id(session), sinks_[session].get(), now_);
      connected_.insert(session);
      return;
    }
    if (action < 5) {
      coordinator_.OnDisconnect(Id(session), now_);
      connected_.erase(session);
      return;
    }
    if (action < 15) {
      now_ += milliseconds(Pick(0, 3000));
      coordinator_.Tick(now_);
      return;
    }
    v1::AgentMessage message = RandomMessage(session);
    Snapshot before = Take();
    absl::Status status = coordinator_.OnMessage(Id(session), message, now_);
    if (!status.ok()) {
      ++refused_;
      CHECK_MESSAGE(Take() == before, "refused message changed state: ", status.ToString());
    }
  }

  void CheckRounds() {
    for (auto& [session, sink] : sinks_) {
      for (const auto& m : sink->sent) {
        if (!m.has_round_started()) continue;
        const auto& r = m.round_started();
        CHECK(r.group_rank() >= 0);
        CHECK(r.group_rank() < r.group_world_size());
        CHECK(r.rank_offset() >= 0);
        CHECK(r.rank_offset() < r.world_size());
        CHECK(r.restart_count() <= kMaxRestarts);
        CHECK(r.master_port() >= 1);
        started_.insert({r.round(), r.group_rank()});
      }
    }
  }

  int refused() const { return refused_; }
  size_t rounds_started() const { return started_.size(); }

 private:
  static constexpr int kSessions = 12;
  static constexpr int kMaxRestarts = 3;

  SessionId Id(int session) const { return 100 + session; }
  int Pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  v1::AgentMessage RandomMessage(int session) {
    v1::AgentMessage m;
    int kind = Pick(0, 9);
    if (kind < 4) {
      v1::Join* join = m.mutable_join();
      join->set_protocol_version(Pick(0, 20) == 0 ? 7 : kProtocolVersion);
      const char* run_ids[] = {"a", "b", "", "bad/id", "a"};
      join->set_run_id(run_ids[Pick(0, 4)]);
      join->set_node_id(Pick(0, 30) == 0 ? "" : "n" + std::to_string(session % (Pick(0, 3) ? 12 : 3)));
      join->set_nproc(Pick(-1, 4));
      join->set_role(Pick(0, 30) == 0 ? "" : "default");
      join->set_rank_hint(Pick(-2, 5));
      join->set_master_addr(Pick(0, 30) == 0 ? std::string(300, 'x') : "127.0.0.1");
      join->set_master_port(Pick(0, 30) == 0 ? 70000 : 20000 + session);
      v1::JobSettings* s = join->mutable_settings();
      s->set_min_nodes(Pick(0, 20) == 0 ? 0 : 2);
      s->set_max_nodes(Pick(0, 20) == 0 ? 1 : 4);
      s->set_max_restarts(Pick(0, 20) == 0 ? 9 : kMaxRestarts);
      s->set_last_call_timeout_ms(500);
      s->set_join_timeout_ms(Pick(0, 30) == 0 ? 0 : 20000);
      s->set_heartbeat_timeout_ms(5000);
      s->set_close_timeout_ms(30000);
    } else if (kind < 7) {
      m.mutable_heartbeat();
    } else if (kind < 9) {
      m.mutable_workers_ended()->set_round(static_cast<uint64_t>(Pick(0, 6)));
      m.mutable_workers_ended()->set_success(Pick(0, 1) == 1);
      m.mutable_workers_ended()->set_failure(Pick(0, 20) == 0 ? std::string(5000, 'f') : "exit 1");
    }  // else: an empty message.
    return m;
  }

  Snapshot Take() {
    // The counts the coordinator keeps as nodes change state equal a recount of its nodes.
    for (const JobStatus& job : coordinator_.Snapshot().jobs) {
      std::map<std::string, int> recount;
      for (const NodeStatus& node : job.nodes) ++recount[node.state];
      auto v = coordinator_.View(job.run_id);
      REQUIRE(v.has_value());
      CHECK(v->active == recount["active"]);
      CHECK(v->pending == recount["pending"]);
      CHECK(v->wait_listed == recount["wait_listed"]);
      CHECK(v->stopping == recount["stopping"]);
    }
    Snapshot s;
    s.jobs = coordinator_.job_count();
    for (const char* run_id : {"a", "b"}) {
      if (auto v = coordinator_.View(run_id)) {
        s.views[run_id] = {v->round,  v->running, v->done,        v->restart_count,
                           v->active, v->pending, v->wait_listed, v->stopping};
      }
    }
    for (auto& [session, sink] : sinks_) s.messages += sink->sent.size();
    return s;
  }

  std::mt19937 rng_;
  Coordinator coordinator_;
  TimePoint now_{std::chrono::seconds(1000)};
  std::map<int, std::unique_ptr<CountingSink>> sinks_;
  std::set<int> connected_;
  std::set<std::pair<uint64_t, int>> started_;
  int refused_ = 0;
};

TEST_CASE("random and malformed traffic: no crash, refused messages change nothing") {
  size_t rounds = 0;
  for (uint32_t seed : {1u, 2u, 3u, 42u, 2026u}) {
    Fuzzer fuzzer(seed);
    for (int step = 0; step < 4000; ++step) fuzzer.Step();
    fuzzer.CheckRounds();
    CHECK(fuzzer.refused() > 100);  // The traffic really was malformed often.
    rounds += fuzzer.rounds_started();
  }
  CHECK(rounds > 10);  // ... and valid often enough to form rounds.
}

}  // namespace
}  // namespace elrun::rdzv
