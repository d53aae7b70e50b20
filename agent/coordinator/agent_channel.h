// What an agent's rendezvous session offers the launcher's event loop, whatever carries it: a
// stream to the grpc backend's coordinator (RendezvousClient) or the job's log in etcd
// (EtcdRendezvous). Write never blocks; event_fd is readable while messages wait or after the
// end. Thread-safe.
#ifndef ELRUN_AGENT_COORDINATOR_AGENT_CHANNEL_H_
#define ELRUN_AGENT_COORDINATOR_AGENT_CHANNEL_H_

#include <deque>
#include <optional>

#include "absl/status/status.h"
#include "proto/rendezvous.pb.h"

namespace elrun::rdzv {

class AgentChannel {
 public:
  virtual ~AgentChannel() = default;
  // Queues one message; false once the session is broken.
  virtual bool Write(const v1::AgentMessage& message) = 0;
  // Readable (level-triggered) while messages are queued or after the session ended.
  virtual int event_fd() const = 0;
  // Takes the coordinator's messages, in order; clears event_fd's readiness.
  virtual std::deque<v1::CoordinatorMessage> Take() = 0;
  // Set once the session ended, with why.
  virtual std::optional<absl::Status> ended() const = 0;
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_COORDINATOR_AGENT_CHANNEL_H_
