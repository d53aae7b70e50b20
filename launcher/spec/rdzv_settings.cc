#include "launcher/spec/rdzv_settings.h"

#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "launcher/spec/value_parsers.h"

namespace elrun {
namespace {

absl::Status Bad(const std::string& key, const std::string& value, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("--rdzv-conf ", key, "=", value, ": ", why));
}

// A secret from a file (first line's worth, trailing whitespace dropped); keeps it out of the
// command line (/proc/PID/cmdline) and the environment.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  std::string secret = std::string(absl::StripTrailingAsciiWhitespace(contents.str()));
  if (!in || secret.empty()) return absl::InvalidArgumentError("cannot read a token from this file");
  return secret;
}

absl::StatusOr<bool> ParseBool(const std::string& value) {
  std::string v = absl::AsciiStrToLower(value);
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  return absl::InvalidArgumentError("expected true or false");
}

// torchrun's keep_alive_* keys, resolved onto the heartbeat once every key is read.
struct KeepAlive {
  std::optional<std::chrono::milliseconds> interval;
  std::optional<int> attempts;
};

// One --rdzv-conf key: applies `value` to the settings, or returns why it cannot (the caller
// names the key and the value).
using ConfSetter = absl::Status (*)(const std::string& value, RdzvSettings& settings, KeepAlive& keep_alive);

struct ConfKey {
  const char* name;
  ConfSetter set;
};

// A duration in seconds into `out`: above 0, or at least 0 when `zero_ok`.
absl::Status SetSeconds(const std::string& value, bool zero_ok, std::chrono::milliseconds* out) {
  auto parsed = ParseSeconds(value);
  if (!parsed.ok()) return parsed.status();
  if (parsed->count() <= 0 && !zero_ok) return absl::InvalidArgumentError("must be > 0");
  *out = *parsed;
  return absl::OkStatus();
}

absl::Status SetSecret(const std::string& path, std::string* out) {
  auto secret = ReadSecretFile(path);
  if (!secret.ok()) return secret.status();
  *out = *std::move(secret);
  return absl::OkStatus();
}

absl::Status Accept(const std::string&, RdzvSettings&, KeepAlive&) { return absl::OkStatus(); }

// A key whose value is the setting as given.
template <std::string RdzvSettings::*field>
absl::Status SetText(const std::string& value, RdzvSettings& settings, KeepAlive&) {
  settings.*field = value;
  return absl::OkStatus();
}

// Every key --rdzv-conf accepts, in the order the unknown-key error lists them. cert, key and
// cacert are torchrun's etcd names for tls_*; timeout, read_timeout and store_type are
// torchrun's c10d keys, accepted and unused.
constexpr ConfKey kConfKeys[] = {
    {"join_timeout",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) { return SetSeconds(v, false, &s.join_timeout); }},
    {"last_call_timeout",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) { return SetSeconds(v, true, &s.last_call_timeout); }},
    {"close_timeout",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) { return SetSeconds(v, false, &s.close_timeout); }},
    {"heartbeat_interval",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) { return SetSeconds(v, false, &s.heartbeat_interval); }},
    {"heartbeat_timeout",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) { return SetSeconds(v, false, &s.heartbeat_timeout); }},
    {"rejoin_timeout",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) {
       std::chrono::milliseconds rejoin;
       absl::Status status = SetSeconds(v, true, &rejoin);
       if (status.ok()) s.rejoin_timeout = rejoin;
       return status;
     }},
    {"keep_alive_interval",
     [](const std::string& v, RdzvSettings&, KeepAlive& k) {
       std::chrono::milliseconds interval;
       absl::Status status = SetSeconds(v, false, &interval);
       if (status.ok()) k.interval = interval;
       return status;
     }},
    {"keep_alive_max_attempt",
     [](const std::string& v, RdzvSettings&, KeepAlive& k) {
       auto n = ParseInt(v, 1, 1000);
       if (!n.ok()) return n.status();
       k.attempts = *n;
       return absl::OkStatus();
     }},
    {"is_host",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) {
       auto b = ParseBool(v);
       if (!b.ok()) return b.status();
       s.is_host = *b;
       return absl::OkStatus();
     }},
    {"token", SetText<&RdzvSettings::token>},
    {"token_file", [](const std::string& v, RdzvSettings& s, KeepAlive&) { return SetSecret(v, &s.token); }},
    {"run_token", SetText<&RdzvSettings::run_token>},
    {"run_token_file", [](const std::string& v, RdzvSettings& s, KeepAlive&) { return SetSecret(v, &s.run_token); }},
    {"tls_cert", SetText<&RdzvSettings::tls_cert>},
    {"tls_key", SetText<&RdzvSettings::tls_key>},
    {"tls_ca", SetText<&RdzvSettings::tls_ca>},
    {"etcd_prefix",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) {
       s.etcd_prefix = v;
       if (v.empty() || v.front() != '/' || v.back() != '/') {
         return absl::InvalidArgumentError("expected a key prefix that starts and ends with /");
       }
       return absl::OkStatus();
     }},
    {"etcd_user", SetText<&RdzvSettings::etcd_user>},
    {"etcd_password_file",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) { return SetSecret(v, &s.etcd_password); }},
    {"protocol",
     [](const std::string& v, RdzvSettings& s, KeepAlive&) {
       const std::string p = absl::AsciiStrToLower(v);
       s.etcd_https = p == "https";
       if (p != "http" && p != "https") return absl::InvalidArgumentError("expected http or https");
       return absl::OkStatus();
     }},
    {"cacert", SetText<&RdzvSettings::tls_ca>},
    {"cert", SetText<&RdzvSettings::tls_cert>},
    {"key", SetText<&RdzvSettings::tls_key>},
    {"timeout", Accept},
    {"read_timeout", Accept},
    {"store_type", Accept},
};

