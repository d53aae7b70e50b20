// The etcd-v3 rendezvous backend: the job's rendezvous state lives in etcd, and no elrun
// process is a single point of failure. Every input of the job's coordinator - a node's
// arrival, each of its messages, the end of its lease, a timeout falling due - is a key created
// under <prefix><run id>/log/, and etcd's revision orders them. One agent leads: it replays
// that log into its Coordinator (agent/coordinator/coordinator.h, the same logic the grpc backend runs) and
// writes what the coordinator sends each session under out/<session>/<seq> (all but the first,
// the session's Challenge: its nonce is made from the session id, and the agent makes it itself
// and answers at once); every agent watches only its own outputs, so a job of N nodes costs
// etcd O(N) writes and events, not a copy of every entry for every agent. Liveness is a lease
// per agent that holds its key under nodes/: kill -9 an agent and its lease expires after the
// lease TTL (heartbeat_timeout); stop it cleanly and the lease is revoked at once; either way
// the leader logs its disconnect. The leader is the live node whose nodes/ key is oldest; each
// other node watches the node just before it, and the one whose predecessors are all gone takes
// the lead: it replays the log from its keys (not etcd's history, so compaction does no harm),
// takes the same decisions its predecessor took, and writes only the outputs that were not
// written yet. The leader's writes are fenced by its own nodes/ key, so a leader whose lease
// expired (stalled, cut off) writes nothing after its successor has taken over. The first node
// of a run id with no live node clears what a dead job left; the last node to leave deletes the
// job's keys. Same interface as RendezvousClient. Thread-safe as documented.
#ifndef ELRUN_AGENT_ETCD_ETCD_RENDEZVOUS_H_
#define ELRUN_AGENT_ETCD_ETCD_RENDEZVOUS_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/coordinator/agent_channel.h"
#include "agent/coordinator/coordinator.h"
#include "agent/etcd/etcd_client.h"
#include "agent/etcd/etcd_clock.h"
#include "agent/etcd/etcd_kv.h"
#include "agent/etcd/etcd_quiet_trim.h"
#include "proto/rendezvous.pb.h"

namespace elrun::rdzv {

struct EtcdRendezvousOptions {
  EtcdOptions etcd;
  std::string prefix = "/elrun/rdzv/";  // Jobs live at <prefix><run id>/.
  std::string run_id;
  std::string node_id;  // Unique per agent process.
  // The lease's TTL: how long after an agent stops renewing it the others see it lost.
  std::chrono::milliseconds lease_ttl{5000};
  std::string token;  // The rendezvous token, checked on every Join as the grpc backend does.
  // A session that sends no Join this long (in log time) after its arrival is closed. Long:
  // a dead node loses its lease anyway, and a busy cluster may delay a live one's Join.
  std::chrono::milliseconds first_join_timeout{600000};
};

class EtcdRendezvous : public AgentChannel {
 public:
  // Connects (authenticating), takes a lease, registers this node and starts replaying the
  // job's log. Errors: a run id that is empty or holds '/' (InvalidArgument), etcd unreachable
  // or refusing the user, bad TLS files.
  static absl::StatusOr<std::unique_ptr<EtcdRendezvous>> Open(const EtcdRendezvousOptions& options);
  // The same on a given etcd and clock (a fake of each in unit tests); of options.etcd, only
  // the call timeout and the retry time are read.
  static absl::StatusOr<std::unique_ptr<EtcdRendezvous>> Open(const EtcdRendezvousOptions& options,
                                                              std::unique_ptr<EtcdKv> etcd,
                                                              std::shared_ptr<const EtcdClock> clock);
  // Leaves: revokes the lease (the others see this node gone at once); the last node of the
  // job deletes its keys.
  ~EtcdRendezvous() override;

