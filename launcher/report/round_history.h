// --history-file: this node's part in an elastic job, one JSON object per line, appended as each
// thing happens, for whoever checks afterwards what every node believed and when (the network
// fault tests' history checker, tests/support/history_check.py; an operator after an
// incident). Every line holds "t_ms" (wall-clock milliseconds), "node" (this agent's node id) and
// "event", then the event's fields:
//   join            round (the last one this node had, 0 before any), holds_survivors
//   round           round, group_rank, groups, world, rank_offset, nproc, restarts, master, keep,
//                   coordinator (its incarnation, hex; "" when it sends none, as with etcd)
//   workers_started round, attempt                    (a fresh worker group for the round)
//   regrouped       round, attempt                    (the workers kept from the last round)
//   workers_ended   round, success                    (told to the coordinator)
//   workers_gone    round                             (every worker of that round has exited)
//   round_ended     round, reason
//   job_ended       success
//   coordinator_lost why
//   coordinator_restarted                             (a rejoin found another incarnation)
//   left            exit_code
// Each line is one write(2) to a file opened with O_APPEND, so a line is never torn by a crash of
// elrun itself. A failed write is warned about once and the job goes on. Thread-compatible.
#ifndef ELRUN_LAUNCHER_REPORT_ROUND_HISTORY_H_
#define ELRUN_LAUNCHER_REPORT_ROUND_HISTORY_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/struct.pb.h>

#include "absl/status/statusor.h"
#include "launcher/os/clock.h"

namespace elrun {

class RoundHistory {
 public:
  using Fields = std::vector<std::pair<std::string, google::protobuf::Value>>;

  // Opens (creating, mode 0644) `path` for appending; an error names the path and the cause.
  static absl::StatusOr<std::unique_ptr<RoundHistory>> Open(const std::string& path, std::string node_id,
                                                            const Clock& clock);
  ~RoundHistory();
  RoundHistory(const RoundHistory&) = delete;
  RoundHistory& operator=(const RoundHistory&) = delete;

  // Appends one line: t_ms, node, event, then `fields` in order.
  void Record(const std::string& event, const Fields& fields);

  // The line Record would write, without its newline (for tests).
  std::string Line(const std::string& event, const Fields& fields) const;

 private:
  RoundHistory(int fd, std::string path, std::string node_id, const Clock& clock);

  const int fd_;
  const std::string path_;
  const std::string node_id_;
  const Clock& clock_;
  bool warned_ = false;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_REPORT_ROUND_HISTORY_H_
