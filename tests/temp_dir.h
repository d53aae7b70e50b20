// A fresh directory for one test: below $TEST_TMPDIR under Bazel, /tmp otherwise. Header-only.
#ifndef ELRUN_TESTS_TEMP_DIR_H_
#define ELRUN_TESTS_TEMP_DIR_H_

#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

namespace elrun::testing {

inline std::string MakeTempDir(const std::string& prefix = "test") {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base ? base : "/tmp") + "/" + prefix + "XXXXXX";
  REQUIRE(::mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

}  // namespace elrun::testing

#endif  // ELRUN_TESTS_TEMP_DIR_H_
