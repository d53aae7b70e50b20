#include "agent/session_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>

namespace elrun::rdzv {
namespace {

// HMAC-SHA256 over the parts, each preceded by its length so that no two part lists collide.
std::string Hmac(const std::string& key, std::initializer_list<const std::string*> parts) {
  std::string message;
  for (const std::string* part : parts) {
    uint32_t size = static_cast<uint32_t>(part->size());
    for (int shift = 24; shift >= 0; shift -= 8) message += static_cast<char>((size >> shift) & 0xff);
    message += *part;
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest, &length);
  return std::string(reinterpret_cast<const char*>(digest), length);
}

}  // namespace

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

std::string AgentProof(const std::string& key, const std::string& server_nonce,
                       const std::string& client_nonce, const std::string& run_id,
                       const std::string& node_id) {
  static const std::string kRole = "elrun-rdzv agent";
  return Hmac(key, {&kRole, &server_nonce, &client_nonce, &run_id, &node_id});
}

std::string CoordinatorProof(const std::string& key, const std::string& server_nonce,
                             const std::string& client_nonce) {
  static const std::string kRole = "elrun-rdzv coordinator";
  return Hmac(key, {&kRole, &server_nonce, &client_nonce});
}

bool ProofEquals(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace elrun::rdzv
