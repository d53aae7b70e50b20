// The rendezvous coordinator's logic, without any networking: rounds of nodes for many jobs
// (isolated by run id), stable group ranks, the wait list, liveness, one restart budget per job
// and the exit barrier. Membership rules: a round after the first starts only once every
// survivor of the last one has rejoined or been declared lost; spares fill vacancies only;
// a scale-up ends a round at most once per last_call_timeout; an ended job is forgotten after
// close_timeout whatever its sessions do. Each run is bound to its first node's run key (session_auth.h):
// a node with another key, or none, is refused. The gRPC adapter (coordinator_server.h) and the etcd backend's
// replica (etcd_rendezvous.h) feed it one message at a time and deliver what it sends through each session's
// SessionSink; tests call it directly.
// Thread-safe: every public method takes the coordinator's mutex, and SessionSink is called with it held.
#ifndef ELRUN_AGENT_COORDINATOR_COORDINATOR_H_
#define ELRUN_AGENT_COORDINATOR_COORDINATOR_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "agent/coordinator/protocol_version.h"
#include "proto/rendezvous.pb.h"

namespace elrun::rdzv {

using TimePoint = std::chrono::steady_clock::time_point;
using SessionId = uint64_t;

// Where the coordinator's messages to one agent go. Called with the coordinator's mutex held:
// implementations must not block and must not call back into the Coordinator.
class SessionSink {
 public:
  virtual ~SessionSink() = default;
  virtual void Send(const v1::CoordinatorMessage& message) = 0;
  // Ends the session with `status` (an evicted, hung agent); no Send follows.
  virtual void Close(const absl::Status& status) = 0;
};

// Counts of one job's state, for tests and logs.
struct JobView {
  uint64_t round = 0;
  bool running = false;
  bool done = false;
  int restart_count = 0;
  int active = 0;
  int pending = 0;
  int wait_listed = 0;
  int stopping = 0;
};

// What the coordinator has done since it started, for metrics.
struct CoordinatorCounters {
  uint64_t rounds_started = 0;
  uint64_t restarts = 0;     // Worker failures that ended a round with a restart spent.
  uint64_t node_losses = 0;  // Rounds ended because a node died, hung or left.
  uint64_t jobs_succeeded = 0;
  uint64_t jobs_failed = 0;
  std::map<std::string, uint64_t> evictions;  // By reason: no_heartbeat, did_not_rejoin, job_ended.
  std::map<std::string, uint64_t> refused;    // Messages refused, by status: invalid_argument, ...
};

// One node of a job as the status page shows it. Strings come from agents: escape them.
struct NodeStatus {
  std::string node_id;
  std::string state;  // pending, wait_listed, active, stopping, done.
  int group_rank = -1;
  int nproc = 0;
  std::string master_addr;
  std::optional<v1::Progress> progress;  // Its last Progress report, validated; unset: none yet.
};

struct JobStatus {
  std::string run_id;
  std::string phase;  // gathering, running, done.
  uint64_t round = 0;
  int restart_count = 0;
  v1::JobSettings settings;
  std::string last_failure;       // The last worker failure or node loss; empty when none.
  std::vector<NodeStatus> nodes;  // By group rank, then the others in join order.
};

struct CoordinatorSnapshot {
  CoordinatorCounters counters;
  size_t sessions = 0;
  std::vector<JobStatus> jobs;  // By run id.
};

class Coordinator {
 public:
  // A session that sends no Join within `first_join_timeout` of opening is closed. With a
  // `token`, a session's first Join must prove it (session_auth.h); `nonce` makes each
  // session's Challenge from its id (RandomNonce when unset).
  struct Options {
    std::chrono::milliseconds first_join_timeout{10000};
    std::string token;
    std::function<std::string(SessionId)> nonce;
    // False: a node's liveness is judged elsewhere (the etcd backend's leases) and silence
    // never evicts it; Heartbeat messages are then not expected.
    bool heartbeats = true;
    // Every run must bring a credential of its own (its run_token): a run whose first Join
    // carries no run key, or the one the token itself derives (a run without run_token), is
    // refused - so that holding the token alone reaches no run.
    bool require_run_token = false;
    // Sent in every Welcome (the proto's Welcome.incarnation): set by a coordinator whose state
    // dies with its process (elrun-rdzv, an embedded coordinator), empty for etcd's replicas.
    std::string incarnation;
  };
  Coordinator() : Coordinator(Options{}) {}
  explicit Coordinator(Options options);
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // A new agent stream: sends it the session's Challenge. `sink` must stay valid until
  // OnDisconnect(id) has returned.
  void OnConnect(SessionId id, SessionSink* sink, TimePoint now) ABSL_LOCKS_EXCLUDED(mu_);

  // One message from a session. A bad message (malformed, for another run id, out of order)
  // returns an error status and changes nothing; the caller ends the stream with it.
  absl::Status OnMessage(SessionId id, const v1::AgentMessage& message, TimePoint now) ABSL_LOCKS_EXCLUDED(mu_);

  // The stream ended (the agent died, left, or the stream broke); `why` goes into the round's
  // end as the node's cause.
  void OnDisconnect(SessionId id, TimePoint now, const std::string& why = "its stream closed") ABSL_LOCKS_EXCLUDED(mu_);

  // Applies every timeout due at `now`: a session's first Join, heartbeats, last call, join
  // timeout, a deferred scale-up, close timeout.
  void Tick(TimePoint now) ABSL_LOCKS_EXCLUDED(mu_);

  // The earliest time Tick has something to do; nullopt when nothing is pending.
  std::optional<TimePoint> NextDeadline() const ABSL_LOCKS_EXCLUDED(mu_);

