// The version of the rendezvous protocol (proto/rendezvous.proto) an agent speaks: a Join with
// another version is refused with one line naming both. Apart from the coordinator, so an agent
// (elrun's ElasticAgent) names it without linking the coordinator.
#ifndef ELRUN_AGENT_COORDINATOR_PROTOCOL_VERSION_H_
#define ELRUN_AGENT_COORDINATOR_PROTOCOL_VERSION_H_

#include <cstdint>

namespace elrun::rdzv {

// 2: JobSettings.close_timeout_ms. 3: Challenge/Welcome, the token proven, never sent.
// 4: each run bound to its first node's run key (Join.run_key, Join.run_signature).
// 5: Paces and JobPace (stragglers judged across nodes). 6: Progress (each node's goodput).
// 7: Join.holds_survivors and RoundStarted.keep_survivors (--keep-survivors across nodes).
inline constexpr uint32_t kProtocolVersion = 7;

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_COORDINATOR_PROTOCOL_VERSION_H_
