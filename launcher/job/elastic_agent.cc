#include "launcher/job/elastic_agent.h"

#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "agent/coordinator/protocol_version.h"
#include "agent/coordinator/session_auth.h"
#include "agent/coordinator/wire_checks.h"
#include "launcher/report/console.h"
#include "launcher/report/failure_report.h"
#include "launcher/spec/json_value.h"

namespace elrun {
namespace {

namespace v1 = rdzv::v1;

const char* ReasonName(v1::RoundEnded::Reason reason) {
  switch (reason) {
    case v1::RoundEnded::NODE_LOST: return "a node was lost";
    case v1::RoundEnded::NODE_JOINED: return "a node joined";
    case v1::RoundEnded::WORKER_FAILED: return "a worker failed";
    default: return "unknown reason";
  }
}

std::optional<rdzv::RunKey> RunKeyOf(const RdzvSettings& rdzv, const std::string& run_id) {
  const std::string& secret = rdzv.run_token.empty() ? rdzv.token : rdzv.run_token;
  if (secret.empty()) return std::nullopt;
  return rdzv::DeriveRunKey(secret, run_id);
}

}  // namespace

ElasticAgent::ElasticAgent(const JobSpec& spec, const RdzvSettings& rdzv, ProcessTable& table, const Clock& clock,
                           RendezvousSession& session, AttemptBuilder& builder, std::string master_addr,
                           std::string node_id, PortPicker pick_port)
    : spec_(spec),
      rdzv_(rdzv),
      table_(table),
      clock_(clock),
      session_(session),
      builder_(builder),
      master_addr_(std::move(master_addr)),
      node_id_(std::move(node_id)),
      key_(rdzv.token.empty() ? std::string() : rdzv::TokenKey(rdzv.token)),
      pick_port_(std::move(pick_port)) {}

ElasticAgent::~ElasticAgent() = default;

// Waits for the coordinator's Challenge, which the first Join answers.
void ElasticAgent::Start() {
  phase_ = Phase::kJoining;
  join_deadline_ = JoinDeadline();
}

void ElasticAgent::OnWorkerSignalled(int pid, const std::string& why) {
  if (supervisor_) supervisor_->NoteSignalled(pid, why);
}

void ElasticAgent::OnWorkerExit(int pid, ExitStatus status) {
  if (supervisor_) supervisor_->OnWorkerExit(pid, status);
  CheckSupervisor();
}

void ElasticAgent::OnSignal(int signo) {
  if (supervisor_ && !supervisor_->done()) {
    supervisor_->OnSignal(signo);
    CheckSupervisor();
  } else {
    Finish(128 + signo);
  }
}

void ElasticAgent::OnMessage(const v1::CoordinatorMessage& message) {
  if (exit_code_ || stream_lost_) return;
  if (message.has_challenge()) return OnChallenge(message.challenge());
  if (message.has_welcome()) return OnWelcome(message.welcome());
  if (!authenticated_) {  // Nothing counts from a coordinator that has not proven itself.
    return Distrust("sent a message before proving it knows the token");
  }
  if (message.has_round_started()) OnRoundStarted(message.round_started());
  if (message.has_round_ended()) OnRoundEnded(message.round_ended());
  // Only a pace of every rank of the round: a median of the first few to report would judge
  // the others against a part of the job.
  if (message.has_job_pace() && on_job_pace_ && message.job_pace().round() == round_ &&
      message.job_pace().ranks() == builder_.node().world_size) {
    on_job_pace_(message.job_pace());
  }
  if (message.has_job_ended()) OnJobEnded(message.job_ended());
  if (message.has_waiting()) {
    spdlog::info(message.waiting().wait_listed() ? "the job has its maximum of nodes; waiting for a place"
                                                 : "joined; waiting for the round to complete");
    if (message.waiting().job_running() && !lost_cause_.empty()) {
      // Rejoined a job that lives on: from here on, as any Join (a place may take a while).
      lost_cause_.clear();
      join_deadline_ = JoinDeadline();
    }
  }
}

void ElasticAgent::OnSessionEnded(const absl::Status& status) {
  if (exit_code_ || stream_lost_) return;
  stream_lost_ = true;
  OnStreamEnded(status);
}

void ElasticAgent::OnNewSession(std::string node_id) {
  wants_session_ = false;
  stream_lost_ = false;
  challenged_ = false;
  authenticated_ = false;
  node_id_ = std::move(node_id);
  phase_ = Phase::kJoining;
  join_deadline_ = rejoin_deadline_;
}

void ElasticAgent::OnNewSessionFailed(const absl::Status& status) {
  wants_session_ = false;
  ReportLost(absl::StrCat("could not rejoin: ", rdzv::EscapeForConsole(status.message())));
  Finish(kExitJobFailed);
}

// One error line: the session that was lost, and why no new one took its place.
void ElasticAgent::ReportLost(const std::string& then) {
  Report(absl::StrCat("lost the rendezvous coordinator at ", rdzv_.Endpoint(), ": ", lost_cause_, "; ", then));
}

std::chrono::steady_clock::time_point ElasticAgent::JoinDeadline() const {
  return clock_.SteadyNow() + rdzv_.join_timeout + std::chrono::seconds(5);
}

std::optional<std::chrono::steady_clock::time_point> ElasticAgent::Deadline() const {
  std::optional<std::chrono::steady_clock::time_point> next;
  if (!exit_code_ && !stream_lost_ && challenged_) next = next_heartbeat_;
  if (supervisor_ && supervisor_->deadline() && (!next || *supervisor_->deadline() < *next)) {
    next = supervisor_->deadline();
  }
  if (phase_ == Phase::kJoining && join_deadline_ < next.value_or(join_deadline_)) next = join_deadline_;
  return next;
}

void ElasticAgent::OnDeadline() {
  auto now = clock_.SteadyNow();
  if (supervisor_) supervisor_->OnDeadline();
  if (!stream_lost_ && challenged_ && now >= next_heartbeat_) {
    v1::AgentMessage heartbeat;
    heartbeat.mutable_heartbeat();
    session_.Send(heartbeat);
    next_heartbeat_ = now + rdzv_.heartbeat_interval;
    if ((paces_ || progress_) && phase_ == Phase::kRunning && now >= next_pace_) {
      next_pace_ = now + kPaceInterval;
      if (paces_) {
        v1::AgentMessage message;
        v1::Paces* paces = message.mutable_paces();
        paces->set_round(round_);
        for (v1::RankPace& pace : paces_()) {
          // Only this round's ranks: a worker kept alive across rounds may still be known by
          // its last round's rank until the watchdog's next look.
          if (pace.rank() < node_.rank_offset || pace.rank() >= node_.rank_offset + spec_.nproc_per_node) continue;
          *paces->add_ranks() = std::move(pace);
        }
        if (paces->ranks_size() > 0) session_.Send(message);
      }
      if (progress_) {
        v1::AgentMessage message;
        *message.mutable_progress() = progress_();
        message.mutable_progress()->set_round(round_);
        session_.Send(message);
      }
    }
  }
  if (phase_ == Phase::kJoining && now >= join_deadline_ && !exit_code_ && !lost_cause_.empty()) {
    ReportLost(
        absl::StrCat("could not rejoin the job within rejoin_timeout (", RejoinTimeout().count() / 1000.0, " s)"));
    Finish(kExitJobFailed);
  }
  if (phase_ == Phase::kJoining && now >= join_deadline_ && !exit_code_) {
    Report(absl::StrCat("no rendezvous round formed at ", rdzv_.Endpoint(), " within join_timeout (",
                        rdzv_.join_timeout.count() / 1000.0,
                        " s); is the coordinator up and "
                        "have --nnodes nodes joined with --rdzv-id ",
                        spec_.rdzv_id, "?"));
    Finish(kExitJobFailed);
  }
  CheckSupervisor();
}

void ElasticAgent::OnChallenge(const v1::Challenge& challenge) {
  if (challenged_ || challenge.nonce().size() != rdzv::kNonceBytes) {
    Distrust("sent a malformed or second Challenge");
    return;
  }
  challenged_ = true;
  server_nonce_ = challenge.nonce();
  client_nonce_ = rdzv::RandomNonce();
  next_heartbeat_ = clock_.SteadyNow() + rdzv_.heartbeat_interval;
  Join();
}

void ElasticAgent::OnWelcome(const v1::Welcome& welcome) {
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
  const std::string& incarnation = welcome.incarnation();
  if (incarnation.size() > rdzv::kNonceBytes) {
    Distrust("sent an oversized Welcome");
    return;
  }
  if (!incarnation_.empty() && !incarnation.empty() && incarnation != incarnation_) {
    // A rejoin found the coordinator restarted (a supervisor started it again): what it knew of
    // the job died with it, so its rounds count from 1 again, and so does the restart budget.
    spdlog::warn(
        "the rendezvous coordinator at {} restarted since this node last saw it: the job's rounds and restart "
        "count begin anew (its workers resume from their checkpoint)",
        rdzv_.Endpoint());
    Record("coordinator_restarted", {});
    round_ = 0;
  }
  if (!incarnation.empty()) incarnation_ = incarnation;
}

std::chrono::milliseconds ElasticAgent::RejoinTimeout() const {
  return rdzv_.rejoin_timeout.value_or(rdzv_.heartbeat_timeout);
}

// Ends this node's part in the job as failed: its workers (if any) are stopped first.
void ElasticAgent::Abandon() {
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
void ElasticAgent::Distrust(const std::string& what) {
  Report(absl::StrCat("the rendezvous coordinator at ", rdzv_.Endpoint(), " ", what, "; leaving the job"));
  Abandon();
}

void ElasticAgent::Join() {
  auto port = pick_port_();
  if (!port.ok()) {
    Report(std::string(port.status().message()));
    Finish(kExitJobFailed);
    return;
  }
  held_port_ = std::move(*port);  // The previous round's port goes back.
  v1::AgentMessage message;
  v1::Join* join = message.mutable_join();
  join->set_protocol_version(rdzv::kProtocolVersion);
  join->set_run_id(spec_.rdzv_id);
  join->set_node_id(node_id_);
  join->set_nproc(spec_.nproc_per_node);
  join->set_role(spec_.role);
  join->set_rank_hint(spec_.node_rank_given ? spec_.node_rank : -1);
  join->set_master_addr(master_addr_);
  join->set_master_port(held_port_->port());
  join->set_holds_survivors(supervisor_ != nullptr && supervisor_->held());
  v1::JobSettings* settings = join->mutable_settings();
  settings->set_min_nodes(spec_.min_nodes);
  settings->set_max_nodes(spec_.max_nodes);
  settings->set_max_restarts(spec_.max_restarts);
  settings->set_last_call_timeout_ms(rdzv_.last_call_timeout.count());
  settings->set_join_timeout_ms(rdzv_.join_timeout.count());
  settings->set_heartbeat_timeout_ms(rdzv_.heartbeat_timeout.count());
  settings->set_close_timeout_ms(rdzv_.close_timeout.count());
  settings->set_keep_survivors(spec_.keep_survivors);
  if (!authenticated_) {  // The session's first Join proves the token.
    join->set_client_nonce(client_nonce_);
    if (!key_.empty()) {
      join->set_proof(rdzv::AgentProof(key_, server_nonce_, client_nonce_, spec_.rdzv_id, node_id_));
    }
    // The run's own credential: its run_token, else its token (session_auth.h).
    if (std::optional<rdzv::RunKey> run_key = RunKeyOf(rdzv_, spec_.rdzv_id)) {
      join->set_run_key(run_key->public_key);
      join->set_run_signature(rdzv::SignJoin(*run_key, server_nonce_, client_nonce_, spec_.rdzv_id, node_id_));
    }
  }
  phase_ = Phase::kJoining;
  // Rejoining after a lost session: a round, or word that the job runs on, is due by the end of
  // the time to rejoin (the job may have ended meanwhile and its run id begun anew).
  join_deadline_ = lost_cause_.empty() ? JoinDeadline() : rejoin_deadline_;
  Record("join", {{"round", json::Number(static_cast<double>(round_))},
                  {"holds_survivors", json::Bool(join->holds_survivors())}});
  session_.Send(message);  // A broken stream shows up as the client's end.
}

void ElasticAgent::OnRoundStarted(const v1::RoundStarted& round) {
  if (phase_ != Phase::kJoining) return;
  // Nothing from the coordinator reaches a worker's environment unchecked.
  absl::Status valid = rdzv::ValidateRoundStarted(
      round, {spec_.nproc_per_node, spec_.min_nodes, spec_.max_nodes, spec_.max_restarts, round_});
  if (!valid.ok()) {
    Report(absl::StrCat("the rendezvous coordinator at ", rdzv_.Endpoint(), " sent an invalid round (", valid.message(),
                        "); leaving the job"));
    Finish(kExitJobFailed);
    return;
  }
  lost_cause_.clear();  // Rejoined, if the last session was lost.
  node_ = NodeAssignment{round.group_rank(),       round.group_world_size(), round.rank_offset(), round.world_size(),
                         round.role_rank_offset(), round.role_world_size(),  round.master_addr(), round.master_port()};
  round_ = round.round();
  int attempt = attempts_++;
  int restart_count = round.restart_count();
  spdlog::info("round {}: group rank {} of {}, world size {}, restart count {}, master {}:{}{}", round_,
               node_.group_rank, node_.group_world_size, node_.world_size, restart_count, node_.master_addr,
               node_.master_port, round.keep_survivors() ? "; regrouping the workers kept alive" : "");
  Record("round", {{"round", json::Number(static_cast<double>(round_))},
                   {"group_rank", json::Number(node_.group_rank)},
                   {"groups", json::Number(node_.group_world_size)},
                   {"world", json::Number(node_.world_size)},
                   {"rank_offset", json::Number(node_.rank_offset)},
                   {"nproc", json::Number(spec_.nproc_per_node)},
                   {"restarts", json::Number(restart_count)},
                   {"master", json::Text(absl::StrCat(node_.master_addr, ":", node_.master_port))},
                   {"keep", json::Bool(round.keep_survivors())},
                   {"coordinator", json::Text(absl::BytesToHexString(incarnation_.substr(0, 8)))}});
  if (supervisor_ && supervisor_->held()) {
    if (round.keep_survivors()) {
      phase_ = Phase::kRunning;
      supervisor_round_ = round_;
      Record("regrouped", {{"round", json::Number(static_cast<double>(round_))}, {"attempt", json::Number(attempt)}});
      supervisor_->Regroup(attempt, restart_count);
      CheckSupervisor();
      return;
    }
    spdlog::warn("round {} does not keep this node's workers alive: stopping them and starting afresh", round_);
    supervisor_->Stop();
  }
  if (supervisor_ && !supervisor_->done()) {  // Kept workers, now stopping: the new ones start after.
    pending_start_ = {attempt, restart_count, round.keep_survivors()};
    phase_ = Phase::kStoppingForStart;
    CheckSupervisor();
    return;
  }
  if (supervisor_ && supervisor_->exit_code() == kExitJobFailed) failed_ = std::move(supervisor_);
  StartWorkers(attempt, restart_count, round.keep_survivors());
}

void ElasticAgent::StartWorkers(int attempt, int restart_count, bool join_live) {
  const bool keep = spec_.keep_survivors && add_control_ && regroup_;
  supervisor_ = std::make_unique<Supervisor>(
      SupervisorOptions{0, spec_.shutdown_timeout, keep, /*hold_survivors=*/keep}, &table_, &clock_,
      [this](int attempt, int restart_count) -> absl::StatusOr<std::vector<WorkerLaunch>> {
        auto launches = builder_.BuildFor(attempt, restart_count, node_);
        if (!launches.ok() || !add_control_) return launches;
        if (absl::Status added = add_control_(*launches, attempt); !added.ok()) return added;
        return launches;
      });
  if (keep) {
    supervisor_->SetRegrouper(regroup_);
    if (standby_.take) supervisor_->SetStandby(standby_);
  }
  if (on_fault_) {
    supervisor_->OnFailure(
        [this](const WorkerFailure& failure) { on_fault_("worker failed", DescribeFirstFailure({failure})); });
  }
  phase_ = Phase::kRunning;
  supervisor_round_ = round_;
  gone_recorded_ = false;
  Record("workers_started", {{"round", json::Number(static_cast<double>(round_))}, {"attempt", json::Number(attempt)}});
  supervisor_->Start(attempt, restart_count, join_live && keep);
  CheckSupervisor();
}

void ElasticAgent::OnRoundEnded(const v1::RoundEnded& ended) {
  spdlog::warn("round {} ended ({}: {}); stopping the workers and rejoining", ended.round(), ReasonName(ended.reason()),
               rdzv::EscapeForConsole(ended.detail()));
  Record("round_ended", {{"round", json::Number(static_cast<double>(ended.round()))},
                         {"reason", json::Text(ReasonName(ended.reason()))}});
  if (on_fault_) {
    on_fault_("new round", absl::StrCat("round ", ended.round(), " ended: ", ReasonName(ended.reason()), ": ",
                                        rdzv::EscapeForConsole(ended.detail())));
  }
  if (phase_ == Phase::kRunning) {
    if (supervisor_->Hold()) {  // --keep-survivors: every worker here can regroup in place.
      spdlog::info("keeping this node's {} worker{} alive to regroup in the next round", supervisor_->launches().size(),
                   supervisor_->launches().size() == 1 ? "" : "s");
      Join();
      return;
    }
    phase_ = Phase::kStoppingForRound;
    supervisor_->Stop();
    CheckSupervisor();
  } else if (phase_ == Phase::kReported) {
    Join();
  }
}

void ElasticAgent::OnJobEnded(const v1::JobEnded& ended) {
  end_detail_ = rdzv::EscapeForConsole(ended.detail());
  end_code_ = ended.success() ? kExitSuccess : kExitJobFailed;
  Record("job_ended", {{"success", json::Bool(ended.success())}});
  if (supervisor_ && !supervisor_->done()) {  // Running, stopping, or kept for the next round.
    phase_ = Phase::kStoppingForEnd;
    supervisor_->Stop();
    CheckSupervisor();
  } else if (phase_ != Phase::kStoppingForEnd) {
    Finish(end_code_);
  }
}

void ElasticAgent::OnStreamEnded(const absl::Status& status) {
  const bool lost = status.code() == absl::StatusCode::kUnavailable || status.code() == absl::StatusCode::kCancelled;
  const std::string why = rdzv::EscapeForConsole(status.message());
  if (lost) Record("coordinator_lost", {{"why", json::Text(why)}});
  // A session that proved itself and then went away: rejoin, unless the job is ending or the
  // time to rejoin is over (a new session that could not connect ends here too).
  const auto now = clock_.SteadyNow();
  if (lost && (authenticated_ || !lost_cause_.empty()) && phase_ != Phase::kStoppingForEnd &&
      RejoinTimeout().count() > 0) {
    if (lost_cause_.empty()) {
      lost_cause_ = why;
      rejoin_deadline_ = now + RejoinTimeout();
    }
    if (now < rejoin_deadline_) {
      spdlog::warn("lost the rendezvous coordinator at {}: {}; {} to rejoin the job (for up to {} s)", rdzv_.Endpoint(),
                   why, supervisor_ && !supervisor_->done() ? "stopping this node's workers" : "trying",
                   std::chrono::duration<double>(rejoin_deadline_ - now).count());
      if (supervisor_ && !supervisor_->done()) {
        phase_ = Phase::kStoppingForRejoin;
        supervisor_->Stop();
        CheckSupervisor();
      } else {
        if (supervisor_ && supervisor_->exit_code() == kExitJobFailed) failed_ = std::move(supervisor_);
        supervisor_.reset();
        wants_session_ = true;
      }
      return;
    }
  }
  if (lost && !lost_cause_.empty()) {
    ReportLost(absl::StrCat("could not rejoin: ", why));
  } else if (lost) {
    Report(absl::StrCat("lost the rendezvous coordinator at ", rdzv_.Endpoint(), ": ", why));
  } else {
    Report(absl::StrCat("the rendezvous at ", rdzv_.Endpoint(),
                        " refused this node: ", rdzv::EscapeForConsole(status.message())));
  }
  Abandon();
}

// Reacts to the end of the current round's worker group.
void ElasticAgent::CheckSupervisor() {
  if (supervisor_ && supervisor_->held() && phase_ == Phase::kRunning) {
    // A worker here failed and the others are kept for the next round: the coordinator is told
    // of the failure as when the group ends.
    v1::AgentMessage message;
    v1::WorkersEnded* ended = message.mutable_workers_ended();
    ended->set_round(round_);
    ended->set_success(false);
    ended->set_failure(DescribeFirstFailure(supervisor_->failures()));
    phase_ = Phase::kReported;
    if (!stream_lost_) session_.Send(message);
    return;
  }
  if (!supervisor_ || !supervisor_->done()) return;
  RecordWorkersGone();
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
      Record("workers_ended",
             {{"round", json::Number(static_cast<double>(round_))}, {"success", json::Bool(code == kExitSuccess)}});
      if (code != kExitSuccess) {
        ended->set_failure(DescribeFirstFailure(supervisor_->failures()));
        failed_ = std::move(supervisor_);
      }
      supervisor_.reset();
      phase_ = Phase::kReported;
      if (!stream_lost_) session_.Send(message);
      break;
    }
    case Phase::kStoppingForRound:
      supervisor_.reset();
      if (!stream_lost_) Join();
      break;
    case Phase::kStoppingForStart:
      if (code == kExitJobFailed) failed_ = std::move(supervisor_);
      supervisor_.reset();
      StartWorkers(pending_start_.attempt, pending_start_.restart_count, pending_start_.join_live);
      break;
    case Phase::kStoppingForEnd:
      if (code == kExitJobFailed) failed_ = std::move(supervisor_);
      supervisor_.reset();
      Finish(end_code_);
      break;
    case Phase::kStoppingForRejoin:
      if (code == kExitJobFailed) failed_ = std::move(supervisor_);
      supervisor_.reset();
      wants_session_ = true;
      break;
    default: break;
  }
}

void ElasticAgent::Finish(int code) {
  if (exit_code_) return;
  exit_code_ = code;
  Record("left", {{"exit_code", json::Number(code)}});
}

void ElasticAgent::Record(const std::string& event, const RoundHistory::Fields& fields) {
  if (history_ != nullptr) history_->Record(event, fields);
}

void ElasticAgent::RecordWorkersGone() {
  if (gone_recorded_) return;
  gone_recorded_ = true;
  Record("workers_gone", {{"round", json::Number(static_cast<double>(supervisor_round_))}});
}

// Prints one error line about the rendezvous and keeps it for the error file.
void ElasticAgent::Report(const std::string& error) {
  rendezvous_error_ = error;
  PrintError(error);
}

}  // namespace elrun
