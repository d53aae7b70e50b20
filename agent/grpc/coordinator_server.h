// Serves a Coordinator over gRPC: one callback reactor per agent stream (no thread per agent),
// the token proven inside each session (session_auth.h, never sent), optional TLS, a size limit
// on every message, and a timer thread that applies the coordinator's timeouts exactly when they
// fall due. The TCP port belongs to a ConnectionGate, which admits connections within its limits
// and relays them to gRPC on a private unix socket; the soft descriptor limit is raised to the
// hard one at start.
// Thread-safe; Shutdown (or the destructor) stops everything.
#ifndef ELRUN_AGENT_GRPC_COORDINATOR_SERVER_H_
#define ELRUN_AGENT_GRPC_COORDINATOR_SERVER_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "agent/coordinator/coordinator.h"
#include "agent/grpc/connection_gate.h"
#include "agent/net/transport.h"

namespace elrun::rdzv {

struct ServerOptions {
  std::string listen = "0.0.0.0:0";  // host:port; port 0 picks a free port.
  std::string token;                 // Agents must prove it (session_auth.h) when non-empty.
  TlsFiles tls;
  int max_message_bytes = kMaxMessageBytes;
  GateLimits gate;
  // A session that has not sent its Join this long after it opened is closed.
  std::chrono::milliseconds first_join_timeout{10000};
  // A connection must finish its TLS and HTTP/2 handshakes within this, and one without any
  // call is closed after idle_connection_timeout.
  std::chrono::milliseconds handshake_timeout{5000};
  std::chrono::milliseconds idle_connection_timeout{10000};
  bool require_run_token = false;  // Coordinator::Options' (coordinator.h).
};

class CoordinatorServer {
 public:
  // Binds and starts serving. Errors: the address cannot be bound (in use: kAlreadyExists),
  // unreadable TLS files.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const ServerOptions& options);
  ~CoordinatorServer();

  int port() const;
  Coordinator& coordinator();
  GateCounts gate_counts() const;
  void Shutdown();

  class Impl;

 private:
  explicit CoordinatorServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_GRPC_COORDINATOR_SERVER_H_
