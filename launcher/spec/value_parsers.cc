#include "launcher/spec/value_parsers.h"

#include <csignal>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace elrun {
namespace {

constexpr std::pair<const char*, int> kSignalNames[] = {
    {"SIGHUP", SIGHUP},   {"SIGINT", SIGINT},     {"SIGQUIT", SIGQUIT}, {"SIGILL", SIGILL},   {"SIGTRAP", SIGTRAP},
    {"SIGABRT", SIGABRT}, {"SIGBUS", SIGBUS},     {"SIGFPE", SIGFPE},   {"SIGKILL", SIGKILL}, {"SIGUSR1", SIGUSR1},
    {"SIGSEGV", SIGSEGV}, {"SIGUSR2", SIGUSR2},   {"SIGPIPE", SIGPIPE}, {"SIGALRM", SIGALRM}, {"SIGTERM", SIGTERM},
    {"SIGCHLD", SIGCHLD}, {"SIGCONT", SIGCONT},   {"SIGSTOP", SIGSTOP}, {"SIGTSTP", SIGTSTP}, {"SIGTTIN", SIGTTIN},
    {"SIGTTOU", SIGTTOU}, {"SIGURG", SIGURG},     {"SIGXCPU", SIGXCPU}, {"SIGXFSZ", SIGXFSZ}, {"SIGVTALRM", SIGVTALRM},
    {"SIGPROF", SIGPROF}, {"SIGWINCH", SIGWINCH}, {"SIGIO", SIGIO},     {"SIGPWR", SIGPWR},   {"SIGSYS", SIGSYS},
};

// Splits on commas and whitespace, dropping empty pieces.
std::vector<std::string> SplitList(absl::string_view text) {
  return absl::StrSplit(text, absl::ByAnyChar(", \t"), absl::SkipEmpty());
}

absl::StatusOr<StdStreams> ParseStd(absl::string_view text) {
  auto value = ParseInt(text, 0, 3);
  if (!value.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"));
  }
  return static_cast<StdStreams>(*value);
}

}  // namespace

absl::StatusOr<int> ParseInt(absl::string_view text, int min, int max) {
  absl::string_view stripped = absl::StripAsciiWhitespace(text);
  int value = 0;
  bool digits_only = !stripped.empty() && stripped.find_first_not_of("0123456789-+") == absl::string_view::npos;
  if (!digits_only || !absl::SimpleAtoi(stripped, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not an integer"));
  }
  if (value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat(value, " is out of range [", min, ", ", max, "]"));
  }
  return value;
}

absl::StatusOr<std::chrono::milliseconds> ParseSeconds(absl::string_view text) {
  double seconds = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(text), &seconds) || !(seconds >= 0) || seconds > 1e7) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a number of seconds >= 0"));
  }
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0 + 0.5));
}

absl::StatusOr<Endpoint> ParseEndpoint(absl::string_view text) {
  Endpoint endpoint;
  absl::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == absl::string_view::npos) return absl::InvalidArgumentError("missing ']'");
    endpoint.host = std::string(text.substr(1, close - 1));
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') return absl::InvalidArgumentError("expected [HOST]:PORT");
      port_text = text.substr(close + 2);
      if (port_text.empty()) return absl::InvalidArgumentError("no port after ':'");
    }
  } else {
    size_t colon = text.rfind(':');
    bool one_colon = colon != absl::string_view::npos && text.find(':') == colon;
    endpoint.host = std::string(one_colon ? text.substr(0, colon) : text);
    if (one_colon) {
      port_text = text.substr(colon + 1);
      if (port_text.empty()) return absl::InvalidArgumentError("no port after ':'");
    }
  }
  if (endpoint.host.empty()) return absl::InvalidArgumentError("no host");
  if (!port_text.empty()) {
    auto port = ParseInt(port_text, 0, 65535);
    if (!port.ok()) return absl::InvalidArgumentError(absl::StrCat("port ", port.status().message()));
    endpoint.port = *port;
  }
  return endpoint;
}

