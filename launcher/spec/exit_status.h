// How a worker ended: an exit code or a terminating signal. Plain value type.
#ifndef ELRUN_LAUNCHER_SPEC_EXIT_STATUS_H_
#define ELRUN_LAUNCHER_SPEC_EXIT_STATUS_H_

#include <string>

namespace elrun {

struct ExitStatus {
  int code = 0;    // Meaningful when signal == 0.
  int signal = 0;  // Non-zero when the process was killed by a signal.

  static ExitStatus Exited(int code) { return {code, 0}; }
  static ExitStatus Signaled(int signo) { return {0, signo}; }

  bool success() const { return signal == 0 && code == 0; }
  // "exit code 1" or "signal SIGKILL (9)".
  std::string Describe() const;
  bool operator==(const ExitStatus& other) const { return code == other.code && signal == other.signal; }
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_SPEC_EXIT_STATUS_H_
