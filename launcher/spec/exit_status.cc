#include "launcher/spec/exit_status.h"

#include "absl/strings/str_cat.h"
#include "launcher/spec/value_parsers.h"

namespace elrun {

std::string ExitStatus::Describe() const {
  if (signal != 0) return absl::StrCat("signal ", SignalName(signal), " (", signal, ")");
  return absl::StrCat("exit code ", code);
}

}  // namespace elrun
