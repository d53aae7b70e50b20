#include "launcher/spec/rdzv_settings.h"

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>

namespace elrun {
namespace {

JobSpec Spec(const std::string& endpoint, std::map<std::string, std::string> conf = {}) {
  JobSpec spec;
  spec.rdzv_backend = "grpc";
  spec.min_nodes = 2;
  spec.max_nodes = 4;
  spec.rdzv_endpoint = endpoint;
  spec.rdzv_conf = std::move(conf);
  return spec;
}

std::string ErrorOf(const JobSpec& spec, const std::map<std::string, std::string>& env = {}) {
  auto settings = ParseRdzvSettings(spec, env);
  REQUIRE_FALSE(settings.ok());
  return std::string(settings.status().message());
}

TEST_CASE("defaults") {
  auto s = ParseRdzvSettings(Spec("node0"), {});
  REQUIRE(s.ok());
  CHECK(s->host == "node0");
  CHECK(s->port == 29400);
  CHECK(s->join_timeout == std::chrono::seconds(600));
  CHECK(s->last_call_timeout == std::chrono::seconds(30));
  CHECK(s->heartbeat_interval == std::chrono::seconds(1));
  CHECK(s->heartbeat_timeout == std::chrono::seconds(5));
  CHECK(s->rejoin_timeout == std::chrono::seconds(5));  // heartbeat_timeout's.
  CHECK_FALSE(s->is_host.has_value());
  CHECK(s->token.empty());
  CHECK(s->Endpoint() == "node0:29400");
}

TEST_CASE("endpoints: host:port and [v6]:port") {
  CHECK(ParseRdzvSettings(Spec("127.0.0.1:1234"), {})->port == 1234);
  auto v6 = ParseRdzvSettings(Spec("[::1]:77"), {});
  REQUIRE(v6.ok());
  CHECK(v6->host == "::1");
  CHECK(v6->port == 77);
  CHECK(v6->Endpoint() == "[::1]:77");
  CHECK(ErrorOf(Spec("h:x")).rfind("--rdzv-endpoint=h:x: port", 0) == 0);
  CHECK(ErrorOf(Spec(":5")) == "--rdzv-endpoint=:5: no host");
  CHECK(ErrorOf(Spec("")).find("needs --rdzv-endpoint") != std::string::npos);
}

TEST_CASE("timeouts and flags from --rdzv-conf") {
  auto s = ParseRdzvSettings(Spec("h", {{"join_timeout", "20"},
                                        {"last_call_timeout", "0"},
                                        {"heartbeat_interval", "0.25"},
                                        {"heartbeat_timeout", "2"},
                                        {"is_host", "false"},
                                        {"timeout", "900"}}),
                             {});
  REQUIRE(s.ok());
  CHECK(s->join_timeout == std::chrono::seconds(20));
  CHECK(s->last_call_timeout.count() == 0);
  CHECK(s->heartbeat_interval == std::chrono::milliseconds(250));
  CHECK(s->heartbeat_timeout == std::chrono::seconds(2));
  CHECK(s->rejoin_timeout == std::chrono::seconds(2));
  CHECK(s->is_host == false);
  CHECK(ParseRdzvSettings(Spec("h", {{"rejoin_timeout", "0"}}), {})->rejoin_timeout == std::chrono::seconds(0));
  CHECK(ParseRdzvSettings(Spec("h", {{"rejoin_timeout", "45"}}), {})->rejoin_timeout == std::chrono::seconds(45));
  CHECK(ErrorOf(Spec("h", {{"rejoin_timeout", "-1"}})).rfind("--rdzv-conf rejoin_timeout=-1:", 0) == 0);
}

TEST_CASE("torchrun's keep_alive settings map onto the heartbeat") {
  auto s = ParseRdzvSettings(Spec("h", {{"keep_alive_interval", "2"}, {"keep_alive_max_attempt", "3"}}), {});
  REQUIRE(s.ok());
  CHECK(s->heartbeat_interval == std::chrono::seconds(2));
  CHECK(s->heartbeat_timeout == std::chrono::seconds(6));
}

TEST_CASE("token from --rdzv-conf wins over ELRUN_RDZV_TOKEN") {
  CHECK(ParseRdzvSettings(Spec("h"), {{"ELRUN_RDZV_TOKEN", "env"}})->token == "env");
  CHECK(ParseRdzvSettings(Spec("h", {{"token", "conf"}}), {{"ELRUN_RDZV_TOKEN", "env"}})->token == "conf");
}

TEST_CASE("bad settings are named") {
  CHECK(ErrorOf(Spec("h", {{"join_timeout", "soon"}})).rfind("--rdzv-conf join_timeout=soon:", 0) == 0);
  CHECK(ErrorOf(Spec("h", {{"join_timeout", "0"}})) == "--rdzv-conf join_timeout=0: must be > 0");
  CHECK(ErrorOf(Spec("h", {{"is_host", "maybe"}})).rfind("--rdzv-conf is_host=maybe:", 0) == 0);
  CHECK(ErrorOf(Spec("h", {{"colour", "red"}})).rfind("--rdzv-conf: unknown key 'colour'", 0) == 0);
  CHECK(ErrorOf(Spec("h", {{"heartbeat_timeout", "1"}})).find("must exceed heartbeat_interval") != std::string::npos);
  CHECK(ErrorOf(Spec("h", {{"tls_cert", "c.pem"}})) == "--rdzv-conf: tls_cert and tls_key go together");
}

}  // namespace
}  // namespace elrun

