// This node's elastic agent: the state machine that joins the rendezvous, proves the token and
// checks the coordinator's proof, runs the workers of each round with the ranks it was given,
// reports how they ended and follows the coordinator's decisions (a new round after a node was
// lost or arrived or a worker failed anywhere; the end of the job). It is driven by the
// coordinator's messages, worker exits, signals and its own timers, all from one thread, and
// reaches the outside only through its RendezvousSession, ProcessTable and Clock - so it is
// tested without a network (tests/launcher/job/elastic_agent_test.cc). Thread-compatible.
#ifndef ELRUN_LAUNCHER_JOB_ELASTIC_AGENT_H_
#define ELRUN_LAUNCHER_JOB_ELASTIC_AGENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "launcher/job/supervisor.h"
#include "launcher/os/clock.h"
#include "launcher/os/port_reservation.h"
#include "launcher/os/process_table.h"
#include "launcher/report/round_history.h"
#include "launcher/spec/exit_status.h"
#include "launcher/spec/job_spec.h"
#include "launcher/spec/rdzv_settings.h"
#include "launcher/worker/attempt_builder.h"
#include "proto/rendezvous.pb.h"

namespace elrun {

// Where the agent's messages to the coordinator go. Send must not block.
class RendezvousSession {
 public:
  virtual ~RendezvousSession() = default;
  virtual void Send(const rdzv::v1::AgentMessage& message) = 0;
};

class ElasticAgent {
 public:
  using PortPicker = AttemptBuilder::PortPicker;

  // Everything is borrowed and must outlive the agent. `pick_port` gives the port this node's
  // worker rank 0 would host the store on, asked at each Join; the agent holds it until the
  // next Join, so nothing else on the host takes it before that worker binds it.
  ElasticAgent(const JobSpec& spec, const RdzvSettings& rdzv, ProcessTable& table, const Clock& clock,
               RendezvousSession& session, AttemptBuilder& builder, std::string master_addr, std::string node_id,
               PortPicker pick_port);
  ~ElasticAgent();
  ElasticAgent(const ElasticAgent&) = delete;
  ElasticAgent& operator=(const ElasticAgent&) = delete;

  // Waits for the coordinator's Challenge, which the first Join answers.
  void Start();

  // With --straggler-factor: while a round runs, every kPaceInterval (at a heartbeat) the agent
  // sends `paces()` (this node's workers' paces) and gives the coordinator's answer, the job's
  // pace, to `on_job_pace` once it covers every rank of the round.
  static constexpr std::chrono::seconds kPaceInterval{2};
  void SetPaceSource(std::function<std::vector<rdzv::v1::RankPace>()> paces,
                     std::function<void(const rdzv::v1::JobPace&)> on_job_pace) {
    paces_ = std::move(paces);
    on_job_pace_ = std::move(on_job_pace);
  }

  // While a round runs, every kPaceInterval (at a heartbeat) the agent sends `progress()` (this
  // node's goodput so far; the round is filled in), for the coordinator's status page.
  void SetProgressSource(std::function<rdzv::v1::Progress()> progress) { progress_ = std::move(progress); }

  // Told of each fault this node sees, as (kind, detail): a worker of its own that failed, a new
  // round. For the goodput report.
  void SetFaultSink(std::function<void(const std::string&, const std::string&)> on_fault) {
    on_fault_ = std::move(on_fault);
  }

  // --keep-survivors across nodes: `add_control` gives each attempt's launches their control
  // channel (JobRuntime::AddControlFiles) and `regroup` tells a kept worker its next launch
  // (JobRuntime::SendRegroup). When a round ends and every worker here said it can regroup in
  // place (OnWorkerReady), they are kept alive; the next round regroups them, or stops them if no
  // node kept any (RoundStarted.keep_survivors).
  using ControlAdder = std::function<absl::Status(std::vector<WorkerLaunch>& launches, int attempt)>;
  void KeepSurvivors(ControlAdder add_control, Supervisor::Regrouper regroup) {
    add_control_ = std::move(add_control);
    regroup_ = std::move(regroup);
  }
  // --keep-survivors' standby spare (standby_worker.h) for every group this agent runs.
  void SetStandby(Supervisor::Standby standby) { standby_ = std::move(standby); }
  // --history-file: what this node is told and does, as it happens (round_history.h).
  void SetHistory(RoundHistory* history) { history_ = history; }
  void OnWorkerReady(int pid, int64_t generation) {
    if (supervisor_) supervisor_->OnWorkerReady(pid, generation);
  }

  // One message from the coordinator, in the order received.
  void OnMessage(const rdzv::v1::CoordinatorMessage& message);
  // The session ended (the coordinator refused this node, died, or went silent).
  void OnSessionEnded(const absl::Status& status);
  // After a session that was lost (UNAVAILABLE: the coordinator silent or unreachable; etcd:
  // this node's lease lost) the agent stops its workers, which a new round elsewhere may already
  // have replaced, and asks for a new session (wants_session) to rejoin the job through, until
  // rdzv.rejoin_timeout after the loss; then it leaves with the loss as its cause.
  bool wants_session() const { return wants_session_; }
  // The caller opened a new session (its messages now come to OnMessage): the agent answers its
  // Challenge with a Join as `node_id` (a fresh one: the coordinator may still hold the last).
  void OnNewSession(std::string node_id);
  // No new session could be opened: the agent leaves, with the loss and this as the cause.
  void OnNewSessionFailed(const absl::Status& status);
  // When the current rejoin attempt gives up; the caller opens no session past it.
  std::chrono::steady_clock::time_point rejoin_deadline() const { return rejoin_deadline_; }
  void OnWorkerExit(int pid, ExitStatus status);
  // elrun signalled worker `pid` for `why` (the FileTimer watchdog): its failure carries it.
  void OnWorkerSignalled(int pid, const std::string& why);
  void OnSignal(int signo);

