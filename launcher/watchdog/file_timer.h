// torchrun's file-based worker watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1), served by elrun.
//
// Workers use torch.distributed.elastic.timer.FileTimerClient: each acquire writes one JSON line
// {"version": 1, "pid": P, "scope_id": S, "expiration_time": T, "signal": N} to the FIFO named by
// TORCHELASTIC_TIMER_FILE, and release writes the same with expiration_time -1. When a timer's
// wall-clock expiration passes, the process it names gets its signal.
//
// elrun differs from torchrun where torchrun is unsafe:
// - It signals only processes in one of this job's worker process groups. Anyone who can write
//   to the FIFO could otherwise have a launcher kill any pid.
// - After reaping a worker, torchrun's agent sends the same signal to itself, which kills the
//   whole launcher (SIGKILL by default). elrun instead lets the worker's end count as a failure,
//   reports "timer <scope> expired" as its cause, and restarts within --max-restarts.
// - Malformed or oversized lines are dropped with a warning, and the number of timers is
//   bounded.
//
// FileTimerTable holds the logic and is pure. FileTimerServer adds the FIFO and a timerfd on
// the event loop. Thread-compatible: the loop's thread.
#ifndef ELRUN_LAUNCHER_WATCHDOG_FILE_TIMER_H_
#define ELRUN_LAUNCHER_WATCHDOG_FILE_TIMER_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "launcher/os/event_loop.h"
#include "launcher/os/line_fifo.h"

namespace elrun {

// One process to signal: its expired scopes (earliest first) and the signal of the earliest one
// that has a signal.
struct TimerReap {
  int pid = 0;
  int signal = 0;
  std::vector<std::string> scopes;
};

class FileTimerTable {
 public:
  static constexpr size_t kMaxTimers = 65536;

  // Applies one request line. A malformed line (not JSON, wrong version, a field missing, out of
  // range) is InvalidArgument and changes nothing. Beyond kMaxTimers, a new timer is
  // ResourceExhausted.
  absl::Status Apply(const std::string& line);

  // Removes and returns the timers expired at `now` (seconds since the epoch), grouped by pid.
  // A pid whose expired timers carry no signal is dropped without a reap, as torch does.
  std::vector<TimerReap> TakeExpired(double now);

  // Forgets every timer of `pid` (it ended).
  void Forget(int pid);

  // The earliest expiration, in seconds since the epoch.
  std::optional<double> NextExpiry() const;
  size_t size() const { return timers_.size(); }

 private:
  struct Timer {
    double expiration = 0;
    int signal = 0;
  };
  std::map<std::pair<int, std::string>, Timer> timers_;  // By (pid, scope id).
};

class FileTimerServer {
 public:
  // Which worker group a pid belongs to: the group's pid, or nullopt for a process that is
  // not one of this job's workers or their descendants in the same group.
  using GroupOf = std::function<std::optional<int>(int pid)>;
  // A process was signalled: the worker group it belongs to and one line saying why.
  using OnReap = std::function<void(int group, const std::string& why)>;

  // Makes the FIFO at `path`, mode 0600. An existing FIFO there is replaced. Any other file
  // there is an error, since elrun never deletes what it did not make. The server reads the
  // FIFO and its timer on `loop` until destroyed, and then removes the FIFO.
  static absl::StatusOr<std::unique_ptr<FileTimerServer>> Start(const std::string& path, EventLoop* loop,
                                                                GroupOf group_of, OnReap on_reap);
  ~FileTimerServer();
  FileTimerServer(const FileTimerServer&) = delete;
  FileTimerServer& operator=(const FileTimerServer&) = delete;

  const std::string& path() const { return path_; }

 private:
  FileTimerServer(std::string path, EventLoop* loop, GroupOf group_of, OnReap on_reap)
      : path_(std::move(path)), loop_(loop), group_of_(std::move(group_of)), on_reap_(std::move(on_reap)) {}

  void OnTimer();
  void Arm();

  const std::string path_;
  EventLoop* const loop_;
  const GroupOf group_of_;
  const OnReap on_reap_;
  int timer_fd_ = -1;
  FileTimerTable table_;
  std::unique_ptr<LineFifo> fifo_;  // Last member: destroyed first, so no line arrives after the table.
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_WATCHDOG_FILE_TIMER_H_
