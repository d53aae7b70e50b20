// The rendezvous settings of a multi-node job, from --rdzv-endpoint, --rdzv-conf and the
// environment (ELRUN_RDZV_TOKEN, ELRUN_RUN_TOKEN, ELRUN_ETCD_PASSWORD). Reads the secret files
// that --rdzv-conf names (token_file, run_token_file, etcd_password_file), nothing else.
// Thread-safe.
#ifndef ELRUN_LAUNCHER_SPEC_RDZV_SETTINGS_H_
#define ELRUN_LAUNCHER_SPEC_RDZV_SETTINGS_H_

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/spec/job_spec.h"

namespace elrun {

struct RdzvSettings {
  std::string host;  // From --rdzv-endpoint; IPv6 without brackets.
  int port = 29400;  // torchrun's default rendezvous port when none is given.
  std::chrono::milliseconds join_timeout{600000};
  std::chrono::milliseconds last_call_timeout{30000};
  std::chrono::milliseconds close_timeout{30000};
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{5000};
  // After losing the coordinator (silent, unreachable; etcd: this node's lease lost), how long a
  // node whose workers it stopped keeps trying to rejoin the job; 0: it leaves at once. Unset:
  // heartbeat_timeout.
  std::optional<std::chrono::milliseconds> rejoin_timeout;
  std::optional<bool> is_host;  // Unset: guess from the endpoint being a local address.
  std::string token;            // Admission to the coordinator. Never logged.
  // The run's own credential on a coordinator that serves many runs; empty: the token is.
  std::string run_token;  // Never logged.
  std::string tls_cert, tls_key, tls_ca;
  // --rdzv-backend etcd-v3: the members (host:port each, IPv6 in brackets), the key prefix,
  // etcd's user and password (never logged), TLS to etcd (tls_* above, or torchrun's cacert,
  // cert, key; protocol=https alone trusts the system's CAs).
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/elrun/rdzv/";
  std::string etcd_user;
  std::string etcd_password;
  bool etcd_https = false;

  std::string Endpoint() const;  // "host:port", IPv6 in brackets.
};

// Keys accepted in --rdzv-conf: elrun's own and torchrun's (keep_alive_interval,
// keep_alive_max_attempt map onto the heartbeat; timeout, read_timeout and store_type are
// accepted and unused). Every error is InvalidArgument naming the key: an unknown key, a bad
// value, an unreadable secret file, or settings that do not go together (heartbeat_timeout not
// above the interval, etcd_user without a password, tls_cert without tls_key or the reverse).
absl::StatusOr<RdzvSettings> ParseRdzvSettings(const JobSpec& spec, const std::map<std::string, std::string>& env);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_SPEC_RDZV_SETTINGS_H_
