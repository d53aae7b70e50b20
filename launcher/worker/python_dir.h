// The directory elrun writes its Python files to (python_files.h) for --start-method forkserver
// and --auto-heartbeat: $TMPDIR/elrun_py_<id>/, removed when elrun ends, by the guardian even
// after a kill -9. Thread-compatible.
#ifndef ELRUN_LAUNCHER_WORKER_PYTHON_DIR_H_
#define ELRUN_LAUNCHER_WORKER_PYTHON_DIR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/os/guardian.h"

namespace elrun {

class PythonDir {
 public:
  // Writes every file under a new directory in `tmp_dir`; `guardian` (which must outlive it)
  // removes them if elrun dies first.
  static absl::StatusOr<std::unique_ptr<PythonDir>> Create(const std::string& tmp_dir, Guardian& guardian);
  // Removes the files and the directory.
  ~PythonDir();
  PythonDir(const PythonDir&) = delete;
  PythonDir& operator=(const PythonDir&) = delete;

  const std::string& path() const { return path_; }
  std::string forkserver() const { return path_ + "/elrun_forkserver.py"; }
  // The directory --auto-heartbeat puts first on an exec'd worker's PYTHONPATH.
  std::string site() const { return path_ + "/site"; }

 private:
  PythonDir() = default;
  std::string path_;
  std::vector<std::string> made_;  // Files, then directories, in the order made.
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_WORKER_PYTHON_DIR_H_
