#include "launcher/elastic_job.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/support/log.h>

#include <optional>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "agent/coordinator_server.h"
#include "agent/rendezvous_client.h"
#include "agent/session_auth.h"
#include "agent/wire_checks.h"
#include "launcher/attempt_builder.h"
#include "launcher/host_info.h"
#include "launcher/job_runtime.h"
#include "launcher/supervisor.h"

namespace elrun {
namespace {

namespace v1 = rdzv::v1;
using std::chrono::steady_clock;

const char* ReasonName(v1::RoundEnded::Reason reason) {
  switch (reason) {
    case v1::RoundEnded::NODE_LOST: return "a node was lost";
    case v1::RoundEnded::NODE_JOINED: return "a node joined";
    case v1::RoundEnded::WORKER_FAILED: return "a worker failed";
    default: return "unknown reason";
  }
}

// This node's agent: a state machine driven by the coordinator's messages, worker exits,
// signals and its own timers, all on the event loop's thread.
class ElasticAgent {
 public:
  ElasticAgent(const JobSpec& spec, const RdzvSettings& rdzv, JobRuntime& rt,
               rdzv::RendezvousClient& client, AttemptBuilder& builder, std::string master_addr)
      : spec_(spec), rdzv_(rdzv), rt_(rt), client_(client), builder_(builder),
        master_addr_(std::move(master_addr)),
        node_id_(absl::StrCat(HostName(), ":", ::getpid(), ":", RandomRunId().substr(0, 6))),
        key_(rdzv.token.empty() ? std::string() : rdzv::TokenKey(rdzv.token)) {}

  // Waits for the coordinator's Challenge, which the first Join answers.
  void Start() {
    phase_ = Phase::kJoining;
    join_deadline_ = steady_clock::now() + rdzv_.join_timeout + std::chrono::seconds(5);
  }

  void OnWorkerExit(int pid, ExitStatus status) {
    if (supervisor_) supervisor_->OnWorkerExit(pid, status);
    CheckSupervisor();
  }

  void OnSignal(int signo) {
    if (supervisor_ && !supervisor_->done()) {
      supervisor_->OnSignal(signo);
      CheckSupervisor();
    } else {
      Finish(128 + signo);
    }
  }

  void OnClientEvent() {
    for (const v1::CoordinatorMessage& message : client_.Take()) {
      if (exit_code_) break;
      if (message.has_challenge()) {
        OnChallenge(message.challenge());
        continue;
      }
      if (message.has_welcome()) {
        OnWelcome(message.welcome());
        continue;
      }
      if (!authenticated_) {  // Nothing counts from a coordinator that has not proven itself.
        Distrust("sent a message before proving it knows the token");
        break;
      }
      if (message.has_round_started()) OnRoundStarted(message.round_started());
      if (message.has_round_ended()) OnRoundEnded(message.round_ended());
      if (message.has_job_ended()) OnJobEnded(message.job_ended());
      if (message.has_waiting()) {
        spdlog::info(message.waiting().wait_listed()
                         ? "the job has its maximum of nodes; waiting for a place"
                         : "joined; waiting for the round to complete");
      }
    }
    if (std::optional<absl::Status> ended = client_.ended(); ended && !exit_code_ && !stream_lost_) {
      stream_lost_ = true;
      OnStreamEnded(*ended);
    }
  }

  std::optional<steady_clock::time_point> Deadline() const {
    std::optional<steady_clock::time_point> next;
    if (!exit_code_ && !stream_lost_ && challenged_) next = next_heartbeat_;
    if (supervisor_ && supervisor_->deadline() && (!next || *supervisor_->deadline() < *next)) {
      next = supervisor_->deadline();
    }
    if (phase_ == Phase::kJoining && join_deadline_ < next.value_or(join_deadline_)) next = join_deadline_;
    return next;
  }

