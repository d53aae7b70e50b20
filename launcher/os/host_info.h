// Facts about this machine that the launcher needs: device counts for --nproc-per-node, a fresh
// run id, the host name. Thread-safe.
#ifndef ELRUN_LAUNCHER_OS_HOST_INFO_H_
#define ELRUN_LAUNCHER_OS_HOST_INFO_H_

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "launcher/spec/value_parsers.h"

namespace elrun {

// Online CPUs, and NVIDIA GPUs from /proc/driver/nvidia/gpus limited by CUDA_VISIBLE_DEVICES.
DeviceCounts DetectDevices(const std::map<std::string, std::string>& env);

// 16 random hex digits.
std::string RandomRunId();

std::string HostName();

// True when `host` names this machine: localhost, this host's name, a loopback address or the
// address of one of its interfaces, or another name (an /etc/hosts alias, a Slurm node name)
// that resolves only to such addresses. The client resolves the same name to connect anyway.
bool IsLocalHost(const std::string& host);

// This machine's address on the route to host:port (a UDP connect, which sends nothing), as a
// numeric string; nullopt when `host` is not a numeric address or there is no route.
std::optional<std::string> LocalAddressToward(const std::string& host, int port);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_HOST_INFO_H_
