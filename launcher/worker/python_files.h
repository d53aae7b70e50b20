// elrun's own Python files, built into the binary (launcher/python, by a genrule): the
// forkserver, --auto-heartbeat's hook and sitecustomize, and the heartbeat helper they use.
#ifndef ELRUN_LAUNCHER_WORKER_PYTHON_FILES_H_
#define ELRUN_LAUNCHER_WORKER_PYTHON_FILES_H_

namespace elrun {

struct EmbeddedFile {
  const char* path;  // Relative to launcher/python: "elrun_forkserver.py", "site/sitecustomize.py".
  const char* text;
};

// Ends with {nullptr, nullptr}.
extern const EmbeddedFile kPythonFiles[];

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_WORKER_PYTHON_FILES_H_
