// Progress heartbeats: elrun notices a worker that is alive but makes no progress, which
// torchrun cannot (a deadlock, a SIGSTOP, a peer that hangs a collective with no timeout).
//
// With --worker-timeout, --worker-start-timeout or --straggler-factor, each worker gets
// ELRUN_HEARTBEAT_FILE, a FIFO (line_fifo.h). A beat is one line, at most 256 bytes:
//
//   <pid> <step> <step_ms> [<stack signal>]
//
// elrun-train beats after every step; launcher/python/elrun_heartbeat.py gives Python scripts
// beat(step) in one line. <stack signal>, when present, is a signal the worker handles by
// printing its stacks (SIGUSR1 in both). A worker that can regroup in place (--keep-survivors,
// trainer/runtime/control_channel.h) also says so, once per generation, in a line that is not a
// beat:
//
//   <pid> ready <generation>
//
// A worker is hung when, after its first beat, none came
// for --worker-timeout, or, before it, --worker-start-timeout passed since elrun first saw it.
// elrun then logs the rank and since when, sends the stack signal if the worker named one and
// is not stopped (a SIGSTOPped process cannot print its stacks: it is killed at once),
// and after kStackGrace kills the worker's group with the cause "no progress for N s"; the
// failure restarts the group within --max-restarts like any other. A hung worker that is not
// stopped while another worker of the node is waits for it in a collective: it is not killed but
// gets another --worker-timeout (so with --keep-survivors only the stopped one restarts).
// Workers that never beat are judged only by --worker-start-timeout, so without it scripts that
// do not beat are never judged. Beats from a pid outside this job's workers are dropped. The beats' step times also
// give each worker's pace (the median of its last kPaceWindow); one slower than
// --straggler-factor times the median of all workers' paces is logged as a straggler. In a
// multi-node job the agent sends its workers' paces through the rendezvous, which answers with
// the median of every rank of the job (SetJobPace): each worker is then judged against the
// whole job, and the end summary names the job's slowest ranks, wherever they ran.
//
// HeartbeatTable holds the logic and is pure (times in seconds of one clock). HeartbeatServer
// adds the FIFO and a periodic timer on the event loop. Thread-compatible: the loop's thread.
#ifndef ELRUN_LAUNCHER_WATCHDOG_HEARTBEAT_H_
#define ELRUN_LAUNCHER_WATCHDOG_HEARTBEAT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/os/event_loop.h"
#include "launcher/os/line_fifo.h"

namespace elrun {

struct HeartbeatLimits {
  std::optional<double> worker_timeout_s;  // Longest gap between beats once beating.
  std::optional<double> start_timeout_s;   // Longest wait for the first beat.
  // A worker whose median step time over its last kPaceWindow beats exceeds this many times the
  // median of all workers' medians is a straggler (reported, not killed).
  std::optional<double> straggler_factor;
  bool any() const { return worker_timeout_s || start_timeout_s || straggler_factor; }
};

constexpr size_t kPaceWindow = 16;  // Beats per worker that its median step time is taken over.

struct Beat {
  int pid = 0;
  int64_t step = 0;
  double step_ms = 0;
  int stack_signal = 0;  // 0: none named.
  // A "ready" line instead of a beat: the worker's generation (its restart count).
  std::optional<int64_t> ready_generation;
};

// One beat or ready line (see above); InvalidArgument naming what is wrong.
absl::StatusOr<Beat> ParseBeat(const std::string& line);

// A worker's pace: the median step time of its last beats (at least kPaceWindow / 2 of them).
struct Pace {
  int group = 0;
  double median_ms = 0;
  size_t beats = 0;
};

// A worker that became a straggler: its pace against the job's median.
struct Straggler {
  Pace pace;
  double job_median_ms = 0;
};

// A worker judged hung: its group, the signal that asks it for its stacks (0: none) and why.
struct Hung {
  int group = 0;
  int stack_signal = 0;
  std::string why;
  double since = 0;      // Its last beat, or its start when it never beat: when progress stopped.
  bool rearmed = false;  // It was given another timeout (Rearm) and made no progress since.
};

class HeartbeatTable {
 public:
  explicit HeartbeatTable(HeartbeatLimits limits) : limits_(limits) {}
  HeartbeatTable(const HeartbeatTable&) = delete;
  HeartbeatTable& operator=(const HeartbeatTable&) = delete;

  // The worker groups alive at `now`: new ones start their clock, missing ones are forgotten.
  void Track(const std::vector<int>& groups, double now);
  // A beat of `group` at `now`; ignored for a group not tracked.
  void Record(int group, const Beat& beat, double now);
  // The groups hung at `now`, each reported once.
  std::vector<Hung> TakeHung(double now);
  // `group`, reported hung, gets its limit again from `now` (it only waits for another worker);
  // its hang, if it comes, is still told from its last beat.
  void Rearm(int group, double now);
  // Every worker with enough beats, slowest first.
  std::vector<Pace> Paces() const;
  // The workers that became stragglers since the last call (each again only after it caught
  // up); none unless straggler_factor is set and two or more workers have a pace. With
  // `job_median_ms` (the whole job's, from the rendezvous) workers are judged against it, and
  // one worker with a pace is enough.
  std::vector<Straggler> TakeStragglers(std::optional<double> job_median_ms = std::nullopt);

