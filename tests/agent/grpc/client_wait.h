// Waiting on a RendezvousClient in tests: the next batch of messages, or the stream's end.
#ifndef ELRUN_TESTS_AGENT_GRPC_CLIENT_WAIT_H_
#define ELRUN_TESTS_AGENT_GRPC_CLIENT_WAIT_H_

#include <doctest/doctest.h>
#include <poll.h>

#include "agent/coordinator/session_auth.h"
#include "agent/grpc/rendezvous_client.h"

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

// An agent's side of the session's start, as elrun does it: waits for the Challenge, sends
// `join` with a fresh nonce and its proof of `token` (none when empty). Returns the messages
// that arrived with the Challenge after it (none normally).
inline std::deque<v1::CoordinatorMessage> SendFirstJoin(RendezvousClient& client, v1::AgentMessage join,
                                                        const std::string& token, std::string* client_nonce = nullptr,
                                                        std::string* server_nonce = nullptr) {
  std::deque<v1::CoordinatorMessage> got = Next(client);
  REQUIRE_FALSE(got.empty());
  REQUIRE(got.front().has_challenge());
  std::string nonce = got.front().challenge().nonce();
  got.pop_front();
  std::string mine = RandomNonce();
  join.mutable_join()->set_client_nonce(mine);
  if (!token.empty()) {
    join.mutable_join()->set_proof(
        AgentProof(TokenKey(token), nonce, mine, join.join().run_id(), join.join().node_id()));
  }
  REQUIRE(client.Write(join));
  if (client_nonce != nullptr) *client_nonce = mine;
  if (server_nonce != nullptr) *server_nonce = nonce;
  return got;
}

// The messages after the Welcome that answers a first Join; checks the coordinator's proof of
// `token` (empty: none expected).
inline std::deque<v1::CoordinatorMessage> AfterWelcome(RendezvousClient& client, const std::string& token,
                                                       const std::string& client_nonce,
                                                       const std::string& server_nonce) {
  std::deque<v1::CoordinatorMessage> got;
  for (int i = 0; i < 10 && got.empty(); ++i) got = Next(client);
  REQUIRE_FALSE(got.empty());
  REQUIRE(got.front().has_welcome());
  if (!token.empty()) {
    CHECK(ProofEquals(got.front().welcome().proof(), CoordinatorProof(TokenKey(token), server_nonce, client_nonce)));
  }
  got.pop_front();
  if (got.empty()) got = Next(client);
  return got;
}

}  // namespace elrun::rdzv

#endif  // ELRUN_TESTS_AGENT_GRPC_CLIENT_WAIT_H_
