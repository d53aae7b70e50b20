// elrun: the command a user types. Parses torchrun's options and runs the job on this node.
#include <unistd.h>

#include <string>
#include <vector>

#include "launcher/env_contract.h"
#include "launcher/host_info.h"
#include "launcher/local_job.h"
#include "launcher/options.h"
#include "launcher/output_pump.h"
#include "launcher/supervisor.h"

extern char** environ;

int main(int argc, char** argv) {
  std::map<std::string, std::string> env = elrun::EnvToMap(environ);
  std::vector<std::string> args(argv + 1, argv + argc);
  auto lookup = [&env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  auto parsed = elrun::ParseCommandLine(args, lookup, elrun::DetectDevices(env));
  if (!parsed.ok()) {
    std::string line = "elrun: " + std::string(parsed.status().message()) + "\n";
    elrun::WriteAll(STDERR_FILENO, line.data(), line.size());
    return elrun::kExitUsage;
  }
  if (parsed->help) {
    elrun::WriteAll(STDOUT_FILENO, parsed->help->data(), parsed->help->size());
    return elrun::kExitSuccess;
  }
  return elrun::RunLocalJob(parsed->spec, env);
}
