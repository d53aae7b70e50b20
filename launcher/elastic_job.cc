#include "launcher/elastic_job.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/support/log.h>

#include <optional>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "agent/coordinator_server.h"
#include "agent/rendezvous_client.h"
#include "agent/wire_checks.h"
#include "launcher/attempt_builder.h"
#include "launcher/elastic_agent.h"
#include "launcher/host_info.h"
#include "launcher/job_runtime.h"

namespace elrun {
namespace {

namespace v1 = rdzv::v1;

// The agent's session over the gRPC client: sends only queue (the client's writer thread sends).
class ClientSession : public RendezvousSession {
 public:
  explicit ClientSession(rdzv::RendezvousClient& client) : client_(client) {}
  void Send(const v1::AgentMessage& message) override {
    client_.Write(message);  // A broken stream shows up as the client's end.
  }

 private:
  rdzv::RendezvousClient& client_;
};

// gRPC's own log lines (e.g. a failed bind while probing for the coordinator's port) would
// clutter the user's console; show them only with LOGLEVEL=DEBUG.
void RouteGrpcLogs() {
  gpr_set_log_function([](gpr_log_func_args* args) {
    spdlog::debug("grpc: {}", args->message);
  });
}

}  // namespace

int RunElasticJob(const JobSpec& spec, const std::map<std::string, std::string>& env,
                  const std::vector<std::string>& argv_template, const RdzvSettings& rdzv) {
  RouteGrpcLogs();
  // The runtime first: it blocks the handled signals, and gRPC's threads (server, client) must
  // inherit that mask, or a SIGTERM delivered to one of them would kill elrun outright instead
  // of being forwarded. It also forks the guardian while the process has a single thread.
  ElasticAgent* agent_ptr = nullptr;
  auto runtime = JobRuntime::Create(spec, env, spec.rdzv_id, [&agent_ptr](int pid, ExitStatus status) {
    agent_ptr->OnWorkerExit(pid, status);
  });
  if (!runtime.ok()) {
    PrintError(std::string(runtime.status().message()));
    return kExitJobFailed;
  }
  JobRuntime& rt = **runtime;
  // The coordinator, embedded when the endpoint is this machine and its port is free.
  std::unique_ptr<rdzv::CoordinatorServer> server;
  bool want_host = rdzv.is_host.value_or(IsLocalHost(rdzv.host));
  if (want_host) {
    rdzv::ServerOptions options;
    options.listen = rdzv.Endpoint();
    options.token = rdzv.token;
    options.tls = {rdzv.tls_cert, rdzv.tls_key, rdzv.tls_ca};
    auto started = rdzv::CoordinatorServer::Start(options);
    if (started.ok()) {
      server = *std::move(started);
      spdlog::info("hosting the rendezvous coordinator on {}", rdzv.Endpoint());
    } else if (rdzv.is_host.value_or(false) || started.status().code() != absl::StatusCode::kAlreadyExists) {
      PrintError(absl::StrCat("cannot host the rendezvous on ", rdzv.Endpoint(), ": ",
                              started.status().message()));
      return kExitJobFailed;
    }
  }

  rdzv::ClientOptions client_options;
  client_options.endpoint = rdzv.Endpoint();
  client_options.tls = {rdzv.tls_cert, rdzv.tls_key, rdzv.tls_ca};
  client_options.connect_timeout = rdzv.join_timeout;
  client_options.silence_timeout = rdzv.heartbeat_timeout;
  auto client = rdzv::RendezvousClient::Open(client_options);
  if (!client.ok()) {
    PrintError(std::string(client.status().message()));
    return kExitJobFailed;
  }

  std::string master_addr = spec.local_addr;
  if (master_addr.empty()) {
    master_addr = LocalAddressToward(rdzv.host, rdzv.port).value_or(
        IsLocalHost(rdzv.host) ? "127.0.0.1" : HostName());
  }
  if (absl::Status s = rdzv::CheckHostOrAddress("--local-addr", master_addr); !s.ok()) {
    PrintError(std::string(s.message()));
    return kExitJobFailed;
  }

  AttemptBuilder builder(spec, argv_template, spec.rdzv_id, rt.layout(), env, PickFreePort);
  rt.PrepareBuilder(builder);
  ClientSession session(**client);
  RealClock clock;
  ElasticAgent agent(spec, rdzv, rt.table(), clock, session, builder, master_addr,
                     absl::StrCat(HostName(), ":", ::getpid(), ":", RandomRunId().substr(0, 6)),
                     PickFreePort);
  agent_ptr = &agent;
  rt.OnWatchdogSignal([&agent](int pid, const std::string& why) { agent.OnWorkerSignalled(pid, why); });

  absl::Status status = rt.HandleSignals([&](int signo) { agent.OnSignal(signo); });
  rdzv::RendezvousClient& stream = **client;
  auto on_client_event = [&] {
    for (const v1::CoordinatorMessage& message : stream.Take()) agent.OnMessage(message);
    if (std::optional<absl::Status> ended = stream.ended()) agent.OnSessionEnded(*ended);
  };
  if (status.ok()) status = rt.loop().Add(stream.event_fd(), on_client_event);
  if (status.ok()) {
    agent.Start();
    status = rt.RunUntil([&] { return agent.done(); }, [&] { return agent.Deadline(); },
                         [&] { agent.OnDeadline(); });
  }
  rt.loop().Remove((*client)->event_fd());
  if (!status.ok()) {
    PrintError(std::string(status.message()));
    return kExitJobFailed;
  }
  int code = agent.exit_code();
  if (code == kExitJobFailed) {
    if (agent.failed() != nullptr) {
      PrintFailureReport(spec, *agent.failed(), spec.rdzv_id, agent.group_rank(), env);
    } else if (!agent.end_detail().empty()) {
      WriteLauncherErrorFile(env, "ChildFailedError", agent.end_detail());
    } else if (!agent.rendezvous_error().empty()) {
      WriteLauncherErrorFile(env, "RendezvousError", agent.rendezvous_error());
    }
    if (!agent.end_detail().empty()) PrintError(absl::StrCat("the job failed: ", agent.end_detail()));
  }
  client->reset();  // Leave the rendezvous.
  if (server) {
    // The other nodes may not have read the job's end yet: keep serving until they have all
    // left, for close_timeout at most.
    if (!server->coordinator().WaitUntilJobGone(spec.rdzv_id,
                                                std::chrono::steady_clock::now() + rdzv.close_timeout)) {
      spdlog::warn("nodes of run {} still connected {} s after the job ended; stopping the "
                   "coordinator", spec.rdzv_id, rdzv.close_timeout.count() / 1000.0);
    }
    server->Shutdown();
  }
  return code;
}

}  // namespace elrun
