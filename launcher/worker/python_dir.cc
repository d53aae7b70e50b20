#include "launcher/worker/python_dir.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "launcher/worker/python_files.h"

namespace elrun {

absl::StatusOr<std::unique_ptr<PythonDir>> PythonDir::Create(const std::string& tmp_dir, Guardian& guardian) {
  std::unique_ptr<PythonDir> dir(new PythonDir());
  std::string pattern = absl::StrCat(tmp_dir, "/elrun_py_XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("mkdtemp ", pattern, ": ", std::strerror(errno)));
  }
  dir->path_ = pattern;
  dir->made_.push_back(pattern);
  const std::string site = dir->site();
  if (::mkdir(site.c_str(), 0700) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("mkdir ", site, ": ", std::strerror(errno)));
  }
  dir->made_.push_back(site);
  for (const EmbeddedFile* file = kPythonFiles; file->path != nullptr; ++file) {
    std::string path = absl::StrCat(dir->path_, "/", file->path);
    std::ofstream out(path, std::ios::trunc);
    out << file->text;
    out.close();
    dir->made_.push_back(path);
    if (!out) return absl::FailedPreconditionError(absl::StrCat("cannot write ", path));
  }
  // Files before the directories that hold them: the guardian removes in the order given.
  for (auto it = dir->made_.rbegin(); it != dir->made_.rend(); ++it) guardian.RemoveOnDeath(*it);
  return dir;
}

PythonDir::~PythonDir() {
  for (auto it = made_.rbegin(); it != made_.rend(); ++it) {
    if (::unlink(it->c_str()) != 0) ::rmdir(it->c_str());
  }
}

}  // namespace elrun
