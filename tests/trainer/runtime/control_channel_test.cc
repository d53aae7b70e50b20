#include "trainer/runtime/control_channel.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include <doctest/doctest.h>
#include "tests/temp_dir.h"

namespace elrun::trainer {
namespace {

constexpr char kGood[] = "regroup 3 RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500";

TEST_CASE("ParseRegroup reads the generation and the env contract") {
  auto regroup = ParseRegroup(kGood);
  REQUIRE(regroup.ok());
  CHECK(regroup->generation == 3);
  CHECK(regroup->env.at("RANK") == "1");
  CHECK(regroup->env.at("WORLD_SIZE") == "4");
  CHECK(regroup->env.at("MASTER_ADDR") == "127.0.0.1");
  CHECK(regroup->env.at("MASTER_PORT") == "29500");
  CHECK(regroup->env.at("TORCHELASTIC_RESTART_COUNT") == "3");  // Not given: the generation.
}

TEST_CASE("ParseRegroup takes a multi-node round's restart count, above the generation too") {
  const std::string base = "regroup 5 RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=a MASTER_PORT=1";
  auto regroup = ParseRegroup(base + " TORCHELASTIC_RESTART_COUNT=2");
  REQUIRE(regroup.ok());
  CHECK(regroup->generation == 5);
  CHECK(regroup->env.at("TORCHELASTIC_RESTART_COUNT") == "2");
  // A node that joined late: its second attempt, the job's seventh restart.
  CHECK(ParseRegroup(base + " TORCHELASTIC_RESTART_COUNT=7").ok());
  CHECK(!ParseRegroup(base + " TORCHELASTIC_RESTART_COUNT=99999999999").ok());
  CHECK(!ParseRegroup(base + " TORCHELASTIC_RESTART_COUNT=-1").ok());
  CHECK(!ParseRegroup(base + " TORCHELASTIC_RESTART_COUNT=x").ok());
}

TEST_CASE("ParseRegroup refuses what elrun never writes") {
  CHECK(!ParseRegroup("").ok());
  CHECK(!ParseRegroup("stop 3").ok());
  CHECK(!ParseRegroup("regroup -1 RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=a MASTER_PORT=1").ok());
  CHECK(!ParseRegroup("regroup x RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=a MASTER_PORT=1").ok());
  CHECK(!ParseRegroup("regroup 3 RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=a").ok());  // No port.
  CHECK(!ParseRegroup("regroup 3 RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=a MASTER_PORT=1 LD_PRELOAD=x").ok());
  CHECK(!ParseRegroup("regroup 3 RANK WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=a MASTER_PORT=1").ok());
  CHECK(
      !ParseRegroup(std::string("regroup 3 RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=a\x1b[2J MASTER_PORT=1")).ok());
  CHECK(!ParseRegroup(std::string(2000, 'r')).ok());
}

TEST_CASE("ControlChannel hands over the newest generation and drops stale ones") {
  const std::string path = testing::MakeTempDir("control") + "/control";
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
  const int writer = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);  // As elrun holds it.
  REQUIRE(writer >= 0);
  auto channel = ControlChannel::FromEnvironment({{"ELRUN_CONTROL_FILE", path}}, 2);
  REQUIRE(channel != nullptr);
  CHECK(!channel->pending());
  CHECK(!channel->Wait(std::chrono::milliseconds(20)).has_value());

  auto send = [&](const std::string& line) {
    REQUIRE(::write(writer, line.data(), line.size()) == static_cast<ssize_t>(line.size()));
  };
  send("regroup 2 RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=h MASTER_PORT=1\n");  // Its own: stale.
  send("garbage\n");
  send(std::string(kGood) + "\n");
  auto taken = channel->Wait(std::chrono::seconds(10));
  REQUIRE(taken.has_value());
  CHECK(taken->generation == 3);
  CHECK(channel->generation() == 3);
  CHECK(!channel->pending());

  send("regroup 3 RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=h MASTER_PORT=1\n");  // Now stale too.
  send("regroup 5 RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=h MASTER_PORT=7\n");
  taken = channel->Wait(std::chrono::seconds(10));
  REQUIRE(taken.has_value());
  CHECK(taken->generation == 5);
  CHECK(taken->env.at("MASTER_PORT") == "7");
  ::close(writer);
}

TEST_CASE("ControlChannel is absent without ELRUN_CONTROL_FILE or with a path that cannot be opened") {
  CHECK(ControlChannel::FromEnvironment({}, 0) == nullptr);
  CHECK(ControlChannel::FromEnvironment({{"ELRUN_CONTROL_FILE", "/nonexistent/dir/control"}}, 0) == nullptr);
}

}  // namespace
}  // namespace elrun::trainer
