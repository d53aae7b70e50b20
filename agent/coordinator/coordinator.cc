#include "agent/coordinator/coordinator.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "agent/coordinator/group_ranks.h"
#include "agent/coordinator/session_auth.h"
#include "agent/coordinator/wire_checks.h"

namespace elrun::rdzv {
namespace {

std::chrono::milliseconds Ms(int64_t ms) { return std::chrono::milliseconds(ms); }

}  // namespace

Coordinator::Coordinator(Options options)
    : first_join_timeout_(options.first_join_timeout),
      heartbeats_(options.heartbeats),
      key_(options.token.empty() ? std::string() : TokenKey(options.token)),
      token_(options.require_run_token ? options.token : std::string()),
      require_run_token_(options.require_run_token),
      incarnation_(std::move(options.incarnation)),
      nonce_(options.nonce ? std::move(options.nonce) : [](SessionId) { return RandomNonce(); }) {}

void Coordinator::OnConnect(SessionId id, SessionSink* sink, TimePoint now) {
  absl::MutexLock lock(&mu_);
  Session& session = sessions_[id] = Session{sink, "", now, false, nonce_(id), false};
  unjoined_.insert({now, id});
  v1::CoordinatorMessage challenge;
  challenge.mutable_challenge()->set_nonce(session.nonce);
  Send(id, challenge);
}

absl::Status Coordinator::VerifyProof(const Session& session, const v1::Join& join,
                                      std::optional<bool> signature_valid) const {
  if (!key_.empty()) {
    if (join.proof().empty()) {
      return absl::UnauthenticatedError(
          "this coordinator requires a token (--rdzv-conf token=... or ELRUN_RDZV_TOKEN)");
    }
    std::string expected = AgentProof(key_, session.nonce, join.client_nonce(), join.run_id(), join.node_id());
    if (join.client_nonce().size() != kNonceBytes || !ProofEquals(join.proof(), expected)) {
      return absl::UnauthenticatedError("wrong rendezvous token");
    }
  }
  if (!join.run_key().empty() &&
      (join.client_nonce().size() != kNonceBytes ||
       !(signature_valid ? *signature_valid
                         : VerifyJoinSignature(join.run_key(), join.run_signature(), session.nonce, join.client_nonce(),
                                               join.run_id(), join.node_id())))) {
    return absl::UnauthenticatedError("the Join's run key signature does not verify");
  }
  return absl::OkStatus();
}

void Coordinator::Welcome(SessionId id, Session& session, const v1::Join& join) {
  session.authenticated = true;
  v1::CoordinatorMessage welcome;
  if (!key_.empty()) {
    welcome.mutable_welcome()->set_proof(CoordinatorProof(key_, session.nonce, join.client_nonce()));
  } else {
    welcome.mutable_welcome();
  }
  if (!incarnation_.empty()) welcome.mutable_welcome()->set_incarnation(incarnation_);
  Send(id, welcome);
}

absl::Status Coordinator::OnMessage(SessionId id, const v1::AgentMessage& message, TimePoint now) {
  // A first Join's run key signature, the costliest check (an Ed25519 verification), is
  // verified before taking the lock, so that the many sessions of a job's start verify on
  // every thread at once. A session's nonce never changes, and its messages come one at a time.
  std::optional<bool> signature_valid;
  if (message.has_join() && !message.join().run_key().empty()) {
    std::string nonce;
    {
      absl::MutexLock lock(&mu_);
      auto session = sessions_.find(id);
      if (session != sessions_.end() && !session->second.authenticated) nonce = session->second.nonce;
    }
    const v1::Join& join = message.join();
    if (!nonce.empty()) {
      signature_valid = VerifyJoinSignature(join.run_key(), join.run_signature(), nonce, join.client_nonce(),
                                            join.run_id(), join.node_id());
    }
  }
  absl::MutexLock lock(&mu_);
  absl::Status status = HandleMessage(id, message, now, signature_valid);
  if (!status.ok()) {
    ++counters_.refused[absl::AsciiStrToLower(absl::StatusCodeToString(status.code()))];
  }
  return status;
}

absl::Status Coordinator::HandleMessage(SessionId id, const v1::AgentMessage& message, TimePoint now,
                                        std::optional<bool> signature_valid) {
  auto session = sessions_.find(id);
  if (session == sessions_.end()) return absl::NotFoundError("unknown session");
  if (message.has_join()) return HandleJoin(id, session->second, message.join(), now, signature_valid);

  Job* job = FindJob(session->second.run_id);
  if (job == nullptr || job->nodes.count(id) == 0) {
    return absl::FailedPreconditionError("the first message of a session must be a Join");
  }
  Node& node = job->nodes.at(id);
  node.last_seen = now;
  if (message.has_heartbeat()) return absl::OkStatus();
  if (message.has_workers_ended()) return HandleWorkersEnded(*job, node, message.workers_ended());
  if (message.has_paces()) return HandlePaces(id, *job, node, message.paces());
  if (message.has_progress()) return HandleProgress(*job, node, message.progress());
  return absl::InvalidArgumentError("empty message");
}

absl::Status Coordinator::HandleJoin(SessionId id, Session& session, const v1::Join& join, TimePoint now,
                                     std::optional<bool> signature_valid) {
  // The proof before anything else (an agent of another version is told that instead), so
  // that a peer without the token learns nothing from the checks below.
  if (!session.authenticated && join.protocol_version() == kProtocolVersion) {
    absl::Status proven = VerifyProof(session, join, signature_valid);
    if (!proven.ok()) return proven;
  }
  absl::Status valid = ValidateJoin(join);
  if (!valid.ok()) return valid;
  // The run key is proven once per session, by its first Join.
  const std::string& run_key = session.authenticated ? session.run_key : join.run_key();
  if (!session.run_id.empty() && session.run_id != join.run_id()) {
    return absl::PermissionDeniedError(
        absl::StrCat("this session belongs to run ", session.run_id, ", not ", join.run_id()));
  }
  Job* job = FindJob(join.run_id());
  if (job == nullptr && require_run_token_ &&
      (run_key.empty() || (!token_.empty() && run_key == DeriveRunKey(token_, join.run_id()).public_key))) {
    return absl::PermissionDeniedError(absl::StrCat(
        "run ", join.run_id(), " has no credential of its own, and this coordinator requires one for every run ",
        "(run_token_file=PATH or ELRUN_RUN_TOKEN on every node)"));
  }
  if (job == nullptr) {
    Job fresh;
    fresh.run_id = join.run_id();
    fresh.settings = join.settings();
    fresh.gathering_since = now;
    fresh.run_key = run_key;
    fresh.seen_floor = now;
    job = &jobs_.emplace(join.run_id(), std::move(fresh)).first->second;
  } else if (job->run_key != run_key) {
    return absl::PermissionDeniedError(absl::StrCat(
        "run ", join.run_id(), " is bound to ", job->run_key.empty() ? "no run credential" : "another run credential",
        " by its first node; this node has ", run_key.empty() ? "none" : "a different one",
        " (every node of a run needs the same run_token, or token when there is no run_token)"));
  } else if (std::string diff = SettingsDiff(job->settings, join.settings()); !diff.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("run ", join.run_id(), ": this node has ", diff, "; every node must use the same settings"));
  }
  if (job->phase == Phase::kDone) {
    return absl::FailedPreconditionError(absl::StrCat("run ", join.run_id(), " has already ended"));
  }
  auto same_id = job->node_ids.find(join.node_id());
  if (same_id != job->node_ids.end() && same_id->second != id) {
    return absl::AlreadyExistsError(absl::StrCat("node ", join.node_id(), " is already in run ", join.run_id()));
  }

