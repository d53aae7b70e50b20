// Where this rank's Gloo transport listens, as PyTorch chooses it for a Python worker (its
// c10d bindings) but without the hostname pitfall: GLOO_SOCKET_IFNAME's interfaces when set
// (comma-separated, as torch.distributed reads it); otherwise this host's address on the route to
// MASTER_ADDR, which every other rank can reach as the master does. (PyTorch resolves the host's
// name instead, which on many hosts is 127.0.1.1: ranks on other hosts then cannot connect.)
// No LibTorch here; the address is found with a connected UDP socket, which sends nothing.
#ifndef ELRUN_TRAINER_DIST_GLOO_DEVICE_H_
#define ELRUN_TRAINER_DIST_GLOO_DEVICE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace elrun::trainer {

struct GlooDevice {
  std::vector<std::string> interfaces;  // GLOO_SOCKET_IFNAME's; when empty, `address`.
  std::string address;                  // A numeric IPv4 or IPv6 address of this host.
};

// This host's numeric address on the route to `host` (a name or a literal). An error names the
// host when it does not resolve or no route leads there.
absl::StatusOr<std::string> LocalAddressToward(const std::string& host);

// The device for a rank whose master is `master_addr`; `socket_ifname` is GLOO_SOCKET_IFNAME's
// value (empty when unset).
absl::StatusOr<GlooDevice> ChooseGlooDevice(const std::string& socket_ifname, const std::string& master_addr);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_DIST_GLOO_DEVICE_H_
