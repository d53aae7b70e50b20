// Waiting on a RendezvousClient in tests: the next batch of messages, or the stream's end.
#ifndef ELRUN_TESTS_AGENT_CLIENT_WAIT_H_
#define ELRUN_TESTS_AGENT_CLIENT_WAIT_H_

#include <doctest/doctest.h>
#include <poll.h>

#include "agent/rendezvous_client.h"

namespace elrun::rdzv {

// Waits (10 s at most) until the client has messages or has ended; returns what arrived.
inline std::deque<v1::CoordinatorMessage> Next(RendezvousClient& client) {
  pollfd fd{client.event_fd(), POLLIN, 0};
  REQUIRE(::poll(&fd, 1, 10000) == 1);
  return client.Take();
}

// Waits for the stream's end and returns its status.
inline absl::Status WaitEnded(RendezvousClient& client) {
  for (int i = 0; i < 100 && !client.ended(); ++i) Next(client);
  REQUIRE(client.ended().has_value());
  return *client.ended();
}

}  // namespace elrun::rdzv

#endif  // ELRUN_TESTS_AGENT_CLIENT_WAIT_H_
