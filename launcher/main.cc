// elrun: the command a user types. Parses torchrun's options, checks the entrypoint, then runs
// the job: on this node alone (--standalone, static) or through a rendezvous (the grpc or the
// etcd-v3 backend).
#include <unistd.h>

#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "agent/net/process_setup.h"
#include "launcher/cli/options.h"
#include "launcher/job/elastic_job.h"
#include "launcher/job/job_runtime.h"
#include "launcher/job/local_job.h"
#include "launcher/job/supervisor.h"
#include "launcher/os/host_info.h"
#include "launcher/os/output_pump.h"
#include "launcher/report/console.h"
#include "launcher/spec/rdzv_settings.h"
#include "launcher/worker/entrypoint.h"
#include "launcher/worker/env_contract.h"
#include "release/build_info.h"

extern char** environ;

namespace {

// Multi-node through the rendezvous, or this node alone.
bool NeedsRendezvous(const elrun::JobSpec& spec) {
  return !spec.standalone && spec.rdzv_backend != "static" && (spec.max_nodes > 1 || !spec.rdzv_endpoint.empty());
}

// Overwrites the values of token= and run_token= in elrun's own --rdzv-conf arguments, so
// that /proc/PID/cmdline no longer shows them to other users once parsed (the workers get
// copies of their own arguments, untouched). A short window after exec remains: prefer
// token_file= / run_token_file= or ELRUN_RDZV_TOKEN / ELRUN_RUN_TOKEN.
void ScrubTokens(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    bool value = i > 1 && (std::string(argv[i - 1]) == "--rdzv-conf" || std::string(argv[i - 1]) == "--rdzv_conf");
    if (!value && arg.rfind("--rdzv-conf=", 0) != 0 && arg.rfind("--rdzv_conf=", 0) != 0) continue;
    for (size_t at = arg.find("token="); at != std::string::npos; at = arg.find("token=", at + 1)) {
      for (size_t k = at + 6; k < arg.size() && argv[i][k] != ','; ++k) argv[i][k] = '*';
    }
  }
}

// This executable's path ("" when /proc is not there).
std::string SelfExe() {
  char path[4096];
  ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, static_cast<size_t>(n)) : std::string();
}

}  // namespace

int main(int argc, char** argv) {
  elrun::SetUpProcess();
  std::map<std::string, std::string> env = elrun::EnvToMap(environ);
  std::vector<std::string> args(argv + 1, argv + argc);
  auto lookup = [&env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  auto parsed = elrun::ParseCommandLine(args, lookup, elrun::DetectDevices(env));
  ScrubTokens(argc, argv);
  if (!parsed.ok()) {
    elrun::PrintError(std::string(parsed.status().message()));
    return elrun::kExitUsage;
  }
  if (parsed->version) {
    const std::string line = elrun::VersionLine("elrun");
    elrun::WriteAll(STDOUT_FILENO, line.data(), line.size());
    return elrun::kExitSuccess;
  }
  if (parsed->help) {
    elrun::WriteAll(STDOUT_FILENO, parsed->help->data(), parsed->help->size());
    return elrun::kExitSuccess;
  }
  const elrun::JobSpec& spec = parsed->spec;
  elrun::SetUpLogging(env);
  if (!parsed->slurm_note.empty()) spdlog::info("{}", parsed->slurm_note);

  std::optional<elrun::RdzvSettings> rdzv;
  if (NeedsRendezvous(spec)) {
    auto settings = elrun::ParseRdzvSettings(spec, env);
    if (!settings.ok()) {
      elrun::PrintError(std::string(settings.status().message()));
      return elrun::kExitUsage;
    }
    rdzv = *settings;
  }
  auto argv_template = elrun::ResolveEntrypoint(spec, env, elrun::DefaultPython(SelfExe()));
  if (!argv_template.ok()) {
    elrun::PrintError(std::string(argv_template.status().message()));
    return elrun::kExitUsage;
  }
  if (elrun::DefaultsOmpThreads(spec, env)) {
    spdlog::warn(
        "setting OMP_NUM_THREADS=1 for each worker to avoid overloading the machine; set it "
        "yourself to tune performance");
  }
  if (rdzv) return elrun::RunElasticJob(spec, env, *argv_template, *rdzv);
  return elrun::RunLocalJob(spec, env, *argv_template);
}
