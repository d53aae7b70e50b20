// rdzv_load: many simulated rendezvous nodes in one process, for rdzv_scale_bench.py. Each node
// is one gRPC callback stream to elrun-rdzv that behaves as an elrun agent without workers:
// it answers the Challenge with a Join that proves the token, heartbeats every
// --heartbeat-ms, and joins again after each RoundEnded. Streams are spread over --channels
// channels (TCP connections).
//
// Prints one line per event on stdout, times in seconds since the process started:
//   formed ROUND SECONDS NODES        every live node has RoundStarted for ROUND
// and reads commands on stdin, one per line:
//   lose K     cancels the streams of the K nodes with the highest group ranks; prints
//              "lost K SECONDS" and then "formed" when the survivors' next round has started
//   quit       cancels every stream and exits 0
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "agent/coordinator/coordinator.h"
#include "agent/coordinator/session_auth.h"
#include "agent/net/process_setup.h"
#include "proto/rendezvous.grpc.pb.h"

namespace {

namespace v1 = elrun::rdzv::v1;
using Clock = std::chrono::steady_clock;

const Clock::time_point kStart = Clock::now();

double Seconds() { return std::chrono::duration<double>(Clock::now() - kStart).count(); }

struct Settings {
  std::string endpoint;
  std::string run_id = "scale";
  std::string token;
  int nodes = 1000;
  int min_nodes = 0;
  int channels = 8;
  int heartbeat_ms = 1000;
};

class Load;

class Node : public grpc::ClientBidiReactor<v1::AgentMessage, v1::CoordinatorMessage> {
 public:
  Node(Load* load, int index) : load_(load), index_(index) {}

  void Start(v1::Rendezvous::Stub* stub) {
    stub->async()->Session(&context_, this);
    StartRead(&in_);
    StartCall();
  }

  void Send(const v1::AgentMessage& message) {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    if (writing_) {
      queue_.push_back(message);
      return;
    }
    writing_ = true;
    out_ = message;
    StartWrite(&out_);
  }

  void Heartbeat() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!joined_ || writing_ || done_) return;  // A beat behind a pending write is not needed.
    }
    v1::AgentMessage beat;
    beat.mutable_heartbeat();
    Send(beat);
  }

  void Cancel() { context_.TryCancel(); }
  int group_rank() const { return group_rank_.load(); }

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok || queue_.empty()) return;
    out_ = queue_.front();
    queue_.pop_front();
    writing_ = true;
    StartWrite(&out_);
  }
  void OnDone(const grpc::Status&) override;

 private:
  v1::AgentMessage MakeJoin(bool first);

  Load* const load_;
  const int index_;
  grpc::ClientContext context_;
  v1::CoordinatorMessage in_;
  mutable std::mutex mu_;
  v1::AgentMessage out_;
  std::deque<v1::AgentMessage> queue_;
  bool writing_ = false;
  bool joined_ = false;
  bool done_ = false;
  std::string server_nonce_;
  std::string client_nonce_;
  std::atomic<int> group_rank_{-1};
};

class Load {
 public:
  explicit Load(Settings settings) : settings_(std::move(settings)) {
    key_ = settings_.token.empty() ? "" : elrun::rdzv::TokenKey(settings_.token);
    if (!settings_.token.empty()) run_key_ = elrun::rdzv::DeriveRunKey(settings_.token, settings_.run_id);
  }

  const Settings& settings() const { return settings_; }
  const std::string& key() const { return key_; }
  const elrun::rdzv::RunKey* run_key() const { return settings_.token.empty() ? nullptr : &run_key_; }

  void Run() {
    for (int c = 0; c < settings_.channels; ++c) {
      grpc::ChannelArguments args;
      args.SetInt("grpc.channel_id", c);  // Distinct channels: one TCP connection each.
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      args.SetMaxReceiveMessageSize(64 * 1024);
      stubs_.push_back(v1::Rendezvous::NewStub(
          grpc::CreateCustomChannel(settings_.endpoint, grpc::InsecureChannelCredentials(), args)));
    }
    for (int i = 0; i < settings_.nodes; ++i) nodes_.push_back(std::make_unique<Node>(this, i));
    for (int i = 0; i < settings_.nodes; ++i) nodes_[i]->Start(stubs_[i % stubs_.size()].get());
    std::thread beats([this] { BeatLoop(); });
    std::string command;
    while (std::getline(std::cin, command)) {
      if (command.rfind("lose ", 0) == 0) {
        Lose(std::stoi(command.substr(5)));
      } else if (command == "quit") {
        break;
      }
    }
    stopping_ = true;
    beats.join();
    for (auto& node : nodes_) node->Cancel();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait_for(lock, std::chrono::seconds(30), [this] { return finished_ == settings_.nodes; });
  }

  void Started(int round) {
    std::lock_guard<std::mutex> lock(mu_);
    int count = ++started_[round];
    if (count == settings_.nodes - lost_) {
      std::printf("formed %d %.6f %d\n", round, Seconds(), count);
      std::fflush(stdout);
    }
  }