  void OnDeadline() {
    auto now = steady_clock::now();
    if (supervisor_) supervisor_->OnDeadline();
    if (!stream_lost_ && challenged_ && now >= next_heartbeat_) {
      v1::AgentMessage heartbeat;
      heartbeat.mutable_heartbeat();
      client_.Write(heartbeat);
      next_heartbeat_ = now + rdzv_.heartbeat_interval;
    }
    if (phase_ == Phase::kJoining && now >= join_deadline_ && !exit_code_) {
      Report(absl::StrCat("no rendezvous round formed at ", rdzv_.Endpoint(), " within join_timeout (",
                          rdzv_.join_timeout.count() / 1000.0, " s); is the coordinator up and "
                          "have --nnodes nodes joined with --rdzv-id ", spec_.rdzv_id, "?"));
      Finish(kExitJobFailed);
    }
    CheckSupervisor();
  }

  bool done() const { return exit_code_.has_value() && (!supervisor_ || supervisor_->done()); }
  // The last error this agent printed about the rendezvous, for the launcher's error file.
  const std::string& rendezvous_error() const { return rendezvous_error_; }
  int exit_code() const { return *exit_code_; }
  const Supervisor* failed() const { return failed_.get(); }
  const std::string& end_detail() const { return end_detail_; }
  int group_rank() const { return builder_.node().group_rank; }

 private:
  enum class Phase { kJoining, kRunning, kReported, kStoppingForRound, kStoppingForEnd };

  void OnChallenge(const v1::Challenge& challenge) {
    if (challenged_ || challenge.nonce().size() != rdzv::kNonceBytes) {
      Distrust("sent a malformed or second Challenge");
      return;
    }
    challenged_ = true;
    server_nonce_ = challenge.nonce();
    client_nonce_ = rdzv::RandomNonce();
    next_heartbeat_ = steady_clock::now() + rdzv_.heartbeat_interval;
    Join();
  }

  void OnWelcome(const v1::Welcome& welcome) {
    if (!challenged_ || authenticated_) {
      Distrust("sent an unexpected Welcome");
      return;
    }
    if (!key_.empty() &&
        !rdzv::ProofEquals(welcome.proof(), rdzv::CoordinatorProof(key_, server_nonce_, client_nonce_))) {
      Distrust("could not prove it knows the token (is another process holding that port?)");
      return;
    }
    authenticated_ = true;
  }

  // Ends this node's part in the job as failed: its workers (if any) are stopped first.
  void Abandon() {
    end_code_ = kExitJobFailed;
    if (supervisor_ && !supervisor_->done()) {
      phase_ = Phase::kStoppingForEnd;
      supervisor_->Stop();
      CheckSupervisor();
    } else {
      Finish(kExitJobFailed);
    }
  }

  // The coordinator broke the protocol or failed to prove the token: trust nothing from it.
  void Distrust(const std::string& what) {
    Report(absl::StrCat("the rendezvous coordinator at ", rdzv_.Endpoint(), " ", what,
                        "; leaving the job"));
    Abandon();
  }

  void Join() {
    auto port = PickFreePort();
    if (!port.ok()) {
      Report(std::string(port.status().message()));
      Finish(kExitJobFailed);
      return;
    }
    v1::AgentMessage message;
    v1::Join* join = message.mutable_join();
    join->set_protocol_version(rdzv::kProtocolVersion);
    join->set_run_id(spec_.rdzv_id);
    join->set_node_id(node_id_);
    join->set_nproc(spec_.nproc_per_node);
    join->set_role(spec_.role);
    join->set_rank_hint(spec_.node_rank_given ? spec_.node_rank : -1);
    join->set_master_addr(master_addr_);
    join->set_master_port(*port);
    v1::JobSettings* settings = join->mutable_settings();
    settings->set_min_nodes(spec_.min_nodes);
    settings->set_max_nodes(spec_.max_nodes);
    settings->set_max_restarts(spec_.max_restarts);
    settings->set_last_call_timeout_ms(rdzv_.last_call_timeout.count());
    settings->set_join_timeout_ms(rdzv_.join_timeout.count());
    settings->set_heartbeat_timeout_ms(rdzv_.heartbeat_timeout.count());
    settings->set_close_timeout_ms(rdzv_.close_timeout.count());
    if (!authenticated_) {  // The session's first Join proves the token.
      join->set_client_nonce(client_nonce_);
      if (!key_.empty()) {
        join->set_proof(rdzv::AgentProof(key_, server_nonce_, client_nonce_, spec_.rdzv_id, node_id_));
      }
    }
    phase_ = Phase::kJoining;
    join_deadline_ = steady_clock::now() + rdzv_.join_timeout + std::chrono::seconds(5);
    client_.Write(message);  // A broken stream shows up as the client's end.
  }

