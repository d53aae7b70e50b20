// What the coordinator's server and the agents' client share about the connection between
// them: TLS material, the message size limit, the keepalive floor. No gRPC, no coordinator:
// the client depends on this, not on the server. Thread-safe.
#ifndef ELRUN_AGENT_NET_TRANSPORT_H_
#define ELRUN_AGENT_NET_TRANSPORT_H_

#include <chrono>
#include <string>

#include "absl/status/statusor.h"

namespace elrun::rdzv {

struct TlsFiles {
  std::string cert;  // PEM paths. Server: its certificate and key; client: its own (optional).
  std::string key;
  std::string ca;  // Server: clients must present a certificate signed by it (mutual TLS).
                   // Client: the CA that signed the server's certificate.
  bool enabled() const { return !cert.empty() || !ca.empty(); }
};

// The largest rendezvous message either side sends or accepts.
inline constexpr int kMaxMessageBytes = 64 * 1024;

// The shortest keepalive ping interval an agent uses, and the server accepts (half of it).
inline constexpr std::chrono::milliseconds kMinKeepalivePing{1000};

// Reads a whole file (for TLS material); NotFound with the path when it cannot.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_NET_TRANSPORT_H_
