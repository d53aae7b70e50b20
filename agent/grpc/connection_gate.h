// The coordinator's front door: accepts TCP connections itself and relays each admitted one to
// the gRPC server, which listens only on a private unix socket. Limits apply before gRPC sees a
// byte: connections in all and per peer address, a deadline for a connection's first bytes, and
// one for its authentication: the server names the connections whose session proved the token
// (Authenticated, by the name each relayed connection binds its unix socket to, which gRPC
// reports as the call's peer), and one that has not within auth_timeout is closed. At the total
// limit an unauthenticated connection from the address admitted most often lately makes room for
// a newcomer from a clearly quieter address; at an address's own limit, its oldest
// unauthenticated connection that has had min_auth_window (else the newcomer is closed at once).
// So a flood of connections that never authenticate, however fast it reconnects, cannot keep a
// job's agents out, and an authenticated connection is never closed to make room. When
// gRPC ends a connection the gate closes the client's side too, whatever the client does. A
// full descriptor table never stops the gate from accepting (a reserve descriptor is given up to
// accept and close), whereas gRPC 1.51's own listener stops for good after one EMFILE. TLS,
// tokens and HTTP/2 stay end to end with gRPC.
// Thread-safe; one relay thread.
#ifndef ELRUN_AGENT_GRPC_CONNECTION_GATE_H_
#define ELRUN_AGENT_GRPC_CONNECTION_GATE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace elrun::rdzv {

struct GateLimits {
  // Open connections in all; 0: what the descriptor limit allows (3 descriptors a connection,
  // 256 kept for the rest of the process), at most 4096.
  int max_connections = 0;
  // Open connections from one address; 0: max_connections / 8, at least 64. On one machine
  // every agent comes from 127.0.0.1, and behind NAT a whole cluster comes from one address,
  // so a fixed small number would shut out jobs larger than it.
  int max_per_peer = 0;
  // A connection that sends nothing for this long after it was accepted is closed.
  std::chrono::milliseconds first_bytes_timeout{5000};
  // A connection not Authenticated this long after it was accepted is closed; 0: never.
  std::chrono::milliseconds auth_timeout{5000};
  // At an address's own limit, its unauthenticated connection younger than this is not closed
  // to make room.
  std::chrono::milliseconds min_auth_window{1000};
};

struct GateCounts {
  int open = 0;                         // Connections being relayed now.
  uint64_t admitted = 0;                // Since the start.
  uint64_t refused = 0;                 // Closed at once: over a limit, or no descriptor left.
  uint64_t silent_closed = 0;           // Closed for sending nothing within first_bytes_timeout.
  uint64_t unauthenticated_closed = 0;  // Closed for not authenticating within auth_timeout.
  uint64_t evicted = 0;                 // Unauthenticated, closed at a limit to admit another.
  uint64_t authenticated = 0;           // Connections the server named as authenticated.
};

class ConnectionGate {
 public:
  // Binds `listen` (HOST:PORT, IPv6 in brackets; port 0 picks a free one; every address HOST
  // resolves to) and relays admitted connections to the unix socket at `backend_path`.
  // Errors: the address is in use or not local (kAlreadyExists), a bad address.
  static absl::StatusOr<std::unique_ptr<ConnectionGate>> Start(const std::string& listen,
                                                               const std::string& backend_path, GateLimits limits);
  // Stops the relay thread and closes every connection and listener.
  ~ConnectionGate();
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;

  int port() const;
  int max_connections() const;
  int max_per_peer() const;
  GateCounts counts() const;
  // The server's word that the connection gRPC reported as `peer` (a call's peer, e.g.
  // "unix-abstract:elrun-gate/...") has authenticated: it is no longer closed for not
  // authenticating nor to make room. Names that are not a live connection of this gate are
  // ignored.
  void Authenticated(const std::string& peer);

  class Relay;

 private:
  explicit ConnectionGate(std::unique_ptr<Relay> relay);
  std::unique_ptr<Relay> relay_;
};

// Raises this process's soft RLIMIT_NOFILE to its hard limit; returns the soft limit in force.
int RaiseOpenFileLimit();

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_GRPC_CONNECTION_GATE_H_