  void OnRoundStarted(const v1::RoundStarted& round) {
    if (phase_ != Phase::kJoining) return;
    // Nothing from the coordinator reaches a worker's environment unchecked.
    absl::Status valid = rdzv::ValidateRoundStarted(
        round, {spec_.nproc_per_node, spec_.min_nodes, spec_.max_nodes, spec_.max_restarts, round_});
    if (!valid.ok()) {
      Report(absl::StrCat("the rendezvous coordinator at ", rdzv_.Endpoint(),
                          " sent an invalid round (", valid.message(), "); leaving the job"));
      Finish(kExitJobFailed);
      return;
    }
    NodeAssignment node{round.group_rank(),       round.group_world_size(), round.rank_offset(),
                        round.world_size(),       round.role_rank_offset(), round.role_world_size(),
                        round.master_addr(),      round.master_port()};
    round_ = round.round();
    int attempt = attempts_++;
    int restart_count = round.restart_count();
    spdlog::info("round {}: group rank {} of {}, world size {}, restart count {}, master {}:{}",
                 round_, node.group_rank, node.group_world_size, node.world_size, restart_count,
                 node.master_addr, node.master_port);
    supervisor_ = std::make_unique<Supervisor>(
        SupervisorOptions{0, spec_.shutdown_timeout}, &rt_.table(), &clock_,
        [this, node, attempt, restart_count](int, int) {
          return builder_.BuildFor(attempt, restart_count, node);
        });
    phase_ = Phase::kRunning;
    supervisor_->Start();
    CheckSupervisor();
  }

  void OnRoundEnded(const v1::RoundEnded& ended) {
    spdlog::warn("round {} ended ({}: {}); stopping the workers and rejoining", ended.round(),
                 ReasonName(ended.reason()), rdzv::EscapeForConsole(ended.detail()));
    if (phase_ == Phase::kRunning) {
      phase_ = Phase::kStoppingForRound;
      supervisor_->Stop();
      CheckSupervisor();
    } else if (phase_ == Phase::kReported) {
      Join();
    }
  }

  void OnJobEnded(const v1::JobEnded& ended) {
    end_detail_ = rdzv::EscapeForConsole(ended.detail());
    end_code_ = ended.success() ? kExitSuccess : kExitJobFailed;
    if (phase_ == Phase::kRunning || phase_ == Phase::kStoppingForRound) {
      phase_ = Phase::kStoppingForEnd;
      supervisor_->Stop();
      CheckSupervisor();
    } else if (phase_ != Phase::kStoppingForEnd) {
      Finish(end_code_);
    }
  }

  void OnStreamEnded(const absl::Status& status) {
    if (status.code() == absl::StatusCode::kUnavailable || status.code() == absl::StatusCode::kCancelled) {
      Report(absl::StrCat("lost the rendezvous coordinator at ", rdzv_.Endpoint(), ": ",
                          rdzv::EscapeForConsole(status.message())));
    } else {
      Report(absl::StrCat("the rendezvous at ", rdzv_.Endpoint(), " refused this node: ",
                          rdzv::EscapeForConsole(status.message())));
    }
    Abandon();
  }

