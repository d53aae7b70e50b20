// elrun-train's side of elrun's control channel (--keep-survivors): elrun -> worker, beside the
// heartbeat FIFO (worker -> elrun). When another worker of the job failed and elrun restarts only
// that one, it tells each survivor the new generation's env contract in one line on the FIFO in
// ELRUN_CONTROL_FILE:
//
//   regroup <generation> RANK=<r> WORLD_SIZE=<w> LOCAL_RANK=<l> MASTER_ADDR=<a> MASTER_PORT=<p>
//           [TORCHELASTIC_RESTART_COUNT=<n>]
//
// <generation> is elrun's attempt on this node (ELRUN_GENERATION in a worker's environment,
// else its TORCHELASTIC_RESTART_COUNT): lines for a generation at or below the worker's own are
// stale and dropped. The restart count, when not given, is the generation (a single-node job,
// where every attempt is a restart); a multi-node job's rounds are attempts that need not be.
// A reader thread takes the lines; the training thread asks pending() between steps and, after a
// collective failed, waits for one with Wait(). No LibTorch. Thread-safe.
#ifndef ELRUN_TRAINER_RUNTIME_CONTROL_CHANNEL_H_
#define ELRUN_TRAINER_RUNTIME_CONTROL_CHANNEL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace elrun::trainer {

// The env contract of a new generation.
struct Regroup {
  int64_t generation = 0;  // elrun's attempt on this node (ELRUN_GENERATION).
  // RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT.
  std::map<std::string, std::string> env;
};

// One line (without its newline); InvalidArgument naming what is wrong: another verb, a
// generation that is not a non-negative integer, a token that is not NAME=value, a name outside
// the six above or one of the first five missing, a value with a control byte, a restart count
// that is not a non-negative 32-bit integer.
absl::StatusOr<Regroup> ParseRegroup(const std::string& line);

class ControlChannel {
 public:
  // nullptr when `env` has no ELRUN_CONTROL_FILE (not started by elrun --keep-survivors) or it
  // cannot be opened. `generation` is this worker's TORCHELASTIC_RESTART_COUNT.
  static std::unique_ptr<ControlChannel> FromEnvironment(const std::map<std::string, std::string>& env,
                                                         int64_t generation);
  ~ControlChannel();  // Stops the reader thread.
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  // A newer generation arrived and was not taken yet. Cheap: one atomic load.
  bool pending() const { return pending_.load(std::memory_order_acquire); }
  // The newest generation not taken yet, waiting up to `timeout` for one; nullopt at the timeout.
  // Taking it makes it this worker's generation.
  std::optional<Regroup> Wait(std::chrono::milliseconds timeout);
  int64_t generation() const;

 private:
  ControlChannel(int fd, int wake_fd, int64_t generation);
  void Read();  // The reader thread.
  void OnLine(const std::string& line);

  const int fd_;
  const int wake_fd_;  // An eventfd that ends the reader thread.
  std::atomic<bool> pending_{false};
  mutable absl::Mutex mutex_;
  int64_t generation_ ABSL_GUARDED_BY(mutex_);
  std::optional<Regroup> next_ ABSL_GUARDED_BY(mutex_);
  absl::CondVar arrived_;  // Signalled when next_ is set.
  std::thread reader_;     // Last: started once the rest is built.
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_RUNTIME_CONTROL_CHANNEL_H_
