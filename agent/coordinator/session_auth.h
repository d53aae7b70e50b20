// Proving knowledge of the rendezvous token without sending it. The coordinator opens every
// session with a fresh nonce (Challenge); the agent answers with its own nonce and
// HMAC-SHA256(key, "agent", both nonces, run id, node id) in its first Join; the coordinator
// answers with HMAC-SHA256(key, "coordinator", both nonces) (Welcome) before anything else.
// A squatter on the coordinator's port, or an eavesdropper without TLS, learns neither the
// token nor a proof it could replay; an agent trusts nothing from a coordinator that has not
// proven the token. Pure apart from RandomNonce; thread-safe.
//
// A run's own credential, for a coordinator that serves many runs (elrun-rdzv): the run's
// secret (its run_token, else its token) and run id derive an Ed25519 key pair. The first Join
// of every session carries the public key and a signature over both nonces, run id and node
// id; the run's first node fixes the run's public key and every later node must sign with the
// same one. Nothing secret crosses the wire and the coordinator stores only the public key, so
// a node that holds the daemon's token but not the run's secret cannot enter the run.
#ifndef ELRUN_AGENT_COORDINATOR_SESSION_AUTH_H_
#define ELRUN_AGENT_COORDINATOR_SESSION_AUTH_H_

#include <cstddef>
#include <string>

namespace elrun::rdzv {

inline constexpr size_t kNonceBytes = 32;

// kNonceBytes from the kernel's random source (getrandom).
std::string RandomNonce();

// The HMAC key of a token: SHA-256 of it, so that the token itself keys nothing.
std::string TokenKey(const std::string& token);

std::string AgentProof(const std::string& key, const std::string& server_nonce, const std::string& client_nonce,
                       const std::string& run_id, const std::string& node_id);
std::string CoordinatorProof(const std::string& key, const std::string& server_nonce, const std::string& client_nonce);

inline constexpr size_t kRunKeyBytes = 32;        // An Ed25519 public key.
inline constexpr size_t kRunSignatureBytes = 64;  // An Ed25519 signature.

struct RunKey {
  std::string seed;        // The private key's 32-byte seed; never sent.
  std::string public_key;  // kRunKeyBytes.
};

// The run's key pair from its secret (not empty) and run id: the same on every node.
RunKey DeriveRunKey(const std::string& secret, const std::string& run_id);

std::string SignJoin(const RunKey& key, const std::string& server_nonce, const std::string& client_nonce,
                     const std::string& run_id, const std::string& node_id);
// True when `signature` is `public_key`'s over these fields; false for any malformed input.
bool VerifyJoinSignature(const std::string& public_key, const std::string& signature, const std::string& server_nonce,
                         const std::string& client_nonce, const std::string& run_id, const std::string& node_id);

// Constant-time comparison; false when the sizes differ.
bool ProofEquals(const std::string& a, const std::string& b);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_COORDINATOR_SESSION_AUTH_H_
