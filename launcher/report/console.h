// elrun's own output on the console: one-line errors and the spdlog logger. Call SetUpLogging
// once, from main(), before any thread starts; PrintError is thread-safe (one write(2) a line).
#ifndef ELRUN_LAUNCHER_REPORT_CONSOLE_H_
#define ELRUN_LAUNCHER_REPORT_CONSOLE_H_

#include <map>
#include <string>

namespace elrun {

// Prints "elrun: <message>" as one line on stderr.
void PrintError(const std::string& message);

// spdlog's default logger: stderr, "[elrun] level: message", level from LOGLEVEL (warn).
void SetUpLogging(const std::map<std::string, std::string>& env);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_REPORT_CONSOLE_H_
