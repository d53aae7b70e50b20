// What each worker executes: python -u SCRIPT, python -u -m MODULE, runpy for --run-path, or a
// binary (--no-python, or an ELF file given as the script), with "${local_rank}" substituted in
// the arguments. Checks the file system up front so that a bad entrypoint is a usage error
// before any worker starts. Thread-safe (reads the file system only).
#ifndef ELRUN_LAUNCHER_WORKER_ENTRYPOINT_H_
#define ELRUN_LAUNCHER_WORKER_ENTRYPOINT_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/spec/job_spec.h"

namespace elrun {

// Returns the argv template shared by all local ranks; argv[0] is an absolute path or contains a
// slash. Errors (InvalidArgument, one line): a missing script, a --no-python file that is not
// executable, a program or interpreter not found on PATH. The interpreter is $PYTHON_EXEC, else
// `default_python` (a path, or a name looked up on PATH).
absl::StatusOr<std::vector<std::string>> ResolveEntrypoint(const JobSpec& spec,
                                                           const std::map<std::string, std::string>& env,
                                                           const std::string& default_python = "python3");

// The interpreter when PYTHON_EXEC is unset: the executable python3 beside `self_exe` (elrun
// installed into a Python environment's bin/ runs that environment's Python, as torchrun does
// through its script's interpreter), else "python3" (looked up on PATH).
std::string DefaultPython(const std::string& self_exe);

// True when the workers run Python (not --no-python, not a compiled binary given as the script).
bool RunsPython(const JobSpec& spec);

// argv for one worker: every "${local_rank}" in the arguments (not argv[0]) replaced.
std::vector<std::string> SubstituteLocalRank(const std::vector<std::string>& argv, int local_rank);

// Looks `name` up like execvp: as given when it has a slash, else in the ':'-separated PATH.
// Returns the path of an executable regular file, or NotFound / PermissionDenied.
absl::StatusOr<std::string> FindExecutable(const std::string& name, const std::string& path_var);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_WORKER_ENTRYPOINT_H_
