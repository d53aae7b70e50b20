#include "agent/coordinator/wire_checks.h"

#include <doctest/doctest.h>

#include <string>

namespace elrun::rdzv {
namespace {

TEST_CASE("host names and address literals pass; anything else does not") {
  for (const char* good : {"127.0.0.1", "10.1.2.3", "::1", "fe80::1", "2001:db8::8a2e:370:7334", "localhost", "node-07",
                           "gpu07.cluster.example.org", "my_box", "a"}) {
    CHECK_MESSAGE(IsHostOrAddress(good), good);
  }
  for (std::string bad : {std::string(), std::string("evil\nLD_PRELOAD=/tmp/x.so"), std::string("a\0b", 3),
                          std::string("\x1b[2J"), std::string("host name"), std::string("-leading"),
                          std::string("trailing-"), std::string("a..b"), std::string("trailing."), std::string("1.2.3"),
                          std::string("999.1.1.1"), std::string("[::1]"), std::string("host:29500"), std::string("a/b"),
                          std::string(64, 'x') + ".org", std::string(254, 'a'), std::string("h\xc3\xa9"),
                          // An address literal with a NUL and a forged console line behind it
                          // (issue 31's attack: inet_pton stopped at the NUL and accepted it).
                          std::string("10.0.0.1\0\n[elrun] error: FORGED LINE\x1b[2J", 40), std::string("::1\0x", 5),
                          std::string("10.0.0.1\t"), std::string("10.0.0.1 ")}) {
    CHECK_FALSE_MESSAGE(IsHostOrAddress(bad), EscapeForConsole(bad));
  }
  absl::Status s = CheckHostOrAddress("master_addr", "evil\nX=1");
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()) == "master_addr 'evil\\nX=1' is not a host name or an IP address");
}

v1::RoundStarted GoodRound() {
  v1::RoundStarted r;
  r.set_round(3);
  r.set_group_rank(1);
  r.set_group_world_size(2);
  r.set_rank_offset(2);
  r.set_world_size(4);
  r.set_role_rank_offset(2);
  r.set_role_world_size(4);
  r.set_master_addr("10.0.0.1");
  r.set_master_port(29500);
  r.set_restart_count(1);
  return r;
}

TEST_CASE("a round no honest coordinator could send is refused, naming the field") {
  RoundExpectations expect{/*nproc=*/2, /*min_nodes=*/1, /*max_nodes=*/2, /*max_restarts=*/3, /*last_round=*/2};
  REQUIRE(ValidateRoundStarted(GoodRound(), expect).ok());
  struct Case {
    void (*mutate)(v1::RoundStarted&);
    const char* field;
  };
  // What a fake coordinator once made a worker run with: WORLD_SIZE=-3, RANK=-100, port 0.
  for (Case c : {Case{[](v1::RoundStarted& r) { r.set_world_size(-3); }, "world_size = -3"},
                 Case{[](v1::RoundStarted& r) { r.set_rank_offset(-100); }, "rank_offset = -100"},
                 Case{[](v1::RoundStarted& r) { r.set_master_port(0); }, "master_port = 0"},
                 Case{[](v1::RoundStarted& r) { r.set_master_port(70000); }, "master_port = 70000"},
                 Case{[](v1::RoundStarted& r) { r.set_restart_count(-7); }, "restart_count = -7"},
                 Case{[](v1::RoundStarted& r) { r.set_restart_count(4); }, "restart_count = 4"},
                 Case{[](v1::RoundStarted& r) { r.set_group_rank(2); }, "group_rank = 2"},
                 Case{[](v1::RoundStarted& r) { r.set_group_world_size(3); }, "group_world_size = 3"},
                 Case{[](v1::RoundStarted& r) { r.set_rank_offset(3); }, "rank_offset = 3"},
                 Case{[](v1::RoundStarted& r) { r.set_world_size(1); }, "world_size = 1"},
                 Case{[](v1::RoundStarted& r) { r.set_role_world_size(5); }, "role_world_size = 5"},
                 Case{[](v1::RoundStarted& r) { r.set_role_rank_offset(3); }, "role_rank_offset = 3"},
                 Case{[](v1::RoundStarted& r) { r.set_round(2); }, "round = 2"},
                 Case{[](v1::RoundStarted& r) { r.set_master_addr("x\n"); }, "master_addr 'x\\n'"},
                 Case{[](v1::RoundStarted& r) { r.set_master_addr(std::string("10.0.0.1\0\x1b[2J", 13)); },
                      "master_addr '10.0.0.1\\x00\\x1b[2J'"}}) {
    v1::RoundStarted r = GoodRound();
    c.mutate(r);
    absl::Status s = ValidateRoundStarted(r, expect);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK_MESSAGE(std::string(s.message()).rfind(c.field, 0) == 0, s.message());
  }
}

TEST_CASE("text from the network is escaped for the console") {
  CHECK(EscapeForConsole("local_rank 0 exit code 1") == "local_rank 0 exit code 1");
  CHECK(EscapeForConsole("a\nb\tc\r") == "a\\nb\\tc\\r");
  CHECK(EscapeForConsole("\x1b[31mred\x1b[0m") == "\\x1b[31mred\\x1b[0m");
  CHECK(EscapeForConsole(std::string("nul\0x", 5)) == "nul\\x00x");
  CHECK(EscapeForConsole("back\\slash") == "back\\\\slash");
  CHECK(EscapeForConsole("caf\xc3\xa9 \xe2\x9c\x93") == "caf\xc3\xa9 \xe2\x9c\x93");  // UTF-8 stays.
  CHECK(EscapeForConsole("\xc2\x9b"
                         "2J") == "\\u{009b}2J");  // C1 CSI.
  CHECK(EscapeForConsole("\xe2\x80\xae"
                         "txt") == "\\u{202e}txt");              // RLO.
  CHECK(EscapeForConsole("\xff\xc3") == "\\xff\\xc3");           // Invalid.
  CHECK(EscapeForConsole("\xe0\x80\xaf") == "\\xe0\\x80\\xaf");  // Overlong.
  CHECK(EscapeForConsole(std::string(10, 'x'), 4) == "xxxx...");
}

}  // namespace
}  // namespace elrun::rdzv
