#include "trainer/dist/process_group.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

extern char** environ;

namespace elrun::trainer {
namespace {

absl::StatusOr<int> IntVar(const std::map<std::string, std::string>& env, const std::string& name, int min,
                           std::optional<int> fallback = std::nullopt) {
  auto it = env.find(name);
  if (it == env.end()) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is not set; start workers with elrun (or torchrun), which sets the env contract"));
  }
  int value = 0;
  if (!absl::SimpleAtoi(it->second, &value) || value < min) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=", it->second, ": expected an integer >= ", min));
  }
  return value;
}

// Until `addr`:`port` accepts a TCP connection or `timeout` passes: c10d's TCPStore client backs
// off for about half a second after a refused connection, which was most of the time a worker
// regrouping in place waited for the store that its peer had started a few milliseconds later
// (measured: the new group after 311-481 ms; with this, 18 ms). Tries every 2 ms; gives up
// quietly (c10d then reports what it finds).
constexpr std::chrono::seconds kAwaitStore{10};

void AwaitListener(const std::string& addr, int port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) return;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (bool connected = false; !connected && std::chrono::steady_clock::now() < deadline;) {
    for (addrinfo* a = found; a != nullptr && !connected; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      connected = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      ::close(fd);
    }
    if (!connected) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::freeaddrinfo(found);
}

}  // namespace

absl::StatusOr<DistEnv> ReadDistEnv(const std::map<std::string, std::string>& env) {
  DistEnv d;
  auto rank = IntVar(env, "RANK", 0, 0);
  auto world = IntVar(env, "WORLD_SIZE", 1, 1);
  auto local = IntVar(env, "LOCAL_RANK", 0, 0);
  auto restarts = IntVar(env, "TORCHELASTIC_RESTART_COUNT", 0, 0);
  if (!rank.ok()) return rank.status();
  if (!world.ok()) return world.status();
  if (!local.ok()) return local.status();
  if (!restarts.ok()) return restarts.status();
  d.restart_count = *restarts;
  d.rank = *rank;
  d.world_size = *world;
  d.local_rank = *local;
  if (d.rank >= d.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("RANK=", d.rank, " is not below WORLD_SIZE=", d.world_size));
  }
  if (d.world_size > 1) {
    auto port = IntVar(env, "MASTER_PORT", 1);
    if (!port.ok()) return port.status();
    d.master_port = *port;
    auto addr = env.find("MASTER_ADDR");
    if (addr == env.end() || addr->second.empty()) {
      return absl::InvalidArgumentError("MASTER_ADDR is not set");
    }
    d.master_addr = addr->second;
  }
  return d;
}

absl::StatusOr<Dist> InitProcessGroup(const DistEnv& env, BackendKind backend, int cuda_device,
                                      std::chrono::milliseconds timeout, bool await_store) {
  try {
    Dist dist;
    dist.env = env;
    dist.backend = backend;
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(env.world_size > 1 ? env.master_port : 0);
    options.isServer = env.rank == 0;
    options.numWorkers = env.world_size;
    options.waitWorkers = false;
    options.timeout = timeout;
    if (await_store && !options.isServer && env.world_size > 1) {
      AwaitListener(env.master_addr, env.master_port, std::min<std::chrono::milliseconds>(timeout, kAwaitStore));
    }
    GlooDevice device;
    if (backend != BackendKind::kNccl) {
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      absl::StatusOr<GlooDevice> chosen = ChooseGlooDevice(ifname == nullptr ? "" : ifname, env.master_addr);
      if (!chosen.ok())
        return absl::UnavailableError(absl::StrCat("process group (gloo): ", chosen.status().message()));
      device = *std::move(chosen);
    }
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    // elrun gives each attempt a fresh store (a new port); torchrun's agent store outlives one
    // (TORCHELASTIC_USE_AGENT_STORE): the attempt in the prefix keeps their keys apart there.
    dist.store = c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("elrun/attempt_", env.restart_count), tcp);
    dist.pg = backend == BackendKind::kNccl
                  ? MakeNcclBackend(dist.store, env.rank, env.world_size, cuda_device, timeout)
                  : MakeGlooBackend(dist.store, env.rank, env.world_size, device, timeout);
    return dist;
  } catch (const c10::Error& error) {
    return absl::UnavailableError(
        absl::StrCat("process group (", BackendName(backend), "): ", error.what_without_backtrace()));
  } catch (const std::exception& error) {
    return absl::UnavailableError(absl::StrCat("process group (", BackendName(backend), "): ", error.what()));
  }
}

absl::StatusOr<Dist> InitProcessGroupFromEnvironment(BackendKind backend, std::chrono::milliseconds timeout) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  absl::StatusOr<DistEnv> dist_env = ReadDistEnv(env);
  if (!dist_env.ok()) return dist_env.status();
  return InitProcessGroup(*dist_env, backend, dist_env->local_rank, timeout);
}

}  // namespace elrun::trainer
