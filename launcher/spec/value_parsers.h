// Parsers for the values of elrun's options (torchrun's formats). Pure functions, thread-safe.
// Each returns InvalidArgument with a short reason that names no flag; the caller prefixes
// "<flag>=<value>: " so that the user sees one line naming the input, the problem and the fix.
#ifndef ELRUN_LAUNCHER_SPEC_VALUE_PARSERS_H_
#define ELRUN_LAUNCHER_SPEC_VALUE_PARSERS_H_

#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "launcher/spec/job_spec.h"

namespace elrun {

// A whole decimal integer in [min, max]; no sign games, no trailing junk.
absl::StatusOr<int> ParseInt(absl::string_view text, int min, int max);

// A non-negative number of seconds ("30", "0.5").
absl::StatusOr<std::chrono::milliseconds> ParseSeconds(absl::string_view text);

// --nnodes: "N" or "MIN:MAX", 1 <= MIN <= MAX.
absl::StatusOr<std::pair<int, int>> ParseNnodes(absl::string_view text);

// --rdzv-endpoint: "HOST", "HOST:PORT" or "[V6]:PORT" (a bare IPv6 address has no port);
// the host without brackets, the port when given (0-65535).
struct Endpoint {
  std::string host;
  std::optional<int> port;
};
absl::StatusOr<Endpoint> ParseEndpoint(absl::string_view text);

// What the machine offers to --nproc-per-node's symbolic values.
struct DeviceCounts {
  int cpus = 1;
  int gpus = 0;
};

// --nproc-per-node: a positive integer, "cpu" (cores), "gpu" (CUDA devices, an error when there
// are none) or "auto" (GPUs when there are any, else cores).
absl::StatusOr<int> ParseNprocPerNode(absl::string_view text, const DeviceCounts& devices);

// --rdzv-conf: "k=v,k2=v2"; empty keys, missing '=' and repeated keys are errors.
absl::StatusOr<std::map<std::string, std::string>> ParseRdzvConf(absl::string_view text);

// --redirects / --tee: "0".."3" for every rank, or "rank:value,..." per local rank.
absl::StatusOr<StdSetting> ParseStdSetting(absl::string_view text);

// --local-ranks-filter: "0,2" (commas or spaces).
absl::StatusOr<std::set<int>> ParseRankList(absl::string_view text);

// --signals-to-handle: "SIGTERM,SIGINT" or numbers; only signals that can be caught.
absl::StatusOr<std::vector<int>> ParseSignalList(absl::string_view text);

// "SIGTERM" for 15; "signal 64" for numbers without a name.
std::string SignalName(int signo);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_SPEC_VALUE_PARSERS_H_
