#include "agent/net/transport.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace elrun::rdzv {

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

}  // namespace elrun::rdzv
