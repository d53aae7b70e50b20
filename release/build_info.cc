#include "release/build_info.h"

#include "absl/strings/str_cat.h"
#include "release/build_stamp.h"

namespace elrun {

const char* BuildVersion() { return kStampedVersion; }

const char* BuildCommit() { return kStampedCommit; }

std::string VersionLine(const std::string& program) {
  return absl::StrCat(program, " ", BuildVersion(), " (commit ", BuildCommit(), ")\n");
}

}  // namespace elrun
