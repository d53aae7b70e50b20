// Checks on what crosses the wire between the agents and the coordinator, shared by both
// sides: everything from the network is hostile until one of these has passed it. Pure;
// thread-safe.
#ifndef ELRUN_AGENT_COORDINATOR_WIRE_CHECKS_H_
#define ELRUN_AGENT_COORDINATOR_WIRE_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/rendezvous.pb.h"

namespace elrun::rdzv {

// True for an IPv4 or IPv6 literal (without brackets) or an RFC 1123 host name: dot-separated
// labels of 1-63 letters, digits and hyphens (underscores too, which real host names carry),
// not starting or ending with a hyphen, 253 characters at most. Nothing else may become a
// worker's MASTER_ADDR.
bool IsHostOrAddress(absl::string_view text);

// InvalidArgument naming `what` unless IsHostOrAddress(value).
absl::Status CheckHostOrAddress(absl::string_view what, absl::string_view value);

// What an agent knows about its job, to check a RoundStarted against.
struct RoundExpectations {
  int nproc = 1;  // This node's workers.
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;
  uint64_t last_round = 0;  // The last round this agent took part in (0: none yet).
};

// InvalidArgument naming the first field of `round` that no honest coordinator of this job
// could have sent (negative sizes, ranks outside the world, a port outside 1-65535, a master
// address that is not a host, more restarts than the job allows, an old round).
absl::Status ValidateRoundStarted(const v1::RoundStarted& round, const RoundExpectations& expect);

// `text` from another machine made safe for a console or a log line: valid UTF-8 printable
// characters stay; control characters (C0, DEL, C1), Unicode bidi overrides and invalid bytes
// become \xNN or \u{NNNN} escapes (newline, carriage return and tab: \n, \r, \t), a backslash
// becomes "\\". Cut to `max_bytes` of input, with "..." when cut.
std::string EscapeForConsole(absl::string_view text, size_t max_bytes = 4096);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_COORDINATOR_WIRE_CHECKS_H_
