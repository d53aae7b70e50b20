// Reads the error file a worker writes to TORCHELASTIC_ERROR_FILE, and writes elrun's own, in
// torchrun's format:
// {"message": {"message": "<Type>: <msg>", "extraInfo": {"py_callstack": "...",
// "timestamp": "<epoch s>"}}}; "message" may also be a plain string. Thread-safe.
#ifndef ELRUN_LAUNCHER_REPORT_ERROR_FILE_H_
#define ELRUN_LAUNCHER_REPORT_ERROR_FILE_H_

#include <chrono>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace elrun {

struct WorkerError {
  std::string message;                 // "ValueError: boom"
  std::string traceback;               // py_callstack, may be empty.
  std::optional<long long> timestamp;  // Seconds since the epoch, when given.
};

// InvalidArgument when the text is not in the format; ReadErrorFile also NotFound when the
// worker wrote no file (or it cannot be opened).
absl::StatusOr<WorkerError> ParseErrorFile(const std::string& json);
absl::StatusOr<WorkerError> ReadErrorFile(const std::string& path);

// What torchrun's @record writes to the launcher's own TORCHELASTIC_ERROR_FILE (set by a
// scheduler or an outer launcher), elrun writes too:
// - the root-cause worker's error file, its "message.errorCode" set to the worker's exit code
//   (negative signal number), as torch's ErrorHandler.dump_error_file does;
//   InvalidArgument when the worker's file is not JSON or has no "message";
absl::StatusOr<std::string> RootCauseErrorJson(const std::string& worker_json, int exit_code);
// - otherwise a record in ErrorHandler.record_exception's format, {"message": {"message":
//   "<Type>: <text>", "extraInfo": {"py_callstack": <details>, "timestamp": "<epoch s>"}}},
//   with "errorCode" when one is known (nonzero).
std::string ErrorRecordJson(const std::string& type_and_text, const std::string& details,
                            std::chrono::system_clock::time_point time, int exit_code);

// Writes `json` to `path`, replacing what is there (torch removes an existing file first).
// Internal when it cannot be written.
absl::Status WriteErrorFile(const std::string& path, const std::string& json);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_REPORT_ERROR_FILE_H_
