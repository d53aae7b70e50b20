#include "trainer/runtime/thread_times.h"

#include <time.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace elrun::trainer {

absl::StatusOr<ThreadTimes> ParseSchedstat(absl::string_view text) {
  std::vector<absl::string_view> fields = absl::StrSplit(absl::StripAsciiWhitespace(text), ' ', absl::SkipEmpty());
  uint64_t on_cpu = 0, waiting = 0;
  if (fields.size() < 2 || !absl::SimpleAtoi(fields[0], &on_cpu) || !absl::SimpleAtoi(fields[1], &waiting)) {
    return absl::InvalidArgumentError(absl::StrCat("schedstat: expected \"<run ns> <wait ns> <slices>\", got \"",
                                                   absl::StripAsciiWhitespace(text), "\""));
  }
  return ThreadTimes{static_cast<double>(on_cpu) * 1e-9, static_cast<double>(waiting) * 1e-9};
}

double ThreadCpuSeconds() {
  struct timespec now {};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

absl::StatusOr<ThreadTimes> CurrentThreadTimes() {
  std::ifstream in("/proc/thread-self/schedstat");
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return absl::UnavailableError("schedstat: cannot read /proc/thread-self/schedstat");
  return ParseSchedstat(text.str());
}

}  // namespace elrun::trainer
