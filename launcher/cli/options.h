// Turns elrun's command line into a JobSpec: torchrun's options in both spellings (--a-b and
// --a_b), each defaulting to the PET_A_B environment variable, then to torchrun's default
// (CLI > PET_* env > default). Pure: the environment and device counts come in as arguments,
// so this is thread-safe and testable without touching the process environment.
#ifndef ELRUN_LAUNCHER_CLI_OPTIONS_H_
#define ELRUN_LAUNCHER_CLI_OPTIONS_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/spec/job_spec.h"
#include "launcher/spec/value_parsers.h"

namespace elrun {

// Returns the value of an environment variable, or nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

struct ParsedCommandLine {
  // Set when --help was asked for: print it and exit 0; `spec` is then meaningless.
  std::optional<std::string> help;
  // Set by --version: print the version and exit 0; `spec` is then meaningless.
  bool version = false;
  JobSpec spec;
  // Under Slurm: one line saying which options came from SLURM_* variables; empty otherwise.
  std::string slurm_note;
};

// Parses args (without argv[0]). On bad input returns InvalidArgument whose message is one line
// naming the input and the problem, without the "elrun: " prefix. Does not look at the file
// system: the entrypoint is checked by ResolveEntrypoint.
absl::StatusOr<ParsedCommandLine> ParseCommandLine(const std::vector<std::string>& args, const EnvLookup& env,
                                                   const DeviceCounts& devices);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_CLI_OPTIONS_H_
