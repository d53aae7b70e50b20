// Everything needed to start one worker process: argv, environment and where its standard
// streams go. Built by the launcher per attempt, consumed by a ProcessTable. Plain data.
#ifndef ELRUN_LAUNCHER_SPEC_WORKER_LAUNCH_H_
#define ELRUN_LAUNCHER_SPEC_WORKER_LAUNCH_H_

#include <string>
#include <vector>

namespace elrun {

enum class StreamTarget {
  kInherit,  // The launcher's own stdout/stderr.
  kFile,     // Only the log file.
  kTee,      // The log file and the launcher's console, each line prefixed.
};

struct StreamRoute {
  StreamTarget target = StreamTarget::kInherit;
  std::string path;  // The log file for kFile and kTee.
  // kTee only: console lines holding any of `filters` are also appended to `filtered_path`
  // (shared by the attempt's workers).
  std::string filtered_path;
  std::vector<std::string> filters;
};

struct WorkerLaunch {
  int local_rank = 0;
  int rank = 0;
  std::vector<std::string> argv;  // argv[0] is an absolute path or a path with a slash.
  std::vector<std::string> env;   // "NAME=value" entries, the worker's whole environment.
  StreamRoute out;
  StreamRoute err;
  std::string console_prefix;  // "[default0]:" for kTee lines.
  std::string error_file;      // TORCHELASTIC_ERROR_FILE of this worker.
  // --numa-binding: the CPUs the worker may run on and its preferred memory node; empty and
  // -1: inherited from elrun.
  std::vector<int> cpus;
  int memory_node = -1;
  // --start-method forkserver and a Python entrypoint: forked from the forkserver (argv is still
  // what an exec would run; the server reads the script and its arguments from it).
  bool fork_from_server = false;
};

// A launch's local rank while it is a standby spare (--keep-survivors): not a worker of any
// attempt until elrun hands it one (launcher/job/standby_worker.h).
inline constexpr int kStandbyLocalRank = -1;

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_SPEC_WORKER_LAUNCH_H_
