// The coordinator with TLS on loopback: mutual TLS works; plaintext and certificate-less agents
// are refused. Certificates come from testdata/make_certs.sh (a throw-away CA).
#include <doctest/doctest.h>

#include <cstdlib>

#include "agent/grpc/coordinator_server.h"
#include "agent/grpc/rendezvous_client.h"
#include "tests/agent/grpc/client_wait.h"

namespace elrun::rdzv {
namespace {

std::string Cert(const std::string& name) {
  const char* root = std::getenv("TEST_SRCDIR");
  REQUIRE(root != nullptr);
  return std::string(root) + "/elrun/tests/agent/grpc/certs/" + name;
}

v1::AgentMessage Join() {
  v1::AgentMessage m;
  v1::Join* join = m.mutable_join();
  join->set_protocol_version(kProtocolVersion);
  join->set_run_id("job");
  join->set_node_id("a");
  join->set_nproc(1);
  join->set_role("default");
  join->set_rank_hint(-1);
  join->set_master_addr("127.0.0.1");
  join->set_master_port(1);
  join->mutable_settings()->set_min_nodes(2);
  join->mutable_settings()->set_max_nodes(2);
  join->mutable_settings()->set_join_timeout_ms(60000);
  join->mutable_settings()->set_heartbeat_timeout_ms(60000);
  join->mutable_settings()->set_close_timeout_ms(30000);
  return m;
}

std::unique_ptr<CoordinatorServer> StartTlsServer() {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.tls = {Cert("server.pem"), Cert("server.key"), Cert("ca.pem")};
  auto server = CoordinatorServer::Start(options);
  REQUIRE_MESSAGE(server.ok(), server.status().ToString());
  return *std::move(server);
}

std::unique_ptr<RendezvousClient> Connect(int port, TlsFiles tls) {
  ClientOptions options;
  options.endpoint = "127.0.0.1:" + std::to_string(port);
  options.tls = std::move(tls);
  options.connect_timeout = std::chrono::milliseconds(1500);
  auto client = RendezvousClient::Open(options);
  REQUIRE(client.ok());
  return *std::move(client);
}

TEST_CASE("mutual TLS: an agent with a certificate from the CA joins") {
  auto server = StartTlsServer();
  auto client = Connect(server->port(), {Cert("client.pem"), Cert("client.key"), Cert("ca.pem")});
  std::string mine, theirs;
  SendFirstJoin(*client, Join(), "", &mine, &theirs);
  CHECK(AfterWelcome(*client, "", mine, theirs).front().has_waiting());
}

TEST_CASE("a plaintext agent cannot reach a TLS coordinator") {
  auto server = StartTlsServer();
  auto client = Connect(server->port(), {});
  client->Write(Join());
  CHECK(WaitEnded(*client).code() == absl::StatusCode::kUnavailable);
  CHECK(server->coordinator().job_count() == 0);
}

TEST_CASE("an agent without a client certificate is refused") {
  auto server = StartTlsServer();
  auto client = Connect(server->port(), {"", "", Cert("ca.pem")});
  client->Write(Join());
  CHECK(WaitEnded(*client).code() == absl::StatusCode::kUnavailable);
  CHECK(server->coordinator().job_count() == 0);
}

TEST_CASE("missing TLS files are a clear error") {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.tls = {"/nonexistent/cert.pem", "/nonexistent/key.pem", ""};
  auto server = CoordinatorServer::Start(options);
  CHECK(server.status().code() == absl::StatusCode::kNotFound);
  CHECK(server.status().message() == "cannot read /nonexistent/cert.pem");
}

}  // namespace
}  // namespace elrun::rdzv
