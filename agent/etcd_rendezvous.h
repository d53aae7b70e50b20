// The etcd-v3 rendezvous backend: the job's rendezvous state lives in etcd, and no elrun
// process is a single point of failure. Every input of the job's coordinator - a node's
// arrival, each of its messages, the end of its lease, a timeout falling due - is a key
// created under <prefix><run id>/log/, and etcd's revision orders them. Each agent replays that
// log into its own Coordinator (agent/coordinator.h, the same logic the grpc backend runs), so
// every agent takes the same decisions - rounds, ranks, the restart budget - and acts on the
// ones addressed to itself. Liveness is a lease per agent that holds its key under nodes/:
// kill -9 an agent and its lease expires after the lease TTL (heartbeat_timeout); stop it
// cleanly and the lease is revoked at once; either way the survivors log its disconnect.
// Watches push every new entry; the log is read back from its keys (not etcd's history), so
// compaction does no harm and a node arriving late replays the job from the start. The first
// node of a run id with no live node clears what a dead job left; the last node to leave
// deletes the job's keys. Same interface as RendezvousClient. Thread-safe as documented.
#ifndef ELRUN_AGENT_ETCD_RENDEZVOUS_H_
#define ELRUN_AGENT_ETCD_RENDEZVOUS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agent/agent_channel.h"
#include "agent/coordinator.h"
#include "agent/etcd_client.h"
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
  // a node that arrives late first replays the job's log, and a dead one loses its lease.
  std::chrono::milliseconds first_join_timeout{600000};
  // A disconnect or a timeout is logged at once by one agent (the live one with the lowest
  // session); the k-th next one logs it after k times this (at most 10 times) if it has not
  // appeared by then, so that an overloaded cluster is not sent one write per agent.
  std::chrono::milliseconds backup_delay{1000};
};

class EtcdRendezvous : public AgentChannel {
 public:
  // Connects (authenticating), takes a lease, registers this node and starts replaying the
  // job's log. Errors: etcd unreachable or refusing the user, bad TLS files.
  static absl::StatusOr<std::unique_ptr<EtcdRendezvous>> Open(const EtcdRendezvousOptions& options);
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
  struct Write_ {
    std::string key;
    v1::LogEntry entry;
    // A backup of another agent's write: not before this, and not once the entry is applied.
    std::chrono::steady_clock::time_point not_before{};
  };

  EtcdRendezvous(EtcdRendezvousOptions options, std::unique_ptr<EtcdClient> client, int event_fd,
                 int64_t lease, uint64_t session);
  std::string LogKey(const std::string& name) const { return base_ + "log/" + name; }

  // Reader thread: reads the log from its keys, then follows it with a watch; again after the
  // watch breaks (a member died) from where it stopped.
  void ReadLoop();
  absl::StatusOr<int64_t> CatchUp();
  void Apply(const mvccpb::KeyValue& kv);
  void OnPresenceGone(const std::string& node_id);
  // This node's place among the live sessions but `excluding`, at most 10 (reader thread): 0
  // logs a disconnect or a tick at once, place k as a backup after k * backup_delay.
  int Place(uint64_t excluding) const;
  // After a batch of entries: lets the writer see the replica's new deadline and designation.
  void Applied();
  // Whether a backup write is still needed (its entry not applied yet). Writer thread, mu_ held.
  bool StillNeeded(const Write_& write) const;
  void CloseSession(uint64_t session, const absl::Status& status);

  // Writer thread: appends entries, renews the lease, logs due timeouts.
  void WriteLoop();
  absl::Status Append(const std::string& key, const v1::LogEntry& entry);
  void End(const absl::Status& status);
  void Deliver(const v1::CoordinatorMessage& message);

  const EtcdRendezvousOptions options_;
  const std::string base_;  // <prefix><run id>/
  std::unique_ptr<EtcdClient> client_;
  const int event_fd_;
  const int64_t lease_;
  const uint64_t session_;  // This node's.

  // The replica; touched by the reader thread (and NextDeadline by the writer).
  Coordinator coordinator_;
  std::map<uint64_t, std::unique_ptr<Sink>> sinks_;
  std::map<std::string, uint64_t> live_;      // Node id -> its session, while connected.
  std::map<uint64_t, std::string> sessions_;  // The reverse of live_.
  std::vector<std::pair<uint64_t, absl::Status>> closing_;  // Closed by the coordinator.
  int64_t applied_ = 0;      // The last log entry applied (its create revision).
  int64_t log_time_ms_ = 0;  // The replica's clock.
  uint64_t nonces_ = 0;

  mutable std::mutex mu_;
  std::condition_variable wake_;                // The writer's.
  std::deque<v1::CoordinatorMessage> inbox_;    // Guarded by mu_.
  std::optional<absl::Status> ended_;           // Guarded by mu_.
  std::deque<Write_> outbox_;                   // Guarded by mu_.
  std::deque<Write_> backups_;                  // Guarded by mu_.
  std::set<uint64_t> closed_;                   // Sessions applied as closed. Guarded by mu_.
  int64_t applied_time_ms_ = 0;                 // log_time_ms_ for the writer. Guarded by mu_.
  int place_ = 0;  // This node's place among the live sessions (0: logs timeouts at once). mu_.
  std::set<uint64_t> disconnects_asked_;        // Guarded by mu_.
  bool stop_ = false;                           // Guarded by mu_.
  bool replica_changed_ = false;                // Guarded by mu_.
  uint64_t next_seq_ = 0;                       // Guarded by mu_.
  std::unique_ptr<EtcdWatch> watch_;            // Guarded by mu_ (Cancel from the destructor).
  std::thread reader_;
  std::thread writer_;
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_ETCD_RENDEZVOUS_H_
