// What a binary was built from: the release version (the repository's VERSION file) and the git
// commit, stamped in at build time (scripts/workspace_status.sh; "unknown" outside a git
// checkout). The same values name the wheel (scripts/build_wheel.sh).
#ifndef ELRUN_RELEASE_BUILD_INFO_H_
#define ELRUN_RELEASE_BUILD_INFO_H_

#include <string>

namespace elrun {

// "0.1.0".
const char* BuildVersion();
// The commit's short hash, with "-dirty" when the work tree had changes; "unknown" when the
// build was not made from a git checkout.
const char* BuildCommit();
// What `<program> --version` prints: "elrun 0.1.0 (commit 58705a6c0f1e)\n".
std::string VersionLine(const std::string& program);

}  // namespace elrun

#endif  // ELRUN_RELEASE_BUILD_INFO_H_
