// elrun-train's side of elrun's progress heartbeats (launcher/watchdog/heartbeat.h): one line per step to
// the FIFO in ELRUN_HEARTBEAT_FILE, and a SIGUSR1 handler that prints to stderr the stack of the
// thread the signal is delivered to (elrun signals the process group: any thread that does not
// block SIGUSR1, not necessarily the training thread) when elrun judges the worker hung. No
// LibTorch. Thread-compatible.
#ifndef ELRUN_TRAINER_RUNTIME_HEARTBEAT_CLIENT_H_
#define ELRUN_TRAINER_RUNTIME_HEARTBEAT_CLIENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace elrun::trainer {

class HeartbeatClient {
 public:
  // nullptr when `env` has no ELRUN_HEARTBEAT_FILE or it cannot be opened (then elrun judges
  // this worker only by --worker-start-timeout, if given). Installs the SIGUSR1 handler.
  static std::unique_ptr<HeartbeatClient> FromEnvironment(const std::map<std::string, std::string>& env);
  ~HeartbeatClient();
  HeartbeatClient(const HeartbeatClient&) = delete;
  HeartbeatClient& operator=(const HeartbeatClient&) = delete;

  // Step `step` finished in `step_ms`. Never fails the caller: a full FIFO drops the beat.
  void Beat(int64_t step, double step_ms);
  // This worker can regroup in place (control_channel.h) and is in generation `generation` (its
  // TORCHELASTIC_RESTART_COUNT, or the last regroup's): told once its process group is built
  // and its state is the job's, at the start and after every regroup. Never fails the caller.
  void Ready(int64_t generation);

 private:
  explicit HeartbeatClient(int fd) : fd_(fd) {}
  const int fd_;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_RUNTIME_HEARTBEAT_CLIENT_H_