namespace elrun {
namespace {

TEST_CASE("token_file: the token from a file, kept off the command line") {
  std::string path = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/rdzv_token_test";
  FILE* f = std::fopen(path.c_str(), "w");
  REQUIRE(f != nullptr);
  std::fputs("from-file\n", f);
  std::fclose(f);
  CHECK(ParseRdzvSettings(Spec("h", {{"token_file", path}}), {{"ELRUN_RDZV_TOKEN", "env"}})->token == "from-file");
  CHECK(ErrorOf(Spec("h", {{"token_file", "/nonexistent/t"}})) ==
        "--rdzv-conf token_file=/nonexistent/t: cannot read a token from this file");
  // The etcd backend's password file goes by the same rule, into its own field.
  auto etcd = ParseRdzvSettings(Spec("h", {{"etcd_user", "root"}, {"etcd_password_file", path}}), {});
  REQUIRE(etcd.ok());
  CHECK(etcd->etcd_password == "from-file");
  CHECK(etcd->token.empty());
  std::remove(path.c_str());
}

TEST_CASE("run_token: from --rdzv-conf, run_token_file or ELRUN_RUN_TOKEN; apart from the token") {
  CHECK(ParseRdzvSettings(Spec("h"), {})->run_token.empty());
  CHECK(ParseRdzvSettings(Spec("h"), {{"ELRUN_RUN_TOKEN", "env"}})->run_token == "env");
  auto both = ParseRdzvSettings(Spec("h", {{"run_token", "conf"}, {"token", "t"}}), {{"ELRUN_RUN_TOKEN", "env"}});
  CHECK(both->run_token == "conf");
  CHECK(both->token == "t");
  std::string path =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/rdzv_run_token_test";
  FILE* f = std::fopen(path.c_str(), "w");
  REQUIRE(f != nullptr);
  std::fputs("run-from-file\n", f);
  std::fclose(f);
  CHECK(ParseRdzvSettings(Spec("h", {{"run_token_file", path}}), {})->run_token == "run-from-file");
  CHECK(ErrorOf(Spec("h", {{"run_token_file", "/nonexistent/t"}})) ==
        "--rdzv-conf run_token_file=/nonexistent/t: cannot read a token from this file");
  std::remove(path.c_str());
}

TEST_CASE("etcd-v3: a list of members, port 2379 by default, and etcd's own keys") {
  JobSpec spec = Spec(
      "e1,10.0.0.2:2479,[::1]",
      {{"etcd_prefix", "/jobs/"}, {"cacert", "ca.pem"}, {"cert", "c.pem"}, {"key", "c.key"}, {"protocol", "https"}});
  spec.rdzv_backend = "etcd-v3";
  auto s = ParseRdzvSettings(spec, {});
  REQUIRE(s.ok());
  CHECK(s->etcd_endpoints == std::vector<std::string>{"e1:2379", "10.0.0.2:2479", "[::1]:2379"});
  CHECK(s->host == "e1");
  CHECK(s->port == 2379);
  CHECK(s->etcd_prefix == "/jobs/");
  CHECK(s->tls_ca == "ca.pem");
  CHECK(s->tls_cert == "c.pem");
  CHECK(s->tls_key == "c.key");
  CHECK(s->etcd_https);
}

TEST_CASE("etcd-v3: bad members, prefixes and passwords are one-line errors") {
  auto etcd = [](const std::string& endpoint, std::map<std::string, std::string> conf = {}) {
    JobSpec spec = Spec(endpoint, std::move(conf));
    spec.rdzv_backend = "etcd-v3";
    return spec;
  };
  CHECK(ErrorOf(etcd("e1,,e2")).rfind("--rdzv-endpoint=e1,,e2:", 0) == 0);
  CHECK(ErrorOf(etcd("e1:0")).find("port 0") != std::string::npos);
  CHECK(ErrorOf(etcd("e1", {{"etcd_prefix", "jobs"}})).rfind("--rdzv-conf etcd_prefix=jobs:", 0) == 0);
  CHECK(ErrorOf(etcd("e1", {{"protocol", "ftp"}})).rfind("--rdzv-conf protocol=ftp:", 0) == 0);
  CHECK(ErrorOf(etcd("e1", {{"etcd_user", "root"}})).find("needs a password") != std::string::npos);
  auto with_env = ParseRdzvSettings(etcd("e1", {{"etcd_user", "root"}}), {{"ELRUN_ETCD_PASSWORD", "pw"}});
  REQUIRE(with_env.ok());
  CHECK(with_env->etcd_password == "pw");
  // A list is for etcd only: the grpc backend has one coordinator.
  CHECK(ErrorOf(Spec("a:1,b:2")).find("one coordinator only") != std::string::npos);
}

}  // namespace
}  // namespace elrun