  void Finished() {
    std::lock_guard<std::mutex> lock(mu_);
    ++finished_;
    done_cv_.notify_all();
  }

 private:
  void BeatLoop() {
    auto next = Clock::now();
    while (!stopping_) {
      next += std::chrono::milliseconds(settings_.heartbeat_ms);
      std::this_thread::sleep_until(next);  // The beat's own period, not synchronisation.
      for (auto& node : nodes_) node->Heartbeat();
    }
  }

  void Lose(int count) {
    std::vector<Node*> by_rank;
    for (auto& node : nodes_) by_rank.push_back(node.get());
    std::sort(by_rank.begin(), by_rank.end(), [](Node* a, Node* b) { return a->group_rank() > b->group_rank(); });
    {
      std::lock_guard<std::mutex> lock(mu_);
      lost_ += count;
    }
    double at = Seconds();
    for (int i = 0; i < count && i < static_cast<int>(by_rank.size()); ++i) by_rank[i]->Cancel();
    std::printf("lost %d %.6f\n", count, at);
    std::fflush(stdout);
  }

  Settings settings_;
  std::string key_;
  elrun::rdzv::RunKey run_key_;
  std::vector<std::unique_ptr<v1::Rendezvous::Stub>> stubs_;
  std::vector<std::unique_ptr<Node>> nodes_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::map<int, int> started_;  // Round -> nodes that have it.
  int lost_ = 0;
  int finished_ = 0;
};

v1::AgentMessage Node::MakeJoin(bool first) {
  const Settings& s = load_->settings();
  v1::AgentMessage message;
  v1::Join* join = message.mutable_join();
  join->set_protocol_version(elrun::rdzv::kProtocolVersion);
  join->set_run_id(s.run_id);
  join->set_node_id("load-" + std::to_string(index_));
  join->set_nproc(1);
  join->set_role("default");
  join->set_rank_hint(-1);
  join->set_master_addr("127.0.0.1");
  join->set_master_port(20000 + index_ % 40000);
  v1::JobSettings* settings = join->mutable_settings();
  settings->set_min_nodes(s.min_nodes);
  settings->set_max_nodes(s.nodes);
  settings->set_max_restarts(0);
  settings->set_last_call_timeout_ms(30000);
  settings->set_join_timeout_ms(600000);
  settings->set_heartbeat_timeout_ms(10 * s.heartbeat_ms);
  settings->set_close_timeout_ms(30000);
  if (first) {
    join->set_client_nonce(client_nonce_);
    if (!load_->key().empty()) {
      join->set_proof(elrun::rdzv::AgentProof(load_->key(), server_nonce_, client_nonce_, s.run_id, join->node_id()));
      join->set_run_key(load_->run_key()->public_key);
      join->set_run_signature(
          elrun::rdzv::SignJoin(*load_->run_key(), server_nonce_, client_nonce_, s.run_id, join->node_id()));
    }
  }
  return message;
}

void Node::OnReadDone(bool ok) {
  if (!ok) return;
  if (in_.has_challenge()) {
    server_nonce_ = in_.challenge().nonce();
    client_nonce_ = elrun::rdzv::RandomNonce();
    Send(MakeJoin(true));
    {
      std::lock_guard<std::mutex> lock(mu_);
      joined_ = true;
    }
  } else if (in_.has_round_started()) {
    group_rank_ = in_.round_started().group_rank();
    load_->Started(static_cast<int>(in_.round_started().round()));
  } else if (in_.has_round_ended()) {
    Send(MakeJoin(false));
  }
  StartRead(&in_);
}

void Node::OnDone(const grpc::Status&) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  load_->Finished();
}

}  // namespace

int main(int argc, char** argv) {
  elrun::SetUpProcess();  // As elrun does: the simulated nodes cost what real agents cost.
  Settings settings;
  CLI::App app("rdzv_load: simulated elrun nodes against one elrun-rdzv (for rdzv_scale_bench.py)");
  app.add_option("--endpoint", settings.endpoint, "elrun-rdzv HOST:PORT")->required();
  app.add_option("--run-id", settings.run_id, "the job's run id")->capture_default_str();
  app.add_option("--nodes", settings.nodes, "simulated nodes")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--min-nodes", settings.min_nodes, "the job's minimum (0: nodes)")->capture_default_str();
  app.add_option("--channels", settings.channels, "gRPC channels (TCP connections)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--heartbeat-ms", settings.heartbeat_ms, "heartbeat period")
      ->check(CLI::Range(10, 60000))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (settings.min_nodes <= 0 || settings.min_nodes > settings.nodes) settings.min_nodes = settings.nodes;
  if (const char* token = std::getenv("ELRUN_RDZV_TOKEN")) settings.token = token;
  Load load(settings);
  load.Run();
  return 0;
}