  // Reacts to the end of the current round's worker group.
  void CheckSupervisor() {
    if (!supervisor_ || !supervisor_->done()) return;
    int code = supervisor_->exit_code();
    if (code >= 128) {
      Finish(code);
      return;
    }
    switch (phase_) {
      case Phase::kRunning: {
        v1::AgentMessage message;
        v1::WorkersEnded* ended = message.mutable_workers_ended();
        ended->set_round(round_);
        ended->set_success(code == kExitSuccess);
        if (code != kExitSuccess) {
          ended->set_failure(DescribeFirstFailure(supervisor_->failures()));
          failed_ = std::move(supervisor_);
        }
        supervisor_.reset();
        phase_ = Phase::kReported;
        if (!stream_lost_) client_.Write(message);
        break;
      }
      case Phase::kStoppingForRound:
        supervisor_.reset();
        if (!stream_lost_) Join();
        break;
      case Phase::kStoppingForEnd:
        supervisor_.reset();
        Finish(end_code_);
        break;
      default:
        break;
    }
  }

  void Finish(int code) {
    if (!exit_code_) exit_code_ = code;
  }

  // Prints one error line about the rendezvous and keeps it for the error file.
  void Report(const std::string& error) {
    rendezvous_error_ = error;
    PrintError(error);
  }

  const JobSpec& spec_;
  const RdzvSettings& rdzv_;
  JobRuntime& rt_;
  rdzv::RendezvousClient& client_;
  AttemptBuilder& builder_;
  const std::string master_addr_;
  const std::string node_id_;
  const std::string key_;  // TokenKey of the token; empty without one.
  RealClock clock_;