  // Queues one message for the log; never blocks on the network. Heartbeats are dropped: the
  // lease is this node's liveness. False once the session ended.
  bool Write(const v1::AgentMessage& message) override;
  // Readable (level-triggered) while messages are queued or after the session ended.
  int event_fd() const override { return event_fd_; }
  // Takes the coordinator's messages to this node, in order. Clears event_fd's readiness.
  std::deque<v1::CoordinatorMessage> Take() override;
  // Set once the session ended: evicted by the coordinator, the lease lost, etcd unreachable.
  std::optional<absl::Status> ended() const override;

 private:
  class Sink;
  // What Open's transaction saw: the node ahead ("" for none) at the session's revision.
  struct FirstLook {
    std::string ahead;
    int64_t revision = 0;
  };
  struct Put {
    std::string key;
    std::string value;
  };
  // This node's place: its session id (its connect entry's create revision) and its nodes/ key's
  // create revision (its place in line).
  struct Place {
    uint64_t session = 0;
    int64_t presence_revision = 0;
  };
  struct Registration;

  // Open's steps. Register: puts this node's presence and connect entry, behind the last node
  // to join in one transaction while it lives, else in line read from nodes/ (a dead job's log
  // cleared when no node lives); what it saw, or nothing when it must read its place back.
  static absl::StatusOr<std::optional<FirstLook>> Register(EtcdKv& client, const Registration& registration);
  // ReadPlace: logs the connect entry if it is not there yet (a retry after a lost reply) and
  // reads back both create revisions. Internal when etcd lost either key.
  static absl::StatusOr<Place> ReadPlace(EtcdKv& client, const Registration& registration);

  EtcdRendezvous(EtcdRendezvousOptions options, std::unique_ptr<EtcdKv> client, std::shared_ptr<const EtcdClock> clock,
                 int event_fd, int64_t lease, uint64_t session, int64_t presence_revision);
  std::string LogKey(const std::string& name) const { return base_ + "log/" + name; }
  std::string OutPrefix(uint64_t session) const;

  // Reader thread: follows this node's outputs until it leads, then the job's log; again after
  // a watch breaks (a member died) from where it stopped.
  void ReadLoop();
  // Delivers this node's outputs while the node just before it lives. OK: look again (the
  // predecessor is gone, or this node leads now).
  absl::Status Follow();
  // Takes this node's outputs since the last seen and finds a live node before it in line
  // ("": none, this node leads), at one revision (*at). *ahead on entry: the node that was
  // ahead ("": none known); while it lives it stays ahead, found in O(1) for etcd, where
  // reading the line is O(N) (a member's death breaks every agent's watch at once).
  absl::Status LookAround(std::string* ahead, int64_t* at);
  void OnOutput(const mvccpb::KeyValue& kv);
  void TakeOutput(uint64_t seq, const v1::OutEntry& entry);
  // Replays the log into the replica and follows it with a watch, with the nodes' presence.
  absl::Status Lead();
  absl::StatusOr<int64_t> CatchUp();
  // The outputs the previous leaders wrote: the highest seq of each session (once, on taking
  // the lead).
  absl::Status ReadWritten(int64_t revision);
  void Apply(const mvccpb::KeyValue& kv);
  void OnPresenceGone(const std::string& node_id);
  // One output of the replica to `session`: delivered here when it is this node's, queued for
  // etcd when it is another's and its predecessor did not write it.
  void Output(uint64_t session, v1::OutEntry entry);
  // After a batch of entries: lets the writer see the replica's new deadline.
  void Applied();
  void CloseSession(uint64_t session, const absl::Status& status);