  auto existing = job->nodes.find(id);
  if (existing != job->nodes.end() && existing->second.state != NodeState::kStopping) {
    return absl::FailedPreconditionError("already joined; Join again only after RoundEnded");
  }
  // Accepted: the Welcome goes before anything else this Join causes.
  if (!session.authenticated) {
    session.run_key = run_key;
    Welcome(id, session, join);
  }
  session.run_id = join.run_id();
  unjoined_.erase({session.opened, id});
  Node& node = job->nodes[id];
  if (existing == job->nodes.end()) {
    node.session = id;
    node.node_id = join.node_id();
    node.join_order = job->next_join_order++;
    job->node_ids[node.node_id] = id;
    ++job->counts[static_cast<int>(NodeState::kPending)];  // A new Node starts pending.
  }
  node.nproc = join.nproc();
  node.role = join.role();
  node.rank_hint = join.rank_hint();
  node.master_addr = join.master_addr();
  node.master_port = join.master_port();
  // Only a node rejoining after the round it ran in ended can hold survivors of it.
  node.holds_survivors = join.holds_survivors() && existing != job->nodes.end() && job->settings.keep_survivors();
  node.last_seen = now;
  node.succeeded = false;

  if (job->phase == Phase::kRunning) {
    // A newcomer while the job runs: scale up if there is room, else wait for a place. A round
    // ends for a scale-up at most once per last call, so that a node that joins and leaves
    // over and over cannot keep the job restarting.
    if (Count(*job, NodeState::kActive) < job->settings.max_nodes()) {
      SetState(*job, node, NodeState::kPending);
      TimePoint due = job->round_started_at + Ms(job->settings.last_call_timeout_ms());
      if (now >= due) {
        EndRound(*job, v1::RoundEnded::NODE_JOINED, absl::StrCat("node ", node.node_id, " joined"), now);
      } else {
        job->scale_up_at = due;
        v1::CoordinatorMessage waiting;
        waiting.mutable_waiting()->set_nodes_joined(Count(*job, NodeState::kPending));
        waiting.mutable_waiting()->set_job_running(true);
        Send(id, waiting);
      }
    } else {
      SetState(*job, node, NodeState::kWaitListed);
      v1::CoordinatorMessage waiting;
      waiting.mutable_waiting()->set_wait_listed(true);
      waiting.mutable_waiting()->set_job_running(true);
      Send(id, waiting);
    }
    return absl::OkStatus();
  }
  SetState(*job, node, NodeState::kPending);
  MaybeCompleteRound(*job, now);
  if (job->phase == Phase::kGathering && node.state == NodeState::kPending) {
    v1::CoordinatorMessage waiting;
    waiting.mutable_waiting()->set_nodes_joined(Count(*job, NodeState::kPending));
    Send(id, waiting);
  }
  return absl::OkStatus();
}

