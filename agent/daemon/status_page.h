// What elrun-rdzv's --http-listen serves, as text: Prometheus metrics, the jobs as JSON, and a
// status page that renders that JSON live. Every string from agents (node ids, failures) is
// escaped for JSON, and the page inserts text only with textContent, so nothing an agent sends
// becomes markup or script. Pure; thread-safe.
#ifndef ELRUN_AGENT_DAEMON_STATUS_PAGE_H_
#define ELRUN_AGENT_DAEMON_STATUS_PAGE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "agent/coordinator/coordinator.h"
#include "agent/grpc/connection_gate.h"

namespace elrun::rdzv {

// Prometheus text format 0.0.4: elrun_rdzv_* gauges and counters.
std::string MetricsText(const CoordinatorSnapshot& snapshot, const GateCounts& gate);

// {"sessions": N, "jobs": [{"run_id", "phase", "round", "restarts", "max_restarts",
// "min_nodes", "max_nodes", "last_failure", "nodes": [{"node_id", "state", "group_rank",
// "nproc", "master_addr"}]}]}
std::string StatusJson(const CoordinatorSnapshot& snapshot);

// The page: fetches status.json (with the page's own query, so ?token= carries over) every
// second and renders each job. body[data-refreshes] counts the renders.
const std::string& StatusPageHtml();

// A JSON string literal for `text` (quotes included): control characters, quotes, backslash,
// '<', '>' and '&' escaped; bytes that are not valid UTF-8 become U+FFFD.
std::string JsonString(absl::string_view text);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_DAEMON_STATUS_PAGE_H_