  // Renewer thread: renews the lease every TTL/3 from its grant, on its own so that no write waiting on a
  // stalled member delays it; ends the session when etcd says the lease expired, or when it
  // could not renew it for a whole TTL.
  void RenewLoop();
  // Writer thread: appends entries, writes outputs, logs due timeouts, trims etcd's read buffer.
  void WriteLoop();
  // After this node's own session ended, only a leader writes (its replica's outputs).
  bool MayWrite() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `write` (without mu_) until it is done, the lease is lost (the renewer renews
  // meanwhile) or the node leaves: a busy cluster only delays the job. NotFound while leading
  // deposes this node (it drops what it had to write); a write that fails for good ends this
  // node's session, unless it is stopping or its session already ended.
  void WriteRetried(const std::function<absl::Status()>& write) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the next outputs that fit in one etcd transaction.
  std::vector<Put> TakeOutputBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The leader's: queues a tick for the replica's deadline when it is due (true) and has not
  // been logged (*ticked_for), else brings *wait_until forward to it.
  bool QueueDueTick(std::chrono::steady_clock::time_point now, int64_t* ticked_for,
                    std::chrono::steady_clock::time_point* wait_until) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The leader's: grants or revokes the spare lease when EtcdQuietTrim says so (true), else
  // brings *wait_until forward to its next step.
  bool StepQuietTrim(std::chrono::steady_clock::time_point now, std::chrono::steady_clock::time_point* wait_until)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a batch of outputs if this node's presence (its lead) still holds. NotFound: it
  // does not.
  absl::Status WriteFenced(const std::vector<Put>& batch);
  void End(const absl::Status& status);
  void Deliver(const v1::CoordinatorMessage& message);

  const EtcdRendezvousOptions options_;
  const std::string base_;  // <prefix><run id>/
  std::unique_ptr<EtcdKv> client_;
  const std::shared_ptr<const EtcdClock> clock_;
  const int event_fd_;
  const int64_t lease_;
  const uint64_t session_;           // This node's.
  const int64_t presence_revision_;  // Its nodes/ key's create revision: its place in line.

  // Set by Open before the threads start: when the lease was granted (the renewer's).
  EtcdClock::TimePoint granted_at_{};
  // Reader thread only.
  std::optional<FirstLook> first_look_;     // Set by Open, used by the first Follow.
  std::string ahead_;                       // The live node followed; "" once it is gone.
  std::map<uint64_t, v1::OutEntry> early_;  // Outputs past a gap, until it fills.
  int64_t outputs_seen_ = 0;                // Create revision of the last output read.
  // The replica (leader); touched by the reader thread (and NextDeadline by the writer).
  Coordinator coordinator_;
  std::map<uint64_t, std::unique_ptr<Sink>> sinks_;
  std::map<std::string, uint64_t> live_;                    // Node id -> its session, while connected.
  std::map<uint64_t, std::string> sessions_;                // The reverse of live_.
  std::vector<std::pair<uint64_t, absl::Status>> closing_;  // Closed by the coordinator.
  std::map<uint64_t, uint64_t> made_;                       // Outputs made for each session so far.
  std::map<uint64_t, uint64_t> written_;                    // Outputs previous leaders wrote, per session.
  bool replica_ready_ = false;                              // written_ read: the replica may write.
  int64_t applied_ = 0;                                     // The last log entry applied (its create revision).
  int64_t log_time_ms_ = 0;                                 // The replica's clock.

  mutable absl::Mutex mu_;
  absl::CondVar wake_;                         // The writer's.
  absl::CondVar renew_wake_;                   // The renewer's: only to stop.
  absl::CondVar flushed_;                      // Nothing left to write (a leader leaving).
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // The writer is in a write.
  std::deque<v1::CoordinatorMessage> inbox_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> ended_ ABSL_GUARDED_BY(mu_);
  uint64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;  // This node's outputs taken.
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Put> outbox_ ABSL_GUARDED_BY(mu_);   // Log entries to append.
  std::deque<Put> outputs_ ABSL_GUARDED_BY(mu_);  // The leader's, to write.
  std::set<uint64_t> disconnects_asked_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool replica_changed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Set and reset by the reader thread, which reads it without the lock; Cancel from the
  // writer and the destructor.
  std::unique_ptr<EtcdKvWatch> watch_ ABSL_GUARDED_BY(mu_);
  // The leader's: when it clears etcd's read buffer after a burst of writes.
  EtcdQuietTrim trim_ ABSL_GUARDED_BY(mu_){std::chrono::seconds(1)};
  std::thread reader_;
  std::thread writer_;
  std::thread renewer_;
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_ETCD_ETCD_RENDEZVOUS_H_
