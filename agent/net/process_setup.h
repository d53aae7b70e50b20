// Process-wide settings for elrun's programs that use gRPC (elrun, elrun-rdzv, the scale
// benchmarks' load generators). Call once, first thing in main(), before any thread starts.
#ifndef ELRUN_AGENT_NET_PROCESS_SETUP_H_
#define ELRUN_AGENT_NET_PROCESS_SETUP_H_

namespace elrun {

// Turns off Abseil's Mutex deadlock detection. Debian builds Abseil without NDEBUG, so the
// detector (a debug aid, off in release builds) is on: every absl::Mutex lock - each of gRPC's
// own - walks and updates a global lock graph. perf put 1.5% of elrun-rdzv's samples there with
// 10,000 nodes heartbeating, and about 10% of etcd_load's while 1,000 agents formed.
void SetUpProcess();

}  // namespace elrun

#endif  // ELRUN_AGENT_NET_PROCESS_SETUP_H_