// Applies one --rdzv-conf key; InvalidArgument naming it when it is unknown or its value is bad.
absl::Status ApplyConfKey(const std::string& key, const std::string& value, RdzvSettings& settings,
                          KeepAlive& keep_alive) {
  for (const ConfKey& known : kConfKeys) {
    if (key != known.name) continue;
    absl::Status status = known.set(value, settings, keep_alive);
    return status.ok() ? status : Bad(key, value, status.message());
  }
  std::vector<std::string> names;
  for (const ConfKey& known : kConfKeys) names.push_back(known.name);
  return absl::InvalidArgumentError(
      absl::StrCat("--rdzv-conf: unknown key '", key, "' (known: ", absl::StrJoin(names, ", "), ")"));
}

// --rdzv-endpoint: the coordinator's HOST[:PORT], or etcd's members (a comma-separated list).
absl::Status ReadEndpoints(const JobSpec& spec, RdzvSettings& settings) {
  const std::string& endpoint = spec.rdzv_endpoint;
  if (endpoint.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--rdzv-backend=", spec.rdzv_backend,
                                                   " with --nnodes=", spec.min_nodes, ":", spec.max_nodes,
                                                   " needs --rdzv-endpoint HOST[:PORT] (the same on every node)"));
  }
  const bool etcd = spec.rdzv_backend == "etcd-v3";
  for (absl::string_view member : absl::StrSplit(endpoint, ',')) {
    auto parsed = ParseEndpoint(member);
    if (!parsed.ok() || (!etcd && !settings.host.empty())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rdzv-endpoint=", endpoint, ": ",
          parsed.ok() ? "one coordinator only (a list is for --rdzv-backend etcd-v3)" : parsed.status().message()));
    }
    if (settings.host.empty()) {
      settings.host = parsed->host;
      settings.port = parsed->port.value_or(etcd ? 2379 : settings.port);
    }
    if (etcd) {
      int port = parsed->port.value_or(2379);
      if (port == 0) return absl::InvalidArgumentError(absl::StrCat("--rdzv-endpoint=", endpoint, ": port 0"));
      settings.etcd_endpoints.push_back(parsed->host.find(':') != std::string::npos
                                            ? absl::StrCat("[", parsed->host, "]:", port)
                                            : absl::StrCat(parsed->host, ":", port));
    }
  }
  return absl::OkStatus();
}

// The heartbeat from torchrun's keep_alive_* keys, the rejoin timeout's default, and their check.
absl::Status ResolveHeartbeat(const KeepAlive& keep_alive, RdzvSettings& settings) {
  if (keep_alive.interval) settings.heartbeat_interval = *keep_alive.interval;
  if (keep_alive.interval || keep_alive.attempts) {
    settings.heartbeat_timeout = settings.heartbeat_interval * keep_alive.attempts.value_or(5);
  }
  if (!settings.rejoin_timeout) settings.rejoin_timeout = settings.heartbeat_timeout;
  if (settings.heartbeat_timeout <= settings.heartbeat_interval) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rdzv-conf: heartbeat_timeout (", settings.heartbeat_timeout.count(),
                     " ms) must exceed heartbeat_interval (", settings.heartbeat_interval.count(), " ms)"));
  }
  return absl::OkStatus();
}

// Secrets not given in --rdzv-conf, from the environment; the TLS pair's check.
absl::Status ReadSecretsFromEnvironment(const std::map<std::string, std::string>& env, RdzvSettings& settings) {
  auto from_env = [&](const char* name, std::string& out) {
    auto it = env.find(name);
    if (out.empty() && it != env.end()) out = it->second;
  };
  from_env("ELRUN_RDZV_TOKEN", settings.token);
  from_env("ELRUN_RUN_TOKEN", settings.run_token);
  if (!settings.etcd_user.empty() && settings.etcd_password.empty()) {
    from_env("ELRUN_ETCD_PASSWORD", settings.etcd_password);
    if (settings.etcd_password.empty()) {
      return absl::InvalidArgumentError(
          "--rdzv-conf etcd_user needs a password: etcd_password_file=PATH or ELRUN_ETCD_PASSWORD");
    }
  }
  if (settings.tls_cert.empty() != settings.tls_key.empty()) {
    return absl::InvalidArgumentError("--rdzv-conf: tls_cert and tls_key go together");
  }
  return absl::OkStatus();
}

}  // namespace

std::string RdzvSettings::Endpoint() const {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

absl::StatusOr<RdzvSettings> ParseRdzvSettings(const JobSpec& spec, const std::map<std::string, std::string>& env) {
  RdzvSettings settings;
  if (absl::Status s = ReadEndpoints(spec, settings); !s.ok()) return s;
  KeepAlive keep_alive;
  for (const auto& [key, value] : spec.rdzv_conf) {
    if (absl::Status s = ApplyConfKey(key, value, settings, keep_alive); !s.ok()) return s;
  }
  if (absl::Status s = ResolveHeartbeat(keep_alive, settings); !s.ok()) return s;
  if (absl::Status s = ReadSecretsFromEnvironment(env, settings); !s.ok()) return s;
  return settings;
}

}  // namespace elrun
