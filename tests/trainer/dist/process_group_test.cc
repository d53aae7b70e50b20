#include "trainer/dist/process_group.h"

#include <doctest/doctest.h>

namespace elrun::trainer {
namespace {

TEST_CASE("ReadDistEnv reads the env contract, a single first attempt by default") {
  auto single = ReadDistEnv({});
  REQUIRE(single.ok());
  CHECK(single->rank == 0);
  CHECK(single->world_size == 1);
  CHECK(single->restart_count == 0);

  auto worker = ReadDistEnv({{"RANK", "3"},
                             {"WORLD_SIZE", "4"},
                             {"LOCAL_RANK", "1"},
                             {"MASTER_ADDR", "h"},
                             {"MASTER_PORT", "29500"},
                             {"TORCHELASTIC_RESTART_COUNT", "2"}});
  REQUIRE(worker.ok());
  CHECK(worker->rank == 3);
  CHECK(worker->local_rank == 1);
  CHECK(worker->master_addr == "h");
  CHECK(worker->master_port == 29500);
  CHECK(worker->restart_count == 2);
}

TEST_CASE("ReadDistEnv names what is wrong") {
  auto bad_count = ReadDistEnv({{"TORCHELASTIC_RESTART_COUNT", "-1"}});
  REQUIRE(!bad_count.ok());
  CHECK(std::string(bad_count.status().message()) == "TORCHELASTIC_RESTART_COUNT=-1: expected an integer >= 0");
  auto no_port = ReadDistEnv({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}});
  REQUIRE(!no_port.ok());
  CHECK(std::string(no_port.status().message()).find("MASTER_PORT is not set") == 0);
  CHECK(!ReadDistEnv({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).ok());
}

}  // namespace
}  // namespace elrun::trainer
