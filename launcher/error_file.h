// Reads the error file a worker writes to TORCHELASTIC_ERROR_FILE, in torchrun's format:
// {"message": {"message": "<Type>: <msg>", "extraInfo": {"py_callstack": "...",
// "timestamp": "<epoch s>"}}}; "message" may also be a plain string. Thread-safe.
#ifndef ELRUN_LAUNCHER_ERROR_FILE_H_
#define ELRUN_LAUNCHER_ERROR_FILE_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace elrun {

struct WorkerError {
  std::string message;    // "ValueError: boom"
  std::string traceback;  // py_callstack, may be empty.
  std::optional<long long> timestamp;  // Seconds since the epoch, when given.
};

// NotFound when the worker wrote no file; InvalidArgument when the file is not in the format.
absl::StatusOr<WorkerError> ParseErrorFile(const std::string& json);
absl::StatusOr<WorkerError> ReadErrorFile(const std::string& path);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_ERROR_FILE_H_
