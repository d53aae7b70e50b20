// Facts about this machine that the launcher needs: device counts for --nproc-per-node, a free
// TCP port, a fresh run id, the host name. Thread-safe.
#ifndef ELRUN_LAUNCHER_HOST_INFO_H_
#define ELRUN_LAUNCHER_HOST_INFO_H_

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "launcher/value_parsers.h"

namespace elrun {

// Online CPUs, and NVIDIA GPUs from /proc/driver/nvidia/gpus limited by CUDA_VISIBLE_DEVICES.
DeviceCounts DetectDevices(const std::map<std::string, std::string>& env);

// A TCP port that is free on every interface right now: bind port 0, read it back, close.
absl::StatusOr<int> PickFreePort();

// 16 random hex digits.
std::string RandomRunId();

std::string HostName();

// True when `host` names this machine: localhost, a loopback address, this host's name, or the
// literal address of one of its interfaces. Never resolves names through DNS.
bool IsLocalHost(const std::string& host);

// This machine's address on the route to host:port (a UDP connect, which sends nothing), as a
// numeric string; nullopt when `host` is not a numeric address or there is no route.
std::optional<std::string> LocalAddressToward(const std::string& host, int port);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_HOST_INFO_H_
