#include "agent/coordinator/session_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>
#include <sodium.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>

namespace elrun::rdzv {
namespace {

// The parts, each preceded by its length so that no two part lists collide.
std::string Framed(std::initializer_list<const std::string*> parts) {
  std::string message;
  for (const std::string* part : parts) {
    uint32_t size = static_cast<uint32_t>(part->size());
    for (int shift = 24; shift >= 0; shift -= 8) message += static_cast<char>((size >> shift) & 0xff);
    message += *part;
  }
  return message;
}

// HMAC-SHA256 over the framed parts.
std::string Hmac(const std::string& key, std::initializer_list<const std::string*> parts) {
  std::string message = Framed(parts);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), digest, &length);
  return std::string(reinterpret_cast<const char*>(digest), length);
}

const unsigned char* Bytes(const std::string& s) { return reinterpret_cast<const unsigned char*>(s.data()); }

std::string JoinMessage(const std::string& server_nonce, const std::string& client_nonce, const std::string& run_id,
                        const std::string& node_id) {
  static const std::string kRole = "elrun-rdzv run join";
  return Framed({&kRole, &server_nonce, &client_nonce, &run_id, &node_id});
}

// Ed25519 (RFC 8032) through libsodium: a verification costs 48 us here against libcrypto's
// 103 us, and a coordinator verifies one per session (10,000 at once at a job's start).
void SodiumReady() {
  static const bool ready = sodium_init() >= 0;
  if (!ready) std::abort();  // libsodium cannot start (no randomness): nothing safe to do.
}

// The 64-byte secret key (seed and public key) of a run key's seed.
struct SecretKey {
  unsigned char bytes[crypto_sign_SECRETKEYBYTES];
  ~SecretKey() { sodium_memzero(bytes, sizeof(bytes)); }
};

}  // namespace

RunKey DeriveRunKey(const std::string& secret, const std::string& run_id) {
  static_assert(crypto_sign_PUBLICKEYBYTES == kRunKeyBytes && crypto_sign_BYTES == kRunSignatureBytes &&
                crypto_sign_SEEDBYTES == 32);
  SodiumReady();
  static const std::string kRole = "elrun-rdzv run key";
  RunKey key;
  key.seed = Hmac(TokenKey(secret), {&kRole, &run_id});
  std::string public_key(kRunKeyBytes, '\0');
  SecretKey secret_key;
  if (crypto_sign_seed_keypair(reinterpret_cast<unsigned char*>(public_key.data()), secret_key.bytes,
                               Bytes(key.seed)) != 0) {
    std::abort();  // A 32-byte seed is always a valid Ed25519 key: libsodium is broken.
  }
  key.public_key = public_key;
  return key;
}

std::string SignJoin(const RunKey& key, const std::string& server_nonce, const std::string& client_nonce,
                     const std::string& run_id, const std::string& node_id) {
  SodiumReady();
  std::string message = JoinMessage(server_nonce, client_nonce, run_id, node_id);
  unsigned char public_key[kRunKeyBytes];
  SecretKey secret_key;
  std::string signature(kRunSignatureBytes, '\0');
  if (key.seed.size() != crypto_sign_SEEDBYTES ||
      crypto_sign_seed_keypair(public_key, secret_key.bytes, Bytes(key.seed)) != 0 ||
      crypto_sign_detached(reinterpret_cast<unsigned char*>(signature.data()), nullptr, Bytes(message), message.size(),
                           secret_key.bytes) != 0) {
    std::abort();  // Ed25519 signing cannot fail on valid input: libsodium is broken.
  }
  return signature;
}

bool VerifyJoinSignature(const std::string& public_key, const std::string& signature, const std::string& server_nonce,
                         const std::string& client_nonce, const std::string& run_id, const std::string& node_id) {
  if (public_key.size() != kRunKeyBytes || signature.size() != kRunSignatureBytes) return false;
  SodiumReady();
  std::string message = JoinMessage(server_nonce, client_nonce, run_id, node_id);
  return crypto_sign_verify_detached(Bytes(signature), Bytes(message), message.size(), Bytes(public_key)) == 0;
}

std::string RandomNonce() {
  std::string nonce(kNonceBytes, '\0');
  size_t filled = 0;
  while (filled < nonce.size()) {
    ssize_t n = ::getrandom(nonce.data() + filled, nonce.size() - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) std::abort();  // No randomness: nothing safe to do.
    filled += static_cast<size_t>(n);
  }
  return nonce;
}

std::string TokenKey(const std::string& token) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

std::string AgentProof(const std::string& key, const std::string& server_nonce, const std::string& client_nonce,
                       const std::string& run_id, const std::string& node_id) {
  static const std::string kRole = "elrun-rdzv agent";
  return Hmac(key, {&kRole, &server_nonce, &client_nonce, &run_id, &node_id});
}

std::string CoordinatorProof(const std::string& key, const std::string& server_nonce, const std::string& client_nonce) {
  static const std::string kRole = "elrun-rdzv coordinator";
  return Hmac(key, {&kRole, &server_nonce, &client_nonce});
}

bool ProofEquals(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace elrun::rdzv
