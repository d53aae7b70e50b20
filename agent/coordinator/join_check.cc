// The checks on a Join before it reaches the coordinator's state, and the settings a joining
// node must share with its job. Pure; thread-safe.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "agent/coordinator/coordinator.h"
#include "agent/coordinator/protocol_version.h"
#include "agent/coordinator/session_auth.h"
#include "agent/coordinator/wire_checks.h"

namespace elrun::rdzv {
namespace {

constexpr size_t kMaxIdLength = 128;
constexpr int kMaxNodes = 65536;
constexpr int kMaxNproc = 4096;
constexpr int64_t kMaxTimeoutMs = 7LL * 24 * 3600 * 1000;

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
         c == '.' || c == ':';
}

absl::Status CheckId(const std::string& what, const std::string& id) {
  if (id.empty() || id.size() > kMaxIdLength || !std::all_of(id.begin(), id.end(), IsIdChar)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be 1-", kMaxIdLength, " characters of [A-Za-z0-9._:-]"));
  }
  return absl::OkStatus();
}

absl::Status CheckRange(const std::string& what, int64_t value, int64_t min, int64_t max) {
  if (value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat(what, " = ", value, " is outside [", min, ", ", max, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

// The first setting in which `b` (a joining node's) differs from `a` (the job's), named with
// both values; empty when they all match.
std::string SettingsDiff(const v1::JobSettings& a, const v1::JobSettings& b) {
  auto diff = [](const char* name, int64_t x, int64_t y) {
    return x == y ? std::string() : absl::StrCat(name, " ", y, " (the job has ", x, ")");
  };
  for (std::string d :
       {diff("min_nodes", a.min_nodes(), b.min_nodes()), diff("max_nodes", a.max_nodes(), b.max_nodes()),
        diff("max_restarts", a.max_restarts(), b.max_restarts()),
        diff("last_call_timeout_ms", a.last_call_timeout_ms(), b.last_call_timeout_ms()),
        diff("join_timeout_ms", a.join_timeout_ms(), b.join_timeout_ms()),
        diff("heartbeat_timeout_ms", a.heartbeat_timeout_ms(), b.heartbeat_timeout_ms()),
        diff("close_timeout_ms", a.close_timeout_ms(), b.close_timeout_ms())}) {
    if (!d.empty()) return d;
  }
  if (a.keep_survivors() != b.keep_survivors()) {  // Kept workers regroup only with workers that can.
    return absl::StrCat(b.keep_survivors() ? "" : "no ", "--keep-survivors (the job has ",
                        a.keep_survivors() ? "it" : "not", ")");
  }
  return "";
}

absl::Status ValidateJoin(const v1::Join& join) {
  if (join.protocol_version() != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat("protocol version ", join.protocol_version(), " is not ",
                                                      kProtocolVersion, "; run the same elrun version on every node"));
  }
  for (absl::Status s :
       {CheckId("run_id", join.run_id()), CheckId("node_id", join.node_id()), CheckId("role", join.role()),
        CheckRange("nproc", join.nproc(), 1, kMaxNproc), CheckRange("rank_hint", join.rank_hint(), -1, kMaxNodes - 1),
        CheckRange("master_port", join.master_port(), 1, 65535)}) {
    if (!s.ok()) return s;
  }
  // It becomes every worker's MASTER_ADDR: a host name or an address literal, nothing else.
  if (absl::Status s = CheckHostOrAddress("master_addr", join.master_addr()); !s.ok()) return s;
  if (!join.run_key().empty() && join.run_key().size() != kRunKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("run_key has ", join.run_key().size(), " bytes, not ", kRunKeyBytes));
  }
  if (join.run_key().empty() && !join.run_signature().empty()) {
    return absl::InvalidArgumentError("run_signature without run_key");
  }
  const v1::JobSettings& s = join.settings();
  for (absl::Status st : {CheckRange("min_nodes", s.min_nodes(), 1, kMaxNodes),
                          CheckRange("max_nodes", s.max_nodes(), s.min_nodes(), kMaxNodes),
                          CheckRange("max_restarts", s.max_restarts(), 0, 1 << 30),
                          CheckRange("last_call_timeout_ms", s.last_call_timeout_ms(), 0, kMaxTimeoutMs),
                          CheckRange("join_timeout_ms", s.join_timeout_ms(), 1, kMaxTimeoutMs),
                          CheckRange("heartbeat_timeout_ms", s.heartbeat_timeout_ms(), 1, kMaxTimeoutMs),
                          CheckRange("close_timeout_ms", s.close_timeout_ms(), 1, kMaxTimeoutMs)}) {
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace elrun::rdzv
