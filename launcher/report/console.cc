#include "launcher/report/console.h"

#include <unistd.h>

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "launcher/os/output_pump.h"

namespace elrun {

void PrintError(const std::string& message) {
  std::string line = absl::StrCat("elrun: ", message, "\n");
  WriteAll(STDERR_FILENO, line.data(), line.size());
}

void SetUpLogging(const std::map<std::string, std::string>& env) {
  auto logger = spdlog::stderr_logger_st("elrun");
  logger->set_pattern("[elrun] %l: %v");
  // torchrun's logger honours LOGLEVEL and shows warnings by default; so do we.
  auto level = env.find("LOGLEVEL");
  logger->set_level(level == env.end() ? spdlog::level::warn
                                       : spdlog::level::from_str(absl::AsciiStrToLower(level->second)));
  spdlog::set_default_logger(logger);
}

}  // namespace elrun
