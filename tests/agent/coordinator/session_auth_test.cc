// The run credential's Ed25519 keys and Join signatures: the same bytes whichever library
// computes them (Ed25519 is deterministic, RFC 8032), so agents and coordinators of different
// builds agree; and a signature verifies only for the fields it was made over.
#include "agent/coordinator/session_auth.h"

#include <string>

#include "doctest/doctest.h"

namespace elrun::rdzv {
namespace {

std::string Hex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

const std::string kServerNonce(kNonceBytes, 's');
const std::string kClientNonce(kNonceBytes, 'c');

// Computed by the OpenSSL (libcrypto 3) implementation this one replaced: agents and
// coordinators built before and after must keep accepting each other's Joins.
TEST_CASE("the run key and a Join signature are the bytes OpenSSL's Ed25519 gave") {
  RunKey key = DeriveRunKey("secret", "run-1");
  std::string signature = SignJoin(key, kServerNonce, kClientNonce, "run-1", "node-a");
  CHECK(Hex(key.public_key) == "28926bcd1b5ccc932bdcca66256b50fc9031351dcd447843250b105286bc865f");
  CHECK(Hex(signature) ==
        "8cd8205d18262e8a6f2acf6b1e8a9f3ba679097879d2cc61ddef4b379ec6822b"
        "239de8fc5f951ed878bbdc83fb70a052ff5422039f64e54f64495aaaf70e3309");
}

TEST_CASE("a Join signature verifies for its own fields only") {
  RunKey key = DeriveRunKey("secret", "run-1");
  std::string signature = SignJoin(key, kServerNonce, kClientNonce, "run-1", "node-a");
  CHECK(VerifyJoinSignature(key.public_key, signature, kServerNonce, kClientNonce, "run-1", "node-a"));
  CHECK_FALSE(VerifyJoinSignature(key.public_key, signature, kClientNonce, kServerNonce, "run-1", "node-a"));
  CHECK_FALSE(VerifyJoinSignature(key.public_key, signature, kServerNonce, kClientNonce, "run-2", "node-a"));
  CHECK_FALSE(VerifyJoinSignature(key.public_key, signature, kServerNonce, kClientNonce, "run-1", "node-b"));
  RunKey other = DeriveRunKey("other secret", "run-1");
  CHECK(other.public_key != key.public_key);
  CHECK_FALSE(VerifyJoinSignature(other.public_key, signature, kServerNonce, kClientNonce, "run-1", "node-a"));
  std::string flipped = signature;
  flipped[5] ^= 1;
  CHECK_FALSE(VerifyJoinSignature(key.public_key, flipped, kServerNonce, kClientNonce, "run-1", "node-a"));
  // Malformed input is a plain false: short key, short signature, empty ones.
  CHECK_FALSE(VerifyJoinSignature(key.public_key.substr(1), signature, kServerNonce, kClientNonce, "run-1", "node-a"));
  CHECK_FALSE(VerifyJoinSignature(key.public_key, signature.substr(1), kServerNonce, kClientNonce, "run-1", "node-a"));
  CHECK_FALSE(VerifyJoinSignature("", "", kServerNonce, kClientNonce, "run-1", "node-a"));
  // A public key of 32 bytes that is no curve point is refused, not a crash.
  CHECK_FALSE(
      VerifyJoinSignature(std::string(kRunKeyBytes, '\xff'), signature, kServerNonce, kClientNonce, "run-1", "node-a"));
}

TEST_CASE("a run key depends on both the secret and the run id") {
  CHECK(DeriveRunKey("secret", "run-1").public_key == DeriveRunKey("secret", "run-1").public_key);
  CHECK(DeriveRunKey("secret", "run-1").public_key != DeriveRunKey("secret", "run-2").public_key);
  CHECK(DeriveRunKey("secret", "run-1").public_key.size() == kRunKeyBytes);
}

}  // namespace
}  // namespace elrun::rdzv