absl::Status Coordinator::HandleProgress(Job& job, Node& node, const v1::Progress& progress) {
  // Only shown, never acted on; still checked, as everything from the network.
  const bool finite =
      std::isfinite(progress.goodput()) && std::isfinite(progress.lost_s()) && std::isfinite(progress.wall_s());
  if (!finite || !(progress.goodput() == -1 || (progress.goodput() >= 0 && progress.goodput() <= 1)) ||
      progress.step() < -1 || progress.step() > (int64_t{1} << 53) || progress.lost_s() < 0 || progress.wall_s() < 0 ||
      progress.lost_s() > 1e9 || progress.wall_s() > 1e9 || progress.faults() < 0 || progress.faults() > 1000000) {
    return absl::InvalidArgumentError("progress outside its ranges");
  }
  if (progress.round() > job.round) return absl::InvalidArgumentError("progress about a round not started");
  node.progress = progress;
  return absl::OkStatus();
}

absl::Status Coordinator::HandlePaces(SessionId id, Job& job, Node& node, const v1::Paces& paces) {
  if (job.phase != Phase::kRunning || node.state != NodeState::kActive || paces.round() != job.round) {
    return absl::OkStatus();  // About a round that is over: nothing to judge.
  }
  if (paces.ranks_size() > node.nproc) {
    return absl::InvalidArgumentError(
        absl::StrCat("paces of ", paces.ranks_size(), " ranks from a node of ", node.nproc));
  }
  for (const v1::RankPace& pace : paces.ranks()) {
    if (pace.rank() < node.rank_offset || pace.rank() >= node.rank_offset + node.nproc) {
      return absl::InvalidArgumentError(absl::StrCat("pace of rank ", pace.rank(), ", not a rank of this node"));
    }
    if (!(pace.median_step_ms() > 0 && pace.median_step_ms() < 1e9)) {
      return absl::InvalidArgumentError("pace outside (0, 1e9) ms");
    }
    if (pace.host().size() > 255) return absl::InvalidArgumentError("pace host over 255 bytes");
  }
  node.paces.assign(paces.ranks().begin(), paces.ranks().end());
  // The job's median over every active node's last report: O(ranks) per report, which comes
  // every few seconds per node and only with --straggler-factor.
  std::vector<const v1::RankPace*> all;
  for (const auto& [other_id, other] : job.nodes) {
    if (other.state != NodeState::kActive) continue;
    for (const v1::RankPace& pace : other.paces) all.push_back(&pace);
  }
  if (all.empty()) return absl::OkStatus();
  std::sort(all.begin(), all.end(),
            [](const v1::RankPace* a, const v1::RankPace* b) { return a->median_step_ms() > b->median_step_ms(); });
  const size_t n = all.size();
  v1::CoordinatorMessage answer;
  v1::JobPace* pace = answer.mutable_job_pace();
  pace->set_round(job.round);
  pace->set_median_step_ms(n % 2 ? all[n / 2]->median_step_ms()
                                 : (all[n / 2 - 1]->median_step_ms() + all[n / 2]->median_step_ms()) / 2);
  pace->set_ranks(static_cast<int>(n));
  for (size_t i = 0; i < n && i < 3; ++i) *pace->add_slowest() = *all[i];
  Send(id, answer);
  return absl::OkStatus();
}