absl::StatusOr<std::pair<int, int>> ParseNnodes(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  constexpr int kMaxNodes = 1 << 20;
  if (parts.size() == 1) {
    auto n = ParseInt(parts[0], 1, kMaxNodes);
    if (!n.ok()) return absl::InvalidArgumentError("expected N or MIN:MAX with N >= 1");
    return std::make_pair(*n, *n);
  }
  if (parts.size() != 2) return absl::InvalidArgumentError("expected N or MIN:MAX");
  auto min = ParseInt(parts[0], 1, kMaxNodes);
  auto max = ParseInt(parts[1], 1, kMaxNodes);
  if (!min.ok() || !max.ok()) {
    return absl::InvalidArgumentError("expected MIN:MAX with integers >= 1");
  }
  if (*min > *max) {
    return absl::InvalidArgumentError(absl::StrCat("min ", *min, " > max ", *max));
  }
  return std::make_pair(*min, *max);
}

absl::StatusOr<int> ParseNprocPerNode(absl::string_view text, const DeviceCounts& devices) {
  std::string value = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (value == "cpu") return devices.cpus;
  if (value == "gpu") {
    if (devices.gpus == 0) {
      return absl::InvalidArgumentError("no CUDA device found; use a number or 'cpu'");
    }
    return devices.gpus;
  }
  if (value == "auto") return devices.gpus > 0 ? devices.gpus : devices.cpus;
  auto n = ParseInt(value, 1, 4096);
  if (!n.ok()) {
    return absl::InvalidArgumentError("expected a positive integer, 'cpu', 'gpu' or 'auto'");
  }
  return *n;
}

absl::StatusOr<std::map<std::string, std::string>> ParseRdzvConf(absl::string_view text) {
  std::map<std::string, std::string> conf;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    std::string key(absl::StripAsciiWhitespace(kv.first));
    if (key.empty() || item.find('=') == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("'", item, "' is not key=value"));
    }
    if (!conf.emplace(key, std::string(absl::StripAsciiWhitespace(kv.second))).second) {
      return absl::InvalidArgumentError(absl::StrCat("key '", key, "' is given twice"));
    }
  }
  return conf;
}

absl::StatusOr<StdSetting> ParseStdSetting(absl::string_view text) {
  StdSetting setting;
  if (text.find(':') == absl::string_view::npos) {
    auto all = ParseStd(text);
    if (!all.ok()) return all.status();
    setting.all = *all;
    return setting;
  }
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> kv = absl::StrSplit(item, ':');
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("'", item, "' is not local_rank:value"));
    }
    auto rank = ParseInt(kv[0], 0, 4095);
    if (!rank.ok()) return absl::InvalidArgumentError(absl::StrCat("in '", item, "': ", rank.status().message()));
    auto value = ParseStd(kv[1]);
    if (!value.ok()) return value.status();
    if (!setting.per_rank.emplace(*rank, *value).second) {
      return absl::InvalidArgumentError(absl::StrCat("local rank ", *rank, " is given twice"));
    }
  }
  return setting;
}

absl::StatusOr<std::set<int>> ParseRankList(absl::string_view text) {
  std::set<int> ranks;
  for (const std::string& item : SplitList(text)) {
    auto rank = ParseInt(item, 0, 4095);
    if (!rank.ok()) return absl::InvalidArgumentError(absl::StrCat("'", item, "' is not a local rank"));
    ranks.insert(*rank);
  }
  if (ranks.empty()) return absl::InvalidArgumentError("expected local ranks such as 0,1");
  return ranks;
}

absl::StatusOr<std::vector<int>> ParseSignalList(absl::string_view text) {
  std::vector<int> signals;
  for (std::string item : SplitList(text)) {
    item = absl::AsciiStrToUpper(item);
    int signo = 0;
    if (!absl::SimpleAtoi(item, &signo)) {
      std::string name = absl::StartsWith(item, "SIG") ? item : "SIG" + item;
      for (const auto& [known, number] : kSignalNames) {
        if (name == known) signo = number;
      }
    }
    if (signo <= 0 || signo >= NSIG) {
      return absl::InvalidArgumentError(absl::StrCat("'", item, "' is not a signal name"));
    }
    if (signo == SIGKILL || signo == SIGSTOP) {
      return absl::InvalidArgumentError(absl::StrCat(SignalName(signo), " cannot be handled"));
    }
    signals.push_back(signo);
  }
  if (signals.empty()) return absl::InvalidArgumentError("expected signal names such as SIGTERM");
  return signals;
}

std::string SignalName(int signo) {
  for (const auto& [name, number] : kSignalNames) {
    if (number == signo) return name;
  }
  return absl::StrCat("signal ", signo);
}

}  // namespace elrun
