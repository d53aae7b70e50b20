#include "launcher/worker/entrypoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace elrun {
namespace {

constexpr char kRunPathBootstrap[] =
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')";

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsElf(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char magic[4] = {};
  ssize_t n = ::read(fd, magic, sizeof(magic));
  ::close(fd);
  return n == 4 && magic[0] == 0x7f && magic[1] == 'E' && magic[2] == 'L' && magic[3] == 'F';
}

std::string EnvOr(const std::map<std::string, std::string>& env, const std::string& name, const std::string& fallback) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? fallback : it->second;
}

absl::StatusOr<std::string> FindPython(const std::map<std::string, std::string>& env,
                                       const std::string& default_python) {
  std::string python = EnvOr(env, "PYTHON_EXEC", default_python);
  auto found = FindExecutable(python, EnvOr(env, "PATH", ""));
  if (!found.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("python interpreter '", python, "': ", found.status().message(),
                                                   "; set PYTHON_EXEC or use --no-python"));
  }
  return *found;
}

}  // namespace

absl::StatusOr<std::string> FindExecutable(const std::string& name, const std::string& path_var) {
  auto check = [](const std::string& candidate) -> absl::Status {
    if (!IsRegularFile(candidate)) return absl::NotFoundError("not found");
    if (::access(candidate.c_str(), X_OK) != 0) {
      return absl::PermissionDeniedError("not executable (chmod +x it)");
    }
    return absl::OkStatus();
  };
  if (name.find('/') != std::string::npos) {
    absl::Status status = check(name);
    if (!status.ok()) return status;
    return name;
  }
  for (absl::string_view dir : absl::StrSplit(path_var, ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/", name);
    if (check(candidate).ok()) return candidate;
  }
  return absl::NotFoundError("not found on PATH");
}

std::string DefaultPython(const std::string& self_exe) {
  size_t slash = self_exe.rfind('/');
  if (slash == std::string::npos) return "python3";
  std::string beside = self_exe.substr(0, slash + 1) + "python3";
  return FindExecutable(beside, "").ok() ? beside : "python3";
}

absl::StatusOr<std::vector<std::string>> ResolveEntrypoint(const JobSpec& spec,
                                                           const std::map<std::string, std::string>& env,
                                                           const std::string& default_python) {
  const std::string& script = spec.training_script;
  std::vector<std::string> argv;

  if (spec.no_python) {
    auto binary = FindExecutable(script, EnvOr(env, "PATH", ""));
    if (!binary.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--no-python ", script, ": ", binary.status().message()));
    }
    argv.push_back(*binary);
  } else if (spec.module) {
    auto python = FindPython(env, default_python);
    if (!python.ok()) return python.status();
    argv = {*python, "-u", "-m", script};
  } else {
    if (!IsRegularFile(script)) {
      return absl::InvalidArgumentError(absl::StrCat("training script '", script, "' not found (no such file)"));
    }
    if (!spec.run_path && IsElf(script)) {
      // Python cannot run a compiled binary; run it as --no-python would.
      if (::access(script.c_str(), X_OK) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("training script '", script, "' is a binary but not executable"));
      }
      argv.push_back(script.find('/') == std::string::npos ? "./" + script : script);
    } else {
      auto python = FindPython(env, default_python);
      if (!python.ok()) return python.status();
      if (spec.run_path) {
        argv = {*python, "-u", "-c", kRunPathBootstrap, script};
      } else {
        argv = {*python, "-u", script};
      }
    }
  }
  argv.insert(argv.end(), spec.training_script_args.begin(), spec.training_script_args.end());
  return argv;
}

bool RunsPython(const JobSpec& spec) {
  if (spec.no_python) return false;
  return spec.module || spec.run_path || !IsElf(spec.training_script);
}

std::vector<std::string> SubstituteLocalRank(const std::vector<std::string>& argv, int local_rank) {
  std::vector<std::string> out = argv;
  std::string rank = std::to_string(local_rank);
  for (size_t i = 1; i < out.size(); ++i) {
    out[i] = absl::StrReplaceAll(out[i], {{"${local_rank}", rank}});
  }
  return out;
}

}  // namespace elrun
