// Where a rank's Gloo transport listens: GLOO_SOCKET_IFNAME's interfaces, else this host's address
// on the route to MASTER_ADDR (tests/integration/net_faults_test.py covers two real hosts).
#include "trainer/dist/gloo_device.h"

#include <doctest/doctest.h>

namespace elrun::trainer {
namespace {

TEST_CASE("GLOO_SOCKET_IFNAME names the interfaces, comma-separated, as torch.distributed reads it") {
  auto device = ChooseGlooDevice("eth0,eth1", "10.0.0.1");
  REQUIRE(device.ok());
  CHECK(device->interfaces == std::vector<std::string>{"eth0", "eth1"});
  CHECK(device->address.empty());
}

TEST_CASE("without it, this host's address on the route to the master") {
  auto device = ChooseGlooDevice("", "127.0.0.1");
  REQUIRE(device.ok());
  CHECK(device->interfaces.empty());
  CHECK(device->address == "127.0.0.1");
  CHECK(LocalAddressToward("127.0.0.5").value() == "127.0.0.1");  // Loopback's route: its own address.
  CHECK(LocalAddressToward("::1").value() == "::1");
  CHECK(LocalAddressToward("localhost").ok());
}

TEST_CASE("a master that does not resolve is a one-line error naming it") {
  auto device = ChooseGlooDevice("", "no-such-host.invalid");
  REQUIRE_FALSE(device.ok());
  CHECK(std::string(device.status().message()).rfind("cannot resolve MASTER_ADDR no-such-host.invalid: ", 0) == 0);
}

}  // namespace
}  // namespace elrun::trainer
