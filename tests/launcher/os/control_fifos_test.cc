#include "launcher/os/control_fifos.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "tests/temp_dir.h"

namespace elrun {
namespace {

std::string ReadAll(int fd) {
  std::string got;
  char buffer[256];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof(buffer))) > 0) got.append(buffer, static_cast<size_t>(n));
  return got;
}

TEST_CASE("ControlFifos makes one FIFO per local rank that a worker reads lines from") {
  const std::string parent = testing::MakeTempDir("fifos");
  std::string dir;
  {
    auto fifos = ControlFifos::Create(parent);
    REQUIRE(fifos.ok());
    dir = (*fifos)->dir();
    auto path = (*fifos)->PathFor(1);
    REQUIRE(path.ok());
    CHECK((*fifos)->PathFor(1).value() == *path);  // Made once, kept for replacements.
    struct stat st {};
    REQUIRE(::stat(path->c_str(), &st) == 0);
    CHECK(S_ISFIFO(st.st_mode));
    CHECK((st.st_mode & 0777) == 0600);

    // Written before any worker opened it: the line waits in the FIFO.
    CHECK((*fifos)->Send(*path, "regroup 1 RANK=1").ok());
    const int worker = ::open(path->c_str(), O_RDONLY | O_NONBLOCK);
    REQUIRE(worker >= 0);
    CHECK((*fifos)->Send(*path, "regroup 2 RANK=0").ok());
    CHECK(ReadAll(worker) == "regroup 1 RANK=1\nregroup 2 RANK=0\n");
    ::close(worker);

    CHECK((*fifos)->Send(dir + "/0", "x").code() == absl::StatusCode::kFailedPrecondition);  // Never made.
    CHECK((*fifos)->Send("/etc/passwd", "x").code() == absl::StatusCode::kFailedPrecondition);
    CHECK((*fifos)->Send(*path, "two\nlines").code() == absl::StatusCode::kInvalidArgument);
    CHECK((*fifos)->Send(*path, std::string(5000, 'x')).code() == absl::StatusCode::kInvalidArgument);
    auto spare = (*fifos)->PathFor(-1);  // A standby's slot.
    REQUIRE(spare.ok());
    CHECK(*spare != *path);
  }
  CHECK(::access(dir.c_str(), F_OK) != 0);  // Removed with what it held.
}

TEST_CASE("ControlFifos reports a full FIFO instead of blocking") {
  auto fifos = ControlFifos::Create(testing::MakeTempDir("fifos"));
  REQUIRE(fifos.ok());
  auto path = (*fifos)->PathFor(0);
  REQUIRE(path.ok());
  const std::string line(4000, 'x');
  absl::Status sent;
  for (int i = 0; i < 1000 && sent.ok(); ++i) sent = (*fifos)->Send(*path, line);  // A pipe holds 64 KiB.
  CHECK(sent.code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("ControlFifos refuses a parent it cannot write to") {
  CHECK(!ControlFifos::Create("/nonexistent/parent").ok());
}

}  // namespace
}  // namespace elrun
