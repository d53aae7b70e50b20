#include "launcher/job/elastic_job.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpc/support/log.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/coordinator/wire_checks.h"
#include "agent/etcd/etcd_rendezvous.h"
#include "agent/grpc/coordinator_server.h"
#include "agent/grpc/rendezvous_client.h"
#include "launcher/job/elastic_agent.h"
#include "launcher/job/job_report.h"
#include "launcher/job/job_runtime.h"
#include "launcher/os/host_info.h"
#include "launcher/os/port_reservation.h"
#include "launcher/report/console.h"
#include "launcher/report/round_history.h"
#include "launcher/spec/job_spec.h"
#include "launcher/worker/attempt_builder.h"

namespace elrun {
namespace {

namespace v1 = rdzv::v1;

// The agent's session over its channel: sends only queue (the channel's writer thread sends).
// Use() moves it to a new channel after the last one was lost.
class ClientSession : public RendezvousSession {
 public:
  explicit ClientSession(rdzv::AgentChannel* channel) : channel_(channel) {}
  void Use(rdzv::AgentChannel* channel) { channel_ = channel; }
  void Send(const v1::AgentMessage& message) override {
    channel_->Write(message);  // A broken session shows up as the channel's end.
  }

 private:
  rdzv::AgentChannel* channel_;
};

// The etcd-v3 backend's channel: this node's session in the job's rendezvous in etcd.
absl::StatusOr<std::unique_ptr<rdzv::AgentChannel>> OpenEtcd(const JobSpec& spec, const RdzvSettings& rdzv,
                                                             const std::string& node_id,
                                                             std::chrono::milliseconds connect_timeout) {
  rdzv::EtcdRendezvousOptions options;
  options.etcd.endpoints = rdzv.etcd_endpoints;
  options.etcd.tls = {rdzv.tls_cert, rdzv.tls_key, rdzv.tls_ca};
  options.etcd.https = rdzv.etcd_https;
  options.etcd.user = rdzv.etcd_user;
  options.etcd.password = rdzv.etcd_password;
  options.prefix = rdzv.etcd_prefix;
  options.run_id = spec.rdzv_id;
  options.node_id = node_id;
  options.lease_ttl = rdzv.heartbeat_timeout;
  options.first_join_timeout = connect_timeout;
  options.token = rdzv.token;
  auto opened = rdzv::EtcdRendezvous::Open(options);
  if (!opened.ok()) {
    return absl::Status(opened.status().code(),
                        absl::StrCat("cannot join the rendezvous in etcd at ", absl::StrJoin(rdzv.etcd_endpoints, ","),
                                     ": ", opened.status().message()));
  }
  return std::unique_ptr<rdzv::AgentChannel>(*std::move(opened));
}

// gRPC's own log lines (e.g. a failed bind while probing for the coordinator's port) would
// clutter the user's console; show them only with LOGLEVEL=DEBUG.
void RouteGrpcLogs() {
  gpr_set_log_function([](gpr_log_func_args* args) { spdlog::debug("grpc: {}", args->message); });
}

// Hosts the coordinator when the endpoint is this machine and its port is free (or
// --rdzv-conf is_host says so). nullptr when another process hosts it; an error, one line, when
// this node must host it and cannot.
absl::StatusOr<std::unique_ptr<rdzv::CoordinatorServer>> MaybeHostCoordinator(const JobSpec& spec,
                                                                              const RdzvSettings& rdzv) {
  const bool etcd = spec.rdzv_backend == "etcd-v3";
  if (etcd || !rdzv.is_host.value_or(IsLocalHost(rdzv.host))) return nullptr;
  rdzv::ServerOptions options;
  options.listen = rdzv.Endpoint();
  options.token = rdzv.token;
  options.tls = {rdzv.tls_cert, rdzv.tls_key, rdzv.tls_ca};
  auto started = rdzv::CoordinatorServer::Start(options);
  if (started.ok()) {
    spdlog::info("hosting the rendezvous coordinator on {}", rdzv.Endpoint());
    return *std::move(started);
  }
  if (rdzv.is_host.value_or(false) || started.status().code() != absl::StatusCode::kAlreadyExists) {
    return absl::Status(started.status().code(), absl::StrCat("cannot host the rendezvous on ", rdzv.Endpoint(), ": ",
                                                              started.status().message()));
  }
  return nullptr;  // Another elrun on this machine hosts it.
}

// This node's channel to the rendezvous as `node_id`: its session in etcd, or its stream to the
// coordinator, which it waits up to connect_timeout to reach.
absl::StatusOr<std::unique_ptr<rdzv::AgentChannel>> OpenChannel(const JobSpec& spec, const RdzvSettings& rdzv,
                                                                const std::string& node_id,
                                                                std::chrono::milliseconds connect_timeout) {
  if (spec.rdzv_backend == "etcd-v3") return OpenEtcd(spec, rdzv, node_id, connect_timeout);
  rdzv::ClientOptions options;
  options.endpoint = rdzv.Endpoint();
  options.tls = {rdzv.tls_cert, rdzv.tls_key, rdzv.tls_ca};
  options.connect_timeout = connect_timeout;
  // The coordinator drops this node heartbeat_timeout after the last heartbeat it got, at most
  // one interval before the first one that goes unanswered: a node cut off notices no later,
  // and stops its workers before the others can form a round without it.
  options.silence_timeout = rdzv.heartbeat_timeout - rdzv.heartbeat_interval;
  auto opened = rdzv::RendezvousClient::Open(options);
  if (!opened.ok()) return opened.status();
  return std::unique_ptr<rdzv::AgentChannel>(*std::move(opened));
}

// The address this node's workers publish as MASTER_ADDR when it is group rank 0: --local-addr,
// else the local address that routes toward the rendezvous host (127.0.0.1 for a local one,
// the host name when nothing routes). InvalidArgument, one line, for a malformed one.
absl::StatusOr<std::string> ResolveMasterAddr(const JobSpec& spec, const RdzvSettings& rdzv) {
  std::string master_addr = spec.local_addr;
  if (master_addr.empty()) {
    master_addr = LocalAddressToward(rdzv.host, rdzv.port).value_or(IsLocalHost(rdzv.host) ? "127.0.0.1" : HostName());
  }
  if (absl::Status s = rdzv::CheckHostOrAddress("--local-addr", master_addr); !s.ok()) return s;
  return master_addr;
}

// Stragglers judged against the whole job: this node's paces go to the rendezvous, and the job's
// pace comes back (its hosts are other nodes' words: escaped). `heartbeat` must outlive `agent`.
void ShareStragglerPaces(ElasticAgent& agent, HeartbeatServer* heartbeat) {
  agent.SetPaceSource(
      [heartbeat] {
        std::vector<v1::RankPace> paces;
        for (const auto& [rank, ms] : heartbeat->RankPaces()) {
          v1::RankPace& pace = paces.emplace_back();
          pace.set_rank(rank);
          pace.set_median_step_ms(ms);
          pace.set_host(heartbeat->host().substr(0, 255));
        }
        return paces;
      },
      [heartbeat](const v1::JobPace& job) {
        if (!(job.median_step_ms() > 0 && job.median_step_ms() < 1e9)) return;
        std::vector<HeartbeatServer::RemotePace> slowest;
        for (const v1::RankPace& pace : job.slowest()) {
          if (slowest.size() == 3) break;
          slowest.push_back({pace.rank(), rdzv::EscapeForConsole(pace.host(), 255), pace.median_step_ms()});
        }
        heartbeat->SetJobPace(job.median_step_ms(), job.ranks(), std::move(slowest));
      });
}

// Opens a channel to the rendezvous as the given node id, waiting up to the given time.
using ChannelOpener = std::function<absl::StatusOr<std::unique_ptr<rdzv::AgentChannel>>(
    const std::string& node_id, std::chrono::milliseconds connect_timeout)>;

// Sessions one node may open in one job: the first and its rejoins after losses.
constexpr int kMaxSessions = 1000;

// Runs the agent on the runtime's loop until it is done: signals, the channel's messages and
// end, worker exits and the agent's deadlines. When the agent lost its session and wants a new
// one to rejoin through, `channel` is replaced by one that `open` makes (as node_id-rN). An error
// when the loop itself failed.
absl::Status RunAgent(JobRuntime& rt, ElasticAgent& agent, ClientSession& session,
                      std::unique_ptr<rdzv::AgentChannel>& channel, const std::string& node_id,
                      const ChannelOpener& open) {
  absl::Status status = rt.HandleSignals([&](int signo) { agent.OnSignal(signo); });
  if (status.ok()) agent.Start();
  for (int number = 1; status.ok() && number <= kMaxSessions; ++number) {
    if (number > 1) {
      channel.reset();  // Leaves the lost session for good.
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(agent.rejoin_deadline() -
                                                                        std::chrono::steady_clock::now());
      const std::string id = absl::StrCat(node_id, "-r", number - 1);
      absl::StatusOr<std::unique_ptr<rdzv::AgentChannel>> opened =
          open(id, std::max<std::chrono::milliseconds>(left, std::chrono::milliseconds(100)));
      if (!opened.ok()) {  // It waited what was left of the time to rejoin (etcd), or cannot (TLS files).
        agent.OnNewSessionFailed(opened.status());
        break;
      }
      channel = *std::move(opened);
      session.Use(channel.get());
      agent.OnNewSession(id);
    }
    rdzv::AgentChannel& current = *channel;
    auto on_channel_event = [&] {
      for (const v1::CoordinatorMessage& message : current.Take()) agent.OnMessage(message);
      if (std::optional<absl::Status> ended = current.ended()) agent.OnSessionEnded(*ended);
    };
    status = rt.loop().Add(current.event_fd(), on_channel_event);
    if (status.ok()) {
      status = rt.RunUntil([&] { return agent.done() || agent.wants_session(); }, [&] { return agent.Deadline(); },
                           [&] { agent.OnDeadline(); });
    }
    rt.loop().Remove(current.event_fd());
    if (agent.done()) break;
  }
  if (status.ok() && !agent.done()) {
    agent.OnNewSessionFailed(absl::ResourceExhaustedError(absl::StrCat("rejoined ", kMaxSessions - 1, " times")));
  }
  return status;
}

// For a failed job: the root-cause report of this node's workers, or elrun's own error file
// naming what ended the job elsewhere, and one line saying why.
void ReportFailedJob(const JobSpec& spec, const std::map<std::string, std::string>& env, const ElasticAgent& agent) {
  if (agent.failed() != nullptr) {
    PrintFailureReport(spec, *agent.failed(), spec.rdzv_id, agent.group_rank(), env);
  } else if (!agent.end_detail().empty()) {
    WriteLauncherErrorFile(env, "ChildFailedError", agent.end_detail());
  } else if (!agent.rendezvous_error().empty()) {
    WriteLauncherErrorFile(env, "RendezvousError", agent.rendezvous_error());
  }
  if (!agent.end_detail().empty()) PrintError(absl::StrCat("the job failed: ", agent.end_detail()));
}

// The other nodes may not have read the job's end yet: keeps serving until they have all left,
// for close_timeout at most, then stops the coordinator.
void CloseCoordinator(rdzv::CoordinatorServer& server, const JobSpec& spec, const RdzvSettings& rdzv) {
  if (!server.coordinator().WaitUntilJobGone(spec.rdzv_id, std::chrono::steady_clock::now() + rdzv.close_timeout)) {
    spdlog::warn(
        "nodes of run {} still connected {} s after the job ended; stopping the "
        "coordinator",
        spec.rdzv_id, rdzv.close_timeout.count() / 1000.0);
  }
  server.Shutdown();
}

}  // namespace

int RunElasticJob(const JobSpec& spec, const std::map<std::string, std::string>& env,
                  const std::vector<std::string>& argv_template, const RdzvSettings& rdzv) {
  RouteGrpcLogs();
  // The runtime first: it blocks the handled signals, and gRPC's threads (server, client) must
  // inherit that mask, or a SIGTERM delivered to one of them would kill elrun outright instead
  // of being forwarded. It also forks the guardian while the process has a single thread.
  ElasticAgent* agent_ptr = nullptr;
  auto runtime = JobRuntime::Create(spec, env, spec.rdzv_id,
                                    [&agent_ptr](int pid, ExitStatus status) { agent_ptr->OnWorkerExit(pid, status); });
  if (!runtime.ok()) {
    PrintError(std::string(runtime.status().message()));
    return kExitJobFailed;
  }
  JobRuntime& rt = **runtime;
  absl::StatusOr<std::unique_ptr<rdzv::CoordinatorServer>> server = MaybeHostCoordinator(spec, rdzv);
  if (!server.ok()) {
    PrintError(std::string(server.status().message()));
    return kExitJobFailed;
  }
  const std::string node_id = absl::StrCat(HostName(), ":", ::getpid(), ":", RandomRunId().substr(0, 6));
  absl::StatusOr<std::unique_ptr<rdzv::AgentChannel>> channel = OpenChannel(spec, rdzv, node_id, rdzv.join_timeout);
  if (!channel.ok()) {
    PrintError(std::string(channel.status().message()));
    return kExitJobFailed;
  }
  absl::StatusOr<std::string> master_addr = ResolveMasterAddr(spec, rdzv);
  if (!master_addr.ok()) {
    PrintError(std::string(master_addr.status().message()));
    return kExitJobFailed;
  }

  AttemptBuilder builder(spec, argv_template, spec.rdzv_id, rt.layout(), env, PortReservation::Take);
  rt.PrepareBuilder(builder);
  if (spec.keep_survivors) {
    // A kept worker waits for the next round: it forms once every node of the last one is back,
    // or once a lost one is found lost (its stream, or its heartbeat timeout).
    const auto wait =
        std::max<std::chrono::milliseconds>(std::chrono::seconds(10), rdzv.heartbeat_timeout + std::chrono::seconds(5));
    builder.SetWorkerEnv("ELRUN_REGROUP_WAIT_MS", std::to_string(wait.count()));
  }
  ClientSession session(channel->get());
  RealClock clock;
  ElasticAgent agent(spec, rdzv, rt.table(), clock, session, builder, *master_addr, node_id, PortReservation::Take);
  agent_ptr = &agent;
  std::unique_ptr<RoundHistory> history;
  if (!spec.history_file.empty()) {
    absl::StatusOr<std::unique_ptr<RoundHistory>> opened = RoundHistory::Open(spec.history_file, node_id, clock);
    if (!opened.ok()) {
      PrintError(std::string(opened.status().message()));
      return kExitJobFailed;
    }
    history = std::move(*opened);
    agent.SetHistory(history.get());
  }
  rt.OnWatchdogSignal([&agent](int pid, const std::string& why) { agent.OnWorkerSignalled(pid, why); });
  const bool etcd = spec.rdzv_backend == "etcd-v3";
  if (spec.keep_survivors && etcd) {
    spdlog::warn(
        "--keep-survivors: the etcd-v3 backend's rounds do not keep workers alive; every node restarts its "
        "workers after a fault (use the grpc backend, or c10d, to regroup in place)");
  }
  if (spec.keep_survivors && !etcd) {
    agent.KeepSurvivors(
        [&rt](std::vector<WorkerLaunch>& launches, int attempt) { return rt.AddControlFiles(launches, attempt); },
        [&rt](int, const WorkerLaunch& started_as, const WorkerLaunch& launch) {
          return rt.SendRegroup(started_as, launch);
        });
    if (rt.heartbeat() != nullptr) {
      rt.heartbeat()->OnReady([&agent](int pid, int64_t generation) { agent.OnWorkerReady(pid, generation); });
      rt.heartbeat()->SpareForPeersElsewhere();
    }
    agent.SetStandby(rt.StandbyHooks());
  }
  agent.SetFaultSink([&rt](const std::string& kind, const std::string& detail) { rt.NoteFault(kind, detail); });
  if (HeartbeatServer* heartbeat = rt.heartbeat(); heartbeat != nullptr && spec.straggler_factor) {
    ShareStragglerPaces(agent, heartbeat);
  }
  if (rt.heartbeat() != nullptr && spec.rdzv_backend != "etcd-v3") {
    // Goodput for elrun-rdzv's status page and metrics; not into etcd's log, where no page reads it.
    agent.SetProgressSource([&rt] {
      GoodputReport report = rt.GoodputNow();
      v1::Progress progress;
      progress.set_step(report.step);
      progress.set_goodput(report.goodput().value_or(-1));
      progress.set_lost_s(report.lost_s);
      progress.set_faults(static_cast<int32_t>(std::min<size_t>(report.faults.size(), 1000000)));
      progress.set_wall_s(report.wall_s);
      return progress;
    });
  }
  const ChannelOpener reopen = [&spec, &rdzv](const std::string& id, std::chrono::milliseconds connect_timeout) {
    return OpenChannel(spec, rdzv, id, connect_timeout);
  };
  if (absl::Status status = RunAgent(rt, agent, session, *channel, node_id, reopen); !status.ok()) {
    PrintError(std::string(status.message()));
    return kExitJobFailed;
  }
  const int code = agent.exit_code();
  rt.ReportGoodput();
  if (code == kExitJobFailed) ReportFailedJob(spec, env, agent);
  channel->reset();  // Leave the rendezvous.
  if (*server) CloseCoordinator(**server, spec, rdzv);
  return code;
}

}  // namespace elrun
