#include "launcher/spec/rdzv_settings.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "launcher/spec/value_parsers.h"

namespace elrun {
namespace {

constexpr const char* kKnownKeys =
    "join_timeout, last_call_timeout, close_timeout, heartbeat_interval, heartbeat_timeout, rejoin_timeout, "
    "keep_alive_interval, keep_alive_max_attempt, is_host, token, token_file, run_token, "
    "run_token_file, tls_cert, tls_key, tls_ca, etcd_prefix, etcd_user, etcd_password_file, "
    "protocol, cacert, cert, key, "
    "timeout, read_timeout, store_type";

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

}  // namespace

std::string RdzvSettings::Endpoint() const {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

absl::StatusOr<RdzvSettings> ParseRdzvSettings(const JobSpec& spec, const std::map<std::string, std::string>& env) {
  RdzvSettings settings;
  std::string endpoint = spec.rdzv_endpoint;
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

  std::optional<std::chrono::milliseconds> keep_alive_interval;
  std::optional<int> keep_alive_attempts;
  for (const auto& [key, value] : spec.rdzv_conf) {
    auto seconds = [&](std::chrono::milliseconds* out) -> absl::Status {
      auto parsed = ParseSeconds(value);
      if (!parsed.ok()) return Bad(key, value, parsed.status().message());
      if (parsed->count() <= 0 && key != "last_call_timeout" && key != "rejoin_timeout") {
        return Bad(key, value, "must be > 0");
      }
      *out = *parsed;
      return absl::OkStatus();
    };
    absl::Status status = absl::OkStatus();
    if (key == "join_timeout") {
      status = seconds(&settings.join_timeout);
    } else if (key == "last_call_timeout") {
      status = seconds(&settings.last_call_timeout);
    } else if (key == "close_timeout") {
      status = seconds(&settings.close_timeout);
    } else if (key == "heartbeat_interval") {
      status = seconds(&settings.heartbeat_interval);
    } else if (key == "heartbeat_timeout") {
      status = seconds(&settings.heartbeat_timeout);
    } else if (key == "rejoin_timeout") {
      std::chrono::milliseconds rejoin;
      status = seconds(&rejoin);
      if (status.ok()) settings.rejoin_timeout = rejoin;
    } else if (key == "keep_alive_interval") {
      std::chrono::milliseconds interval;
      status = seconds(&interval);
      keep_alive_interval = interval;
    } else if (key == "keep_alive_max_attempt") {
      auto n = ParseInt(value, 1, 1000);
      if (!n.ok())
        status = Bad(key, value, n.status().message());
      else
        keep_alive_attempts = *n;
    } else if (key == "is_host") {
      auto b = ParseBool(value);
      if (!b.ok())
        status = Bad(key, value, b.status().message());
      else
        settings.is_host = *b;
    } else if (key == "token") {
      settings.token = value;
    } else if (key == "token_file" || key == "run_token_file" || key == "etcd_password_file") {
      auto secret = ReadSecretFile(value);
      if (!secret.ok())
        status = Bad(key, value, secret.status().message());
      else
        (key == "token_file"       ? settings.token
         : key == "run_token_file" ? settings.run_token
                                   : settings.etcd_password) = *secret;
    } else if (key == "run_token") {
      settings.run_token = value;
    } else if (key == "tls_cert" || key == "cert") {  // cert, key, cacert: torchrun's etcd names.
      settings.tls_cert = value;
    } else if (key == "tls_key" || key == "key") {
      settings.tls_key = value;
    } else if (key == "tls_ca" || key == "cacert") {
      settings.tls_ca = value;
    } else if (key == "protocol") {
      std::string p = absl::AsciiStrToLower(value);
      if (p != "http" && p != "https") status = Bad(key, value, "expected http or https");
      settings.etcd_https = p == "https";
    } else if (key == "etcd_prefix") {
      if (value.empty() || value.front() != '/' || value.back() != '/') {
        status = Bad(key, value, "expected a key prefix that starts and ends with /");
      }
      settings.etcd_prefix = value;
    } else if (key == "etcd_user") {
      settings.etcd_user = value;
    } else if (key != "timeout" && key != "read_timeout" && key != "store_type") {
      status =
          absl::InvalidArgumentError(absl::StrCat("--rdzv-conf: unknown key '", key, "' (known: ", kKnownKeys, ")"));
    }
    if (!status.ok()) return status;
  }
  if (keep_alive_interval) settings.heartbeat_interval = *keep_alive_interval;
  if (keep_alive_interval || keep_alive_attempts) {
    settings.heartbeat_timeout = settings.heartbeat_interval * keep_alive_attempts.value_or(5);
  }
  if (!settings.rejoin_timeout) settings.rejoin_timeout = settings.heartbeat_timeout;
  if (settings.heartbeat_timeout <= settings.heartbeat_interval) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rdzv-conf: heartbeat_timeout (", settings.heartbeat_timeout.count(),
                     " ms) must exceed heartbeat_interval (", settings.heartbeat_interval.count(), " ms)"));
  }
  if (settings.token.empty()) {
    auto token = env.find("ELRUN_RDZV_TOKEN");
    if (token != env.end()) settings.token = token->second;
  }
  if (settings.run_token.empty()) {
    auto token = env.find("ELRUN_RUN_TOKEN");
    if (token != env.end()) settings.run_token = token->second;
  }
  if (!settings.etcd_user.empty() && settings.etcd_password.empty()) {
    auto password = env.find("ELRUN_ETCD_PASSWORD");
    if (password == env.end() || password->second.empty()) {
      return absl::InvalidArgumentError(
          "--rdzv-conf etcd_user needs a password: etcd_password_file=PATH or ELRUN_ETCD_PASSWORD");
    }
    settings.etcd_password = password->second;
  }
  if (settings.tls_cert.empty() != settings.tls_key.empty()) {
    return absl::InvalidArgumentError("--rdzv-conf: tls_cert and tls_key go together");
  }
  return settings;
}

}  // namespace elrun
