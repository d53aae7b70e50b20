#include "launcher/os/port_reservation.h"

#include <doctest/doctest.h>

#include <set>
#include <utility>

#include "tests/port_probe.h"

namespace elrun {
namespace {

using testing::BindIPv4;
using testing::PortHeld;

TEST_CASE("a reservation holds a real port until it is destroyed") {
  int port = 0;
  {
    auto held = PortReservation::Take();
    REQUIRE(held.ok());
    port = held->port();
    CHECK(port > 0);
    CHECK(port < 65536);
    CHECK(PortHeld(port));
  }
  CHECK_FALSE(PortHeld(port));
}

TEST_CASE("a listener with SO_REUSEADDR, as PyTorch's TCPStore binds, takes the held port") {
  auto held = PortReservation::Take();
  REQUIRE(held.ok());
  CHECK(BindIPv4(held->port(), /*reuse_address=*/true, /*listen=*/true) == held->port());
  CHECK(PortHeld(held->port()));  // Still held after that listener closed.
}

TEST_CASE("no port-0 bind lands on a held port") {
  auto held = PortReservation::Take();
  REQUIRE(held.ok());
  std::set<int> handed_out;
  for (int i = 0; i < 2000; ++i) {
    int plain = BindIPv4(0, false, false);
    int reusing = BindIPv4(0, true, false);
    REQUIRE(plain > 0);
    REQUIRE(reusing > 0);
    handed_out.insert(plain);
    handed_out.insert(reusing);
  }
  CHECK(handed_out.count(held->port()) == 0);
}

TEST_CASE("two reservations never share a port") {
  auto first = PortReservation::Take();
  auto second = PortReservation::Take();
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(first->port() != second->port());
}

TEST_CASE("moving a reservation moves the hold; assigning over one releases the old port") {
  auto taken = PortReservation::Take();
  REQUIRE(taken.ok());
  int port = taken->port();
  PortReservation moved = std::move(*taken);
  CHECK(moved.port() == port);
  CHECK(PortHeld(port));
  auto next = PortReservation::Take();
  REQUIRE(next.ok());
  int next_port = next->port();
  moved = std::move(*next);
  CHECK(moved.port() == next_port);
  CHECK_FALSE(PortHeld(port));
  CHECK(PortHeld(next_port));
}

}  // namespace
}  // namespace elrun
