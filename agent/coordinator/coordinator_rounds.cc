// The Coordinator's rounds: completing one when its nodes have gathered, ending one and the job,
// and the timeouts that Tick fires (last call, heartbeats, joins, closing). The sessions and
// their messages are in coordinator.cc.
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/coordinator/coordinator.h"
#include "agent/coordinator/group_ranks.h"

namespace elrun::rdzv {
namespace {

std::chrono::milliseconds Ms(int64_t ms) { return std::chrono::milliseconds(ms); }

}  // namespace

void Coordinator::MaybeCompleteRound(Job& job, TimePoint now) {
  if (job.phase != Phase::kGathering) return;
  // After a round ended, the survivors are known: no round starts before all of them are back
  // (one that dies, hangs or never rejoins is removed by its stream, its heartbeat or the join
  // timeout), so that spares and newcomers cannot take their places.
  if (job.round > 0 && Count(job, NodeState::kStopping) > 0) return;
  int pending = Count(job, NodeState::kPending);
  if (pending >= job.settings.max_nodes()) {
    CompleteRound(job, now);
    return;
  }
  if (pending < job.settings.min_nodes()) return;
  if (job.round > 0) {  // Every survivor is back: no last call.
    CompleteRound(job, now);
    return;
  }
  if (!job.last_call_deadline) {
    job.last_call_deadline = now + Ms(job.settings.last_call_timeout_ms());
    if (job.settings.last_call_timeout_ms() == 0) CompleteRound(job, now);
  }
}

void Coordinator::CompleteRound(Job& job, TimePoint now) {
  std::vector<Node*> joined;
  for (auto& [id, node] : job.nodes) {
    if (node.state == NodeState::kPending) joined.push_back(&node);
  }
  // Beyond max_nodes: the earliest joiners (survivors first) get the places.
  std::stable_sort(joined.begin(), joined.end(), [](const Node* a, const Node* b) {
    if ((a->group_rank >= 0) != (b->group_rank >= 0)) return a->group_rank >= 0;
    return a->join_order < b->join_order;
  });
  if (static_cast<int>(joined.size()) > job.settings.max_nodes()) {
    for (size_t i = job.settings.max_nodes(); i < joined.size(); ++i) {
      SetState(job, *joined[i], NodeState::kWaitListed);
      joined[i]->group_rank = -1;
      v1::CoordinatorMessage waiting;
      waiting.mutable_waiting()->set_wait_listed(true);
      waiting.mutable_waiting()->set_job_running(true);
      Send(joined[i]->session, waiting);
    }
    joined.resize(job.settings.max_nodes());
  }
  std::vector<RankCandidate> candidates;
  for (const Node* node : joined) {
    candidates.push_back({node->group_rank, node->rank_hint, node->join_order});
  }
  std::vector<int> ranks = AssignGroupRanks(candidates);
  std::vector<Node*> by_rank(joined.size());
  for (size_t i = 0; i < joined.size(); ++i) {
    joined[i]->group_rank = ranks[i];
    by_rank[ranks[i]] = joined[i];
  }

  ++job.round;
  ++counters_.rounds_started;
  job.phase = Phase::kRunning;
  job.last_call_deadline.reset();
  job.scale_up_at.reset();
  job.round_started_at = now;
  int world_size = 0;
  std::map<std::string, int> role_sizes;
  for (const Node* node : by_rank) {
    world_size += node->nproc;
    role_sizes[node->role] += node->nproc;
  }
  // Survivors kept alive anywhere hold the job's live state: the round regroups around them.
  // Only a node that was in the last round can hold them (a newcomer's Join never says so).
  bool keep_survivors = false;
  for (const Node* node : by_rank) keep_survivors |= node->holds_survivors;
  int offset = 0;
  std::map<std::string, int> role_offsets;
  for (Node* node : by_rank) {
    v1::CoordinatorMessage message;
    v1::RoundStarted* started = message.mutable_round_started();
    started->set_round(job.round);
    started->set_group_rank(node->group_rank);
    started->set_group_world_size(static_cast<int>(by_rank.size()));
    started->set_rank_offset(offset);
    started->set_world_size(world_size);
    started->set_role_rank_offset(role_offsets[node->role]);
    started->set_role_world_size(role_sizes[node->role]);
    started->set_master_addr(by_rank[0]->master_addr);
    started->set_master_port(by_rank[0]->master_port);
    started->set_restart_count(job.restart_count);
    started->set_keep_survivors(keep_survivors);
    node->holds_survivors = false;
    node->rank_offset = offset;
    node->paces.clear();
    offset += node->nproc;
    role_offsets[node->role] += node->nproc;
    SetState(job, *node, NodeState::kActive);
    node->succeeded = false;
    node->last_seen = std::max(node->last_seen, now);
    Send(node->session, message);
  }
}

void Coordinator::EndRound(Job& job, v1::RoundEnded::Reason reason, const std::string& detail, TimePoint now) {
  v1::CoordinatorMessage message;
  v1::RoundEnded* ended = message.mutable_round_ended();
  ended->set_round(job.round);
  ended->set_reason(reason);
  ended->set_detail(detail);
  for (auto& [id, node] : job.nodes) {
    if (node.state == NodeState::kActive) {
      SetState(job, node, NodeState::kStopping);
      Send(id, message);
    } else if (node.state == NodeState::kWaitListed) {
      SetState(job, node, NodeState::kPending);  // A place may be free in the next round.
    }
  }
  job.phase = Phase::kGathering;
  job.gathering_since = now;
  job.last_call_deadline.reset();
  job.scale_up_at.reset();
  MaybeCompleteRound(job, now);
}

void Coordinator::EndJob(Job& job, bool success, const std::string& detail, TimePoint now) {
  ++(success ? counters_.jobs_succeeded : counters_.jobs_failed);
  if (!success) job.last_failure = detail;
  job.phase = Phase::kDone;
  job.last_call_deadline.reset();
  job.scale_up_at.reset();
  job.ended_at = now;
  v1::CoordinatorMessage message;
  message.mutable_job_ended()->set_success(success);
  message.mutable_job_ended()->set_detail(detail);
  for (auto& [id, node] : job.nodes) {
    SetState(job, node, NodeState::kDone);
    Send(id, message);
  }
}

void Coordinator::Tick(TimePoint now) {
  absl::MutexLock lock(&mu_);
  // Sessions that never joined (a client that opened a stream and went quiet) are closed.
  while (!unjoined_.empty() && now >= unjoined_.begin()->first + first_join_timeout_) {
    Session& session = sessions_.at(unjoined_.begin()->second);
    unjoined_.erase(unjoined_.begin());
    session.closing = true;
    session.sink->Close(absl::DeadlineExceededError(
        absl::StrCat("no Join within ", first_join_timeout_.count(), " ms of opening the session")));
  }
  std::vector<std::string> run_ids;
  for (const auto& [run_id, job] : jobs_) run_ids.push_back(run_id);
  for (const std::string& run_id : run_ids) TickJob(run_id, now);
}

void Coordinator::TickJob(const std::string& run_id, TimePoint now) {
  Job* job = FindJob(run_id);
  if (job == nullptr) return;
  if (job->phase == Phase::kDone) {
    // Nodes that have not left close_timeout after the end are closed and the run forgotten.
    if (now >= *job->ended_at + Ms(job->settings.close_timeout_ms())) {
      std::vector<SessionId> ids;
      for (const auto& [id, node] : job->nodes) ids.push_back(id);
      Evict(run_id, ids,
            absl::DeadlineExceededError(absl::StrCat("run ", run_id, " ended ", job->settings.close_timeout_ms(),
                                                     " ms ago (close_timeout); closing")),
            "the job ended", "job_ended", now);
    }
    return;
  }
  // Hung or cut-off agents: evicted, as if their stream had closed. (Without heartbeats there
  // is nothing to walk: the etcd replicas tick often, and O(nodes) per tick adds up.)
  if (heartbeats_) {
    std::vector<SessionId> hung;
    std::optional<TimePoint> floor;
    for (const auto& [id, node] : job->nodes) {
      if (now - node.last_seen > Ms(job->settings.heartbeat_timeout_ms())) {
        hung.push_back(id);
      } else if (!floor || node.last_seen < *floor) {
        floor = node.last_seen;
      }
    }
    job->seen_floor = floor.value_or(now);
    Evict(run_id, hung,
          absl::UnavailableError(absl::StrCat("no heartbeat for ", job->settings.heartbeat_timeout_ms(),
                                              " ms: removed from run ", run_id)),
          "no heartbeat", "no_heartbeat", now);
    job = FindJob(run_id);
    if (job == nullptr) return;
  }
  if (job->phase == Phase::kRunning) {
    if (job->scale_up_at && now >= *job->scale_up_at) {
      job->scale_up_at.reset();
      if (Count(*job, NodeState::kPending) > 0) {
        EndRound(*job, v1::RoundEnded::NODE_JOINED, "nodes joined", now);
      }
    }
    return;
  }
  if (job->phase != Phase::kGathering) return;
  bool join_timed_out = now - job->gathering_since >= Ms(job->settings.join_timeout_ms());
  if (join_timed_out && job->round > 0) {
    // Survivors that keep their session but never rejoin are declared lost.
    std::vector<SessionId> stuck;
    for (const auto& [id, node] : job->nodes) {
      if (node.state == NodeState::kStopping) stuck.push_back(id);
    }
    Evict(run_id, stuck,
          absl::DeadlineExceededError(absl::StrCat("did not rejoin run ", run_id, " within join_timeout ",
                                                   job->settings.join_timeout_ms(), " ms")),
          "did not rejoin", "did_not_rejoin", now);
    job = FindJob(run_id);
    if (job == nullptr || job->phase != Phase::kGathering) return;
  }
  if (job->last_call_deadline && now >= *job->last_call_deadline &&
      Count(*job, NodeState::kPending) >= job->settings.min_nodes()) {
    CompleteRound(*job, now);
  } else if (join_timed_out && Count(*job, NodeState::kPending) < job->settings.min_nodes()) {
    EndJob(*job, false,
           absl::StrCat("only ", Count(*job, NodeState::kPending), " of min ", job->settings.min_nodes(),
                        " nodes joined within join_timeout ", job->settings.join_timeout_ms(), " ms"),
           now);
  }
}

void Coordinator::Evict(const std::string& run_id, const std::vector<SessionId>& ids, const absl::Status& status,
                        const std::string& why, const char* reason, TimePoint now) {
  if (!ids.empty()) counters_.evictions[reason] += ids.size();
  for (SessionId id : ids) {
    auto session = sessions_.find(id);
    if (session != sessions_.end()) {
      session->second.sink->Close(status);
      session->second.run_id.clear();
      session->second.closing = true;
    }
    RemoveNode(run_id, id, why, now);
  }
}

std::optional<TimePoint> Coordinator::NextDeadline() const {
  absl::MutexLock lock(&mu_);
  std::optional<TimePoint> next;
  auto consider = [&next](TimePoint t) {
    if (!next || t < *next) next = t;
  };
  if (!unjoined_.empty()) consider(unjoined_.begin()->first + first_join_timeout_);
  for (const auto& [run_id, job] : jobs_) {
    if (job.phase == Phase::kDone) {
      consider(*job.ended_at + Ms(job.settings.close_timeout_ms()));
      continue;
    }
    if (job.scale_up_at) consider(*job.scale_up_at);
    if (heartbeats_ && !job.nodes.empty()) {
      consider(job.seen_floor + Ms(job.settings.heartbeat_timeout_ms()) + std::chrono::milliseconds(1));
    }
    if (job.phase == Phase::kGathering) {
      if (job.last_call_deadline) consider(*job.last_call_deadline);
      consider(job.gathering_since + Ms(job.settings.join_timeout_ms()));
    }
  }
  return next;
}

}  // namespace elrun::rdzv
