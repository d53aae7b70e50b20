// The launcher's side of a rendezvous session: one bidirectional stream to the coordinator.
// A reader thread queues what the coordinator pushes and makes event_fd() readable, so the
// launcher's epoll loop learns of a new round the moment it is decided. Write only queues: a
// writer thread sends, so the loop never blocks on a coordinator that stopped reading. HTTP/2
// keepalive pings end the stream with UNAVAILABLE when the coordinator stops answering (a
// SIGSTOP'd or cut-off host) within silence_timeout. Thread-safe as documented per method.
#ifndef ELRUN_AGENT_GRPC_RENDEZVOUS_CLIENT_H_
#define ELRUN_AGENT_GRPC_RENDEZVOUS_CLIENT_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/coordinator/agent_channel.h"
#include "agent/net/transport.h"
#include "proto/rendezvous.pb.h"

namespace elrun::rdzv {

struct ClientOptions {
  std::string endpoint;  // host:port of the coordinator.
  TlsFiles tls;          // The token is proven by the agent over the stream (session_auth.h).
  // How long to wait for the coordinator to become reachable (it may start after this node).
  std::chrono::milliseconds connect_timeout{600000};
  // A coordinator that answers no keepalive ping (or acknowledges nothing sent) for this long
  // is lost: heartbeat_timeout - heartbeat_interval (elastic_job.cc).
  std::chrono::milliseconds silence_timeout{5000};
};

// The keepalive ping interval for a silence timeout: half of it, never below kMinKeepalivePing,
// which the coordinator's server accepts. The ping timeout is the silence timeout itself (at
// least kMinKeepalivePing), and gRPC makes it the socket's TCP_USER_TIMEOUT too: a link cut is
// noticed once what was sent has gone unacknowledged for the silence timeout, and a silent
// coordinator (SIGSTOP) within 1.5 times it. A shorter silence is waited out: a cut that TCP's
// retransmissions bridge within it costs the node nothing (tests/integration/net_faults_test.py).
std::chrono::milliseconds KeepaliveInterval(std::chrono::milliseconds silence_timeout);
std::chrono::milliseconds KeepaliveTimeout(std::chrono::milliseconds silence_timeout);

class RendezvousClient : public AgentChannel {
 public:
  // Starts connecting in the background (up to connect_timeout: the coordinator may start
  // after this node) and then opens the stream. Errors: unreadable TLS files, eventfd failure.
  // A coordinator that cannot be reached in time (down, or TLS settings that do not match)
  // shows up as the stream's end with UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<RendezvousClient>> Open(const ClientOptions& options);
  // Cancels the stream and joins the reader and writer threads.
  ~RendezvousClient() override;

  // Queues one message for the writer thread (sent once the stream is open); never blocks on
  // the network. False when the stream is broken.
  bool Write(const v1::AgentMessage& message) override;

  // Readable (level-triggered) while messages are queued or after the stream ended.
  int event_fd() const override { return event_fd_; }

  // Takes the queued messages (any thread). Clears event_fd's readiness.
  std::deque<v1::CoordinatorMessage> Take() override;

  // Set once the stream has ended: the coordinator's status (e.g. UNAUTHENTICATED, or
  // UNAVAILABLE when it cannot be reached or died).
  std::optional<absl::Status> ended() const override;

  class Stream;

 private:
  RendezvousClient(int event_fd, std::unique_ptr<Stream> stream);
  void ReadLoop();
  void WriteLoop();
  void End(const absl::Status& status);

  const int event_fd_;
  std::unique_ptr<Stream> stream_;
  mutable absl::Mutex mu_;
  std::deque<v1::CoordinatorMessage> inbox_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> ended_ ABSL_GUARDED_BY(mu_);
  std::thread reader_;
  std::thread writer_;
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_GRPC_RENDEZVOUS_CLIENT_H_