absl::Status Coordinator::HandleWorkersEnded(Job& job, Node& node, const v1::WorkersEnded& ended) {
  if (job.phase != Phase::kRunning || node.state != NodeState::kActive || ended.round() != job.round) {
    return absl::OkStatus();  // About a round that is already over: nothing to decide.
  }
  if (ended.failure().size() > 4096) return absl::InvalidArgumentError("failure text over 4096 bytes");
  TimePoint now = node.last_seen;
  if (ended.success()) {
    node.succeeded = true;
    for (const auto& [id, other] : job.nodes) {
      if (other.state == NodeState::kActive && !other.succeeded) return absl::OkStatus();
    }
    EndJob(job, true, absl::StrCat("all workers of round ", job.round, " succeeded"), now);
    return absl::OkStatus();
  }
  std::string detail = absl::StrCat("node ", node.node_id, " (group rank ", node.group_rank, "): ", ended.failure());
  job.last_failure = detail;
  if (job.restart_count < job.settings.max_restarts()) {
    ++job.restart_count;
    ++counters_.restarts;
    EndRound(job, v1::RoundEnded::WORKER_FAILED, detail, now);
  } else {
    EndJob(job, false, absl::StrCat(detail, "; no restarts left (max_restarts ", job.settings.max_restarts(), ")"),
           now);
  }
  return absl::OkStatus();
}

void Coordinator::OnDisconnect(SessionId id, TimePoint now, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_.find(id);
  if (session == sessions_.end()) return;
  std::string run_id = session->second.run_id;
  unjoined_.erase({session->second.opened, id});
  sessions_.erase(session);
  if (!run_id.empty()) RemoveNode(run_id, id, why, now);
}