  Phase phase_ = Phase::kJoining;
  std::unique_ptr<Supervisor> supervisor_;  // The current round's workers.
  std::unique_ptr<Supervisor> failed_;      // The last group that failed here, for the report.
  uint64_t round_ = 0;
  int attempts_ = 0;
  int end_code_ = kExitJobFailed;
  std::string end_detail_;
  std::string rendezvous_error_;
  std::optional<int> exit_code_;
  bool stream_lost_ = false;
  bool challenged_ = false;     // The session's Challenge arrived (and the first Join left).
  bool authenticated_ = false;  // The coordinator proved the token (Welcome).
  std::string server_nonce_;
  std::string client_nonce_;
  steady_clock::time_point next_heartbeat_;
  steady_clock::time_point join_deadline_;
};

// gRPC's own log lines (e.g. a failed bind while probing for the coordinator's port) would
// clutter the user's console; show them only with LOGLEVEL=DEBUG.
void RouteGrpcLogs() {
  gpr_set_log_function([](gpr_log_func_args* args) {
    spdlog::debug("grpc: {}", args->message);
  });
}

}  // namespace

int RunElasticJob(const JobSpec& spec, const std::map<std::string, std::string>& env,
                  const std::vector<std::string>& argv_template, const RdzvSettings& rdzv) {
  RouteGrpcLogs();
  // The runtime first: it blocks the handled signals, and gRPC's threads (server, client) must
  // inherit that mask, or a SIGTERM delivered to one of them would kill elrun outright instead
  // of being forwarded. It also forks the guardian while the process has a single thread.
  ElasticAgent* agent_ptr = nullptr;
  auto runtime = JobRuntime::Create(spec, env, spec.rdzv_id, [&agent_ptr](int pid, ExitStatus status) {
    agent_ptr->OnWorkerExit(pid, status);
  });
  if (!runtime.ok()) {
    PrintError(std::string(runtime.status().message()));
    return kExitJobFailed;
  }
  JobRuntime& rt = **runtime;
  // The coordinator, embedded when the endpoint is this machine and its port is free.
  std::unique_ptr<rdzv::CoordinatorServer> server;
  bool want_host = rdzv.is_host.value_or(IsLocalHost(rdzv.host));
  if (want_host) {
    rdzv::ServerOptions options;
    options.listen = rdzv.Endpoint();
    options.token = rdzv.token;
    options.tls = {rdzv.tls_cert, rdzv.tls_key, rdzv.tls_ca};
    auto started = rdzv::CoordinatorServer::Start(options);
    if (started.ok()) {
      server = *std::move(started);
      spdlog::info("hosting the rendezvous coordinator on {}", rdzv.Endpoint());
    } else if (rdzv.is_host.value_or(false) || started.status().code() != absl::StatusCode::kAlreadyExists) {
      PrintError(absl::StrCat("cannot host the rendezvous on ", rdzv.Endpoint(), ": ",
                              started.status().message()));
      return kExitJobFailed;
    }
  }

  rdzv::ClientOptions client_options;
  client_options.endpoint = rdzv.Endpoint();
  client_options.tls = {rdzv.tls_cert, rdzv.tls_key, rdzv.tls_ca};
  client_options.connect_timeout = rdzv.join_timeout;
  client_options.silence_timeout = rdzv.heartbeat_timeout;
  auto client = rdzv::RendezvousClient::Open(client_options);
  if (!client.ok()) {
    PrintError(std::string(client.status().message()));
    return kExitJobFailed;
  }

  std::string master_addr = spec.local_addr;
  if (master_addr.empty()) {
    master_addr = LocalAddressToward(rdzv.host, rdzv.port).value_or(
        IsLocalHost(rdzv.host) ? "127.0.0.1" : HostName());
  }
  if (absl::Status s = rdzv::CheckHostOrAddress("--local-addr", master_addr); !s.ok()) {
    PrintError(std::string(s.message()));
    return kExitJobFailed;
  }

  AttemptBuilder builder(spec, argv_template, spec.rdzv_id, rt.layout(), env, PickFreePort);
  ElasticAgent agent(spec, rdzv, rt, **client, builder, master_addr);
  agent_ptr = &agent;

  absl::Status status = rt.HandleSignals([&](int signo) { agent.OnSignal(signo); });
  if (status.ok()) status = rt.loop().Add((*client)->event_fd(), [&] { agent.OnClientEvent(); });
  if (status.ok()) {
    agent.Start();
    status = rt.RunUntil([&] { return agent.done(); }, [&] { return agent.Deadline(); },
                         [&] { agent.OnDeadline(); });
  }
  rt.loop().Remove((*client)->event_fd());
  if (!status.ok()) {
    PrintError(std::string(status.message()));
    return kExitJobFailed;
  }
  int code = agent.exit_code();
  if (code == kExitJobFailed) {
    if (agent.failed() != nullptr) {
      PrintFailureReport(spec, *agent.failed(), spec.rdzv_id, agent.group_rank(), env);
    } else if (!agent.end_detail().empty()) {
      WriteLauncherErrorFile(env, "ChildFailedError", agent.end_detail());
    } else if (!agent.rendezvous_error().empty()) {
      WriteLauncherErrorFile(env, "RendezvousError", agent.rendezvous_error());
    }
    if (!agent.end_detail().empty()) PrintError(absl::StrCat("the job failed: ", agent.end_detail()));
  }
  client->reset();  // Leave the rendezvous.
  if (server) {
    // The other nodes may not have read the job's end yet: keep serving until they have all
    // left, for close_timeout at most.
    if (!server->coordinator().WaitUntilJobGone(spec.rdzv_id,
                                                std::chrono::steady_clock::now() + rdzv.close_timeout)) {
      spdlog::warn("nodes of run {} still connected {} s after the job ended; stopping the "
                   "coordinator", spec.rdzv_id, rdzv.close_timeout.count() / 1000.0);
    }
    server->Shutdown();
  }
  return code;
}

}  // namespace elrun