 private:
  struct Worker {
    double started = 0;
    std::optional<double> last_beat;
    std::optional<double> rearmed;  // Rearm's time, until the next beat.
    int64_t last_step = 0;
    double last_step_ms = 0;
    int stack_signal = 0;
    bool reported = false;
    std::vector<double> recent_ms;  // The last kPaceWindow step times, a ring.
    size_t next = 0;
    bool straggling = false;
  };
  const HeartbeatLimits limits_;
  std::map<int, Worker> workers_;  // By group.
};

class HeartbeatServer {
 public:
  using GroupOf = std::function<std::optional<int>(int pid)>;  // A worker group, or nullopt.
  struct Worker {
    int group = 0;
    int local_rank = 0;
    int rank = 0;
  };
  using Groups = std::function<std::vector<Worker>()>;  // Every live worker.
  // A hung worker: called when its group is to be killed, with the cause.
  using OnHung = std::function<void(int group, const std::string& why)>;

  static constexpr double kStackGrace = 2.0;  // Seconds between the stack signal and the kill.

  static absl::StatusOr<std::unique_ptr<HeartbeatServer>> Start(const std::string& path, EventLoop* loop,
                                                                HeartbeatLimits limits, GroupOf group_of, Groups groups,
                                                                OnHung on_hung);
  ~HeartbeatServer();
  HeartbeatServer(const HeartbeatServer&) = delete;
  HeartbeatServer& operator=(const HeartbeatServer&) = delete;

  const std::string& path() const { return fifo_->path(); }

  // Called with each valid beat's step and its worker's group, after the beat was recorded.
  void OnBeat(std::function<void(int64_t step, int group)> on_beat) { on_beat_ = std::move(on_beat); }
  // Called with each valid ready line's pid and generation, for a worker of this job.
  void OnReady(std::function<void(int pid, int64_t generation)> on_ready) { on_ready_ = std::move(on_ready); }
  // --keep-survivors in a multi-node job: a worker's peers may be on other nodes, where a stopped
  // one is killed by that node's watchdog. A hung worker that can regroup in place (it said ready)
  // and is not stopped itself gets one more --worker-timeout before it is killed, so that only
  // the stopped peer dies and this one regroups; a second timeout without progress kills it.
  void SpareForPeersElsewhere() { spare_for_peers_elsewhere_ = true; }
  // Called when a worker is judged hung (before its stack signal and kill), with who it is, why,
  // and when its progress stopped (seconds of CLOCK_MONOTONIC).
  void OnHangFound(std::function<void(const std::string& what, double since)> on_hang) {
    on_hang_found_ = std::move(on_hang);
  }
  // This node's workers that have a pace: (global rank, median step ms), for the rendezvous.
  std::vector<std::pair<int, double>> RankPaces() const;
  // The job's pace as the rendezvous computed it: the median over `ranks` ranks and the job's
  // slowest (rank, host, median ms). Stragglers are judged against it from the next tick on.
  struct RemotePace {
    int rank = 0;
    std::string host;
    double median_ms = 0;
  };
  void SetJobPace(double median_ms, int ranks, std::vector<RemotePace> slowest);
  const std::string& host() const { return host_; }
  // One line naming the slowest workers by their last known pace (empty without beats):
  // "slowest ranks by median step time: rank 2 (local_rank 2, host h) 201.3 ms, ...".
  std::string PaceSummary() const;
  bool saw_stragglers() const { return saw_stragglers_; }

 private:
  HeartbeatServer(EventLoop* loop, HeartbeatLimits limits, GroupOf group_of, Groups groups, OnHung on_hung)
      : loop_(loop),
        limits_(limits),
        table_(limits),
        group_of_(std::move(group_of)),
        groups_(std::move(groups)),
        on_hung_(std::move(on_hung)) {}
  std::string Name(int group) const;  // "rank 2 (local_rank 2, host h, pid 77)".
  void OnLine(const std::string& line);
  void OnTick();

  EventLoop* const loop_;
  const HeartbeatLimits limits_;
  HeartbeatTable table_;
  const GroupOf group_of_;
  const Groups groups_;
  const OnHung on_hung_;
  std::function<void(int64_t, int)> on_beat_;
  std::function<void(int, int64_t)> on_ready_;
  std::function<void(const std::string&, double)> on_hang_found_;
  int timer_fd_ = -1;
  std::map<int, std::pair<double, std::string>> dying_;  // Group -> (kill time, why).
  std::map<int, Worker> known_;                          // Every worker seen, by group.
  std::map<int, double> last_pace_ms_;                   // Their last known pace, by group.
  std::optional<double> job_median_ms_;                  // The job's, from the rendezvous.
  int job_ranks_ = 0;
  std::vector<RemotePace> job_slowest_;
  std::string host_;
  bool saw_stragglers_ = false;
  bool spare_for_peers_elsewhere_ = false;
  std::set<int> ready_;  // Groups that said they can regroup in place.
  int64_t dropped_ = 0;
  std::unique_ptr<LineFifo> fifo_;  // Last: destroyed first.
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_WATCHDOG_HEARTBEAT_H_