void Coordinator::RemoveNode(const std::string& run_id, SessionId id, const std::string& why, TimePoint now) {
  Job* job = FindJob(run_id);
  if (job == nullptr) return;
  auto it = job->nodes.find(id);
  if (it == job->nodes.end()) return;
  Node node = it->second;
  job->nodes.erase(it);
  --job->counts[static_cast<int>(node.state)];
  auto by_id = job->node_ids.find(node.node_id);
  if (by_id != job->node_ids.end() && by_id->second == id) job->node_ids.erase(by_id);
  if (job->nodes.empty()) {
    jobs_.erase(run_id);  // Nobody left: a later Join with this run id starts a new job.
    job_gone_.SignalAll();
    return;
  }
  if (job->phase == Phase::kRunning && node.state == NodeState::kActive) {
    if (node.succeeded) {
      // Its workers were done; the others may finish without it.
      bool all = true;
      for (const auto& [other_id, other] : job->nodes) {
        if (other.state == NodeState::kActive && !other.succeeded) all = false;
      }
      if (all && Count(*job, NodeState::kActive) > 0) EndJob(*job, true, "all workers succeeded", now);
      return;
    }
    ++counters_.node_losses;
    job->last_failure = absl::StrCat("node ", node.node_id, " (group rank ", node.group_rank, ") lost: ", why);
    EndRound(*job, v1::RoundEnded::NODE_LOST, job->last_failure, now);
    return;
  }
  MaybeCompleteRound(*job, now);
}

std::optional<JobView> Coordinator::View(const std::string& run_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(run_id);
  if (it == jobs_.end()) return std::nullopt;
  const Job& job = it->second;
  JobView view;
  view.round = job.round;
  view.running = job.phase == Phase::kRunning;
  view.done = job.phase == Phase::kDone;
  view.restart_count = job.restart_count;
  view.active = Count(job, NodeState::kActive);
  view.pending = Count(job, NodeState::kPending);
  view.wait_listed = Count(job, NodeState::kWaitListed);
  view.stopping = Count(job, NodeState::kStopping);
  return view;
}

CoordinatorSnapshot Coordinator::Snapshot() const {
  static const char* const kPhases[] = {"gathering", "running", "done"};
  static const char* const kStates[] = {"pending", "wait_listed", "active", "stopping", "done"};
  absl::MutexLock lock(&mu_);
  CoordinatorSnapshot snapshot;
  snapshot.counters = counters_;
  snapshot.sessions = sessions_.size();
  for (const auto& [run_id, job] : jobs_) {
    JobStatus status;
    status.run_id = run_id;
    status.phase = kPhases[static_cast<int>(job.phase)];
    status.round = job.round;
    status.restart_count = job.restart_count;
    status.settings = job.settings;
    status.last_failure = job.last_failure;
    std::vector<const Node*> nodes;
    for (const auto& [id, node] : job.nodes) nodes.push_back(&node);
    std::stable_sort(nodes.begin(), nodes.end(), [](const Node* a, const Node* b) {
      bool a_placed = a->group_rank >= 0;
      bool b_placed = b->group_rank >= 0;
      if (a_placed != b_placed) return a_placed;
      return a_placed ? a->group_rank < b->group_rank : a->join_order < b->join_order;
    });
    for (const Node* node : nodes) {
      status.nodes.push_back({node->node_id, kStates[static_cast<int>(node->state)], node->group_rank, node->nproc,
                              node->master_addr, node->progress});
    }
    snapshot.jobs.push_back(std::move(status));
  }
  return snapshot;
}

bool Coordinator::WaitUntilJobGone(const std::string& run_id, std::chrono::steady_clock::time_point deadline) {
  absl::MutexLock lock(&mu_);
  while (jobs_.count(run_id) != 0) {
    std::chrono::steady_clock::duration left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero()) return false;
    job_gone_.WaitWithTimeout(&mu_, absl::FromChrono(left));
  }
  return true;
}

size_t Coordinator::job_count() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

void Coordinator::Send(SessionId id, const v1::CoordinatorMessage& message) {
  auto session = sessions_.find(id);
  if (session != sessions_.end() && session->second.sink != nullptr) session->second.sink->Send(message);
}

int Coordinator::Count(const Job& job, NodeState state) const { return job.counts[static_cast<int>(state)]; }

void Coordinator::SetState(Job& job, Node& node, NodeState state) {
  --job.counts[static_cast<int>(node.state)];
  ++job.counts[static_cast<int>(state)];
  node.state = state;
}

Coordinator::Job* Coordinator::FindJob(const std::string& run_id) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

}  // namespace elrun::rdzv
