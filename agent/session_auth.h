// Proving knowledge of the rendezvous token without sending it. The coordinator opens every
// session with a fresh nonce (Challenge); the agent answers with its own nonce and
// HMAC-SHA256(key, "agent", both nonces, run id, node id) in its first Join; the coordinator
// answers with HMAC-SHA256(key, "coordinator", both nonces) (Welcome) before anything else.
// A squatter on the coordinator's port, or an eavesdropper without TLS, learns neither the
// token nor a proof it could replay; an agent trusts nothing from a coordinator that has not
// proven the token. Pure apart from RandomNonce; thread-safe.
#ifndef ELRUN_AGENT_SESSION_AUTH_H_
#define ELRUN_AGENT_SESSION_AUTH_H_

#include <cstddef>
#include <string>

namespace elrun::rdzv {

inline constexpr size_t kNonceBytes = 32;

// kNonceBytes from the kernel's random source (getrandom).
std::string RandomNonce();

// The HMAC key of a token: SHA-256 of it, so that the token itself keys nothing.
std::string TokenKey(const std::string& token);

std::string AgentProof(const std::string& key, const std::string& server_nonce,
                       const std::string& client_nonce, const std::string& run_id,
                       const std::string& node_id);
std::string CoordinatorProof(const std::string& key, const std::string& server_nonce,
                             const std::string& client_nonce);

// Constant-time comparison; false when the sizes differ.
bool ProofEquals(const std::string& a, const std::string& b);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_SESSION_AUTH_H_
