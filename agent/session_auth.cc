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
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest, &length);
  return std::string(reinterpret_cast<const char*>(digest), length);
}

struct PkeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
struct MdCtxFree {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxFree>;

const unsigned char* Bytes(const std::string& s) { return reinterpret_cast<const unsigned char*>(s.data()); }

std::string JoinMessage(const std::string& server_nonce, const std::string& client_nonce,
                        const std::string& run_id, const std::string& node_id) {
  static const std::string kRole = "elrun-rdzv run join";
  return Framed({&kRole, &server_nonce, &client_nonce, &run_id, &node_id});
}

}  // namespace

RunKey DeriveRunKey(const std::string& secret, const std::string& run_id) {
  static const std::string kRole = "elrun-rdzv run key";
  RunKey key;
  key.seed = Hmac(TokenKey(secret), {&kRole, &run_id});
  Pkey pkey(EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, Bytes(key.seed), key.seed.size()));
  std::string public_key(kRunKeyBytes, '\0');
  size_t size = public_key.size();
  if (!pkey || EVP_PKEY_get_raw_public_key(pkey.get(), reinterpret_cast<unsigned char*>(public_key.data()),
                                           &size) != 1 || size != kRunKeyBytes) {
    std::abort();  // A 32-byte seed is always a valid Ed25519 key: libcrypto is broken.
  }
  key.public_key = public_key;
  return key;
}

std::string SignJoin(const RunKey& key, const std::string& server_nonce, const std::string& client_nonce,
                     const std::string& run_id, const std::string& node_id) {
  std::string message = JoinMessage(server_nonce, client_nonce, run_id, node_id);
  Pkey pkey(EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, Bytes(key.seed), key.seed.size()));
  MdCtx ctx(EVP_MD_CTX_new());
  std::string signature(kRunSignatureBytes, '\0');
  size_t size = signature.size();
  if (!pkey || !ctx || EVP_DigestSignInit(ctx.get(), nullptr, nullptr, nullptr, pkey.get()) != 1 ||
      EVP_DigestSign(ctx.get(), reinterpret_cast<unsigned char*>(signature.data()), &size, Bytes(message),
                     message.size()) != 1 ||
      size != kRunSignatureBytes) {
    std::abort();  // Ed25519 signing cannot fail on valid input: libcrypto is broken.
  }
  return signature;
}

bool VerifyJoinSignature(const std::string& public_key, const std::string& signature,
                         const std::string& server_nonce, const std::string& client_nonce,
                         const std::string& run_id, const std::string& node_id) {
  if (public_key.size() != kRunKeyBytes || signature.size() != kRunSignatureBytes) return false;
  Pkey pkey(EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr, Bytes(public_key), public_key.size()));
  MdCtx ctx(EVP_MD_CTX_new());
  if (!pkey || !ctx || EVP_DigestVerifyInit(ctx.get(), nullptr, nullptr, nullptr, pkey.get()) != 1) {
    return false;
  }
  std::string message = JoinMessage(server_nonce, client_nonce, run_id, node_id);
  return EVP_DigestVerify(ctx.get(), Bytes(signature), signature.size(), Bytes(message), message.size()) == 1;
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