  std::optional<JobView> View(const std::string& run_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every job and node with the counters, taken under the lock at one instant.
  CoordinatorSnapshot Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t job_count() const ABSL_LOCKS_EXCLUDED(mu_);

  // Blocks until no node of `run_id` is connected any more (the job is forgotten) or `deadline`
  // passes; true in the first case. An agent hosting the coordinator calls this after its own
  // end so that the other nodes receive the job's end before the server stops.
  bool WaitUntilJobGone(const std::string& run_id, std::chrono::steady_clock::time_point deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class NodeState { kPending, kWaitListed, kActive, kStopping, kDone };
  enum class Phase { kGathering, kRunning, kDone };

  struct Node {
    SessionId session = 0;
    std::string node_id;
    int nproc = 1;
    std::string role;
    int rank_hint = -1;
    std::string master_addr;
    int master_port = 0;
    NodeState state = NodeState::kPending;
    int group_rank = -1;  // In the current or last round; -1 when never placed.
    bool succeeded = false;
    uint64_t join_order = 0;
    TimePoint last_seen;
    int rank_offset = 0;                   // Of the round it is active in.
    std::vector<v1::RankPace> paces;       // Its workers' last reported paces, this round.
    std::optional<v1::Progress> progress;  // Its last goodput report, any round.
    bool holds_survivors = false;          // Its last Join's: workers of the last round kept alive.
  };

  struct Job {
    std::string run_id;
    v1::JobSettings settings;
    Phase phase = Phase::kGathering;
    uint64_t round = 0;
    int restart_count = 0;
    TimePoint gathering_since;
    std::optional<TimePoint> last_call_deadline;
    TimePoint round_started_at;
    std::optional<TimePoint> scale_up_at;  // A newcomer waits for this while the job runs.
    std::optional<TimePoint> ended_at;     // Set when the job is done.
    uint64_t next_join_order = 0;
    std::map<SessionId, Node> nodes;  // By session.
    std::string run_key;              // Fixed by the run's first node; empty: an open run.
    std::string last_failure;
    // Kept as nodes come, go and change state, so that a Join costs O(log N), not O(N).
    std::map<std::string, SessionId> node_ids;
    int counts[5] = {0, 0, 0, 0, 0};  // Nodes by NodeState.
    // No node's last_seen is earlier: the heartbeat deadline NextDeadline reports is at most
    // early (Tick then finds nothing due and makes it exact), never late.
    TimePoint seen_floor;
  };

  struct Session {
    SessionSink* sink = nullptr;
    std::string run_id;  // Empty until its first Join.
    TimePoint opened;
    bool closing = false;        // Closed by the coordinator; OnDisconnect follows.
    std::string nonce;           // Of its Challenge.
    bool authenticated = false;  // Its first Join proved the token (or none is needed).
    std::string run_key;         // The run key its first Join signed with; empty: none.
  };

  // The proofs of a session's first Join (token, run key signature); Unauthenticated when one
  // is missing or wrong. `signature_valid`: the run key signature, when OnMessage verified it
  // outside the lock.
  absl::Status VerifyProof(const Session& session, const v1::Join& join, std::optional<bool> signature_valid) const;
  // Marks the session authenticated and sends its Welcome, the coordinator's own proof.
  void Welcome(SessionId id, Session& session, const v1::Join& join) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status HandleMessage(SessionId id, const v1::AgentMessage& message, TimePoint now,
                             std::optional<bool> signature_valid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status HandleJoin(SessionId id, Session& session, const v1::Join& join, TimePoint now,
                          std::optional<bool> signature_valid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status HandleWorkersEnded(Job& job, Node& node, const v1::WorkersEnded& ended)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status HandleProgress(Job& job, Node& node, const v1::Progress& progress) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status HandlePaces(SessionId id, Job& job, Node& node, const v1::Paces& paces)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeCompleteRound(Job& job, TimePoint now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteRound(Job& job, TimePoint now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndRound(Job& job, v1::RoundEnded::Reason reason, const std::string& detail, TimePoint now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndJob(Job& job, bool success, const std::string& detail, TimePoint now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the sessions of a job's remaining nodes with `status` and forgets them, and the job
  // when nobody is left.
  void Evict(const std::string& run_id, const std::vector<SessionId>& ids, const absl::Status& status,
             const std::string& why, const char* reason, TimePoint now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TickJob(const std::string& run_id, TimePoint now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a node that died or hung; reacts as the job's phase requires. May erase the job.
  void RemoveNode(const std::string& run_id, SessionId id, const std::string& why, TimePoint now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Send(SessionId id, const v1::CoordinatorMessage& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int Count(const Job& job, NodeState state) const;
  static void SetState(Job& job, Node& node, NodeState state);
  Job* FindJob(const std::string& run_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::chrono::milliseconds first_join_timeout_;
  const bool heartbeats_;
  const std::string key_;    // TokenKey(token), empty without a token.
  const std::string token_;  // For require_run_token's check; never sent or logged.
  const bool require_run_token_;
  const std::string incarnation_;
  const std::function<std::string(SessionId)> nonce_;
  mutable absl::Mutex mu_;
  absl::CondVar job_gone_;  // Signalled when a job is erased.
  std::map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  // Sessions not joined and not closing, by the time they opened.
  std::set<std::pair<TimePoint, SessionId>> unjoined_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  CoordinatorCounters counters_ ABSL_GUARDED_BY(mu_);
};

// Checks a Join's fields (sizes, ranges, protocol version) before it reaches any state.
absl::Status ValidateJoin(const v1::Join& join);

// The first setting in which `b` (a joining node's) differs from `a` (the job's), named with
// both values; empty when they all match (join_check.cc).
std::string SettingsDiff(const v1::JobSettings& a, const v1::JobSettings& b);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_COORDINATOR_COORDINATOR_H_