  // When OnDeadline is due next: a heartbeat, a worker's shutdown timeout, the join timeout.
  std::optional<std::chrono::steady_clock::time_point> Deadline() const;
  void OnDeadline();

  bool done() const { return exit_code_.has_value() && (!supervisor_ || supervisor_->done()); }
  int exit_code() const { return *exit_code_; }
  // The last worker group that failed on this node, for the report; null when none did.
  const Supervisor* failed() const { return failed_.get(); }
  // Why the coordinator ended the job, escaped; empty if it did not.
  const std::string& end_detail() const { return end_detail_; }
  // The last error this agent printed about the rendezvous, for the launcher's error file.
  const std::string& rendezvous_error() const { return rendezvous_error_; }
  int group_rank() const { return builder_.node().group_rank; }

 private:
  // kStoppingForStart: a round began that does not keep the workers this node held; they are
  // stopped before its workers start.
  // kStoppingForRejoin: the session was lost; the workers stop, then a new session is asked for.
  enum class Phase {
    kJoining,
    kRunning,
    kReported,
    kStoppingForRound,
    kStoppingForStart,
    kStoppingForEnd,
    kStoppingForRejoin
  };

  void OnChallenge(const rdzv::v1::Challenge& challenge);
  void OnWelcome(const rdzv::v1::Welcome& welcome);
  void Abandon();
  void Distrust(const std::string& what);
  void Join();
  void OnRoundStarted(const rdzv::v1::RoundStarted& round);
  void OnRoundEnded(const rdzv::v1::RoundEnded& ended);
  void OnJobEnded(const rdzv::v1::JobEnded& ended);
  void OnStreamEnded(const absl::Status& status);
  // Starts a new worker group for the round just assigned (node_) as `attempt`; `join_live`:
  // every worker takes the job's live state from survivors elsewhere (Supervisor::Start).
  void StartWorkers(int attempt, int restart_count, bool join_live);
  void CheckSupervisor();
  void Finish(int code);
  void Report(const std::string& error);
  void Record(const std::string& event, const RoundHistory::Fields& fields);
  std::chrono::milliseconds RejoinTimeout() const;
  // When a Join now must have led to a round: join_timeout, and 5 s for the coordinator's own.
  std::chrono::steady_clock::time_point JoinDeadline() const;
  // Reports the lost session (lost_cause_) and `then`, what became of the rejoin.
  void ReportLost(const std::string& then);
  // The supervisor ended: records that the workers of its round are gone.
  void RecordWorkersGone();

  const JobSpec& spec_;
  const RdzvSettings& rdzv_;
  ProcessTable& table_;
  const Clock& clock_;
  RendezvousSession& session_;
  AttemptBuilder& builder_;
  const std::string master_addr_;
  std::string node_id_;    // This session's (OnNewSession).
  const std::string key_;  // TokenKey of the token; empty without one.
  const PortPicker pick_port_;

  std::optional<PortReservation> held_port_;  // The port the last Join offered.
  Phase phase_ = Phase::kJoining;
  std::unique_ptr<Supervisor> supervisor_;  // The current round's workers.
  uint64_t supervisor_round_ = 0;           // The round supervisor_'s workers run (or ran) in.
  RoundHistory* history_ = nullptr;         // --history-file; null without.
  bool gone_recorded_ = false;              // workers_gone recorded for supervisor_.
  std::unique_ptr<Supervisor> failed_;      // The last group that failed here, for the report.
  NodeAssignment node_;                     // The current round's.
  ControlAdder add_control_;                // --keep-survivors.
  Supervisor::Regrouper regroup_;
  Supervisor::Standby standby_;
  struct PendingStart {
    int attempt = 0;
    int restart_count = 0;
    bool join_live = false;
  };
  PendingStart pending_start_;  // kStoppingForStart's round.
  uint64_t round_ = 0;
  int attempts_ = 0;
  int end_code_ = kExitJobFailed;
  std::string end_detail_;
  std::string rendezvous_error_;
  std::optional<int> exit_code_;
  bool stream_lost_ = false;
  bool wants_session_ = false;
  // Since the session was lost and until a round starts again: the loss, its time's deadline.
  std::string lost_cause_;
  std::chrono::steady_clock::time_point rejoin_deadline_;
  bool challenged_ = false;     // The session's Challenge arrived (and the first Join left).
  bool authenticated_ = false;  // The coordinator proved the token (Welcome).
  std::string server_nonce_;
  std::string incarnation_;  // The coordinator's (Welcome.incarnation); empty when it sent none.
  std::string client_nonce_;
  std::chrono::steady_clock::time_point next_heartbeat_;
  std::chrono::steady_clock::time_point next_pace_;
  std::function<std::vector<rdzv::v1::RankPace>()> paces_;
  std::function<void(const rdzv::v1::JobPace&)> on_job_pace_;
  std::function<void(const std::string&, const std::string&)> on_fault_;
  std::function<rdzv::v1::Progress()> progress_;
  std::chrono::steady_clock::time_point join_deadline_;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_JOB_ELASTIC_AGENT_H_
