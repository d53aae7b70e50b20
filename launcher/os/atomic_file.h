// Writes a whole file so that a reader sees the old contents or the new, never a torn one: a
// temp file beside it, fsync'd, renamed over it. Thread-safe (no shared state).
#ifndef ELRUN_LAUNCHER_OS_ATOMIC_FILE_H_
#define ELRUN_LAUNCHER_OS_ATOMIC_FILE_H_

#include <string>

#include "absl/status/status.h"

namespace elrun {

// An error (one line, naming the path and the cause) when the file could not be written; the
// old file, if any, is then untouched and no temp file is left.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_ATOMIC_FILE_H_
