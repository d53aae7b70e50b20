// Listening TCP sockets for "HOST:PORT" ("[V6]:PORT"; port 0 picks a free one; an empty HOST
// or "*" means every address): one non-blocking socket per address HOST resolves to, all on
// the port the first one got. Shared by the connection gate and the HTTP status listener.
#ifndef ELRUN_AGENT_NET_TCP_LISTEN_H_
#define ELRUN_AGENT_NET_TCP_LISTEN_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace elrun::rdzv {

struct TcpListeners {
  std::vector<int> fds;  // Owned by the caller.
  int port = 0;
};

// Errors: not HOST:PORT or unresolvable (InvalidArgument); in use or not local
// (AlreadyExists). Nothing stays open on error.
absl::StatusOr<TcpListeners> ListenTcp(const std::string& listen, int backlog);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_NET_TCP_LISTEN_H_
