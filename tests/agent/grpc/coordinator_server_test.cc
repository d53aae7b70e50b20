// The coordinator over real gRPC on loopback: the client's stream, token checks, size limits.
#include <doctest/doctest.h>

#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/sync_stream.h>

#include "agent/grpc/coordinator_server.h"
#include "agent/grpc/rendezvous_client.h"
#include "tests/agent/grpc/client_wait.h"

namespace elrun::rdzv {
namespace {

v1::AgentMessage Join(const std::string& node, int nodes = 2) {
  v1::AgentMessage m;
  v1::Join* join = m.mutable_join();
  join->set_protocol_version(kProtocolVersion);
  join->set_run_id("job");
  join->set_node_id(node);
  join->set_nproc(1);
  join->set_role("default");
  join->set_rank_hint(-1);
  join->set_master_addr("127.0.0.1");
  join->set_master_port(12345);
  join->mutable_settings()->set_min_nodes(nodes);
  join->mutable_settings()->set_max_nodes(nodes);
  join->mutable_settings()->set_last_call_timeout_ms(1000);
  join->mutable_settings()->set_join_timeout_ms(60000);
  join->mutable_settings()->set_heartbeat_timeout_ms(60000);
  join->mutable_settings()->set_close_timeout_ms(30000);
  return m;
}

std::unique_ptr<CoordinatorServer> StartServer(const std::string& token = "") {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.token = token;
  auto server = CoordinatorServer::Start(options);
  REQUIRE_MESSAGE(server.ok(), server.status().ToString());
  return *std::move(server);
}

std::unique_ptr<RendezvousClient> Connect(int port) {
  ClientOptions options;
  options.endpoint = "127.0.0.1:" + std::to_string(port);
  auto client = RendezvousClient::Open(options);
  REQUIRE(client.ok());
  return *std::move(client);
}

// Joins through the whole handshake; returns the first messages after the Welcome.
std::deque<v1::CoordinatorMessage> JoinAs(RendezvousClient& client, const std::string& node,
                                          const std::string& token = "") {
  std::string mine, theirs;
  SendFirstJoin(client, Join(node), token, &mine, &theirs);
  return AfterWelcome(client, token, mine, theirs);
}

TEST_CASE("two agents form a round over gRPC") {
  auto server = StartServer();
  CHECK(server->port() > 0);
  auto a = Connect(server->port());
  auto b = Connect(server->port());
  CHECK(JoinAs(*a, "a").front().has_waiting());
  auto from_b = JoinAs(*b, "b");
  REQUIRE_FALSE(from_b.empty());
  CHECK(from_b.back().round_started().group_world_size() == 2);
}

TEST_CASE("a closed stream is a lost node, pushed to the survivor at once") {
  auto server = StartServer();
  auto a = Connect(server->port());
  auto b = Connect(server->port());
  JoinAs(*a, "a");
  JoinAs(*b, "b");
  auto started = Next(*a);
  REQUIRE(started.back().has_round_started());
  b.reset();  // The agent dies.
  auto ended = Next(*a);
  REQUIRE_FALSE(ended.empty());
  CHECK(ended.back().round_ended().reason() == v1::RoundEnded::NODE_LOST);
}

TEST_CASE("the token is proven, never sent, and checked both ways") {
  auto server = StartServer("s3cret");
  auto none = Connect(server->port());
  SendFirstJoin(*none, Join("a"), "");
  absl::Status status = WaitEnded(*none);
  CHECK(status.code() == absl::StatusCode::kUnauthenticated);
  CHECK(std::string(status.message()).find("requires a token") != std::string::npos);

  auto wrong = Connect(server->port());
  SendFirstJoin(*wrong, Join("a"), "guess");
  CHECK(WaitEnded(*wrong).message() == "wrong rendezvous token");

  // A proof made for another session's nonce (a replay) is refused too.
  auto first = Connect(server->port());
  auto replay = Connect(server->port());
  std::string first_nonce, first_server_nonce;
  SendFirstJoin(*first, Join("b"), "s3cret", &first_nonce, &first_server_nonce);
  CHECK(AfterWelcome(*first, "s3cret", first_nonce, first_server_nonce).front().has_waiting());
  std::deque<v1::CoordinatorMessage> challenge = Next(*replay);
  REQUIRE(challenge.front().has_challenge());
  v1::AgentMessage stolen = Join("b2");
  stolen.mutable_join()->set_client_nonce(first_nonce);
  stolen.mutable_join()->set_proof(AgentProof(TokenKey("s3cret"), first_server_nonce, first_nonce, "job", "b2"));
  REQUIRE(replay->Write(stolen));
  CHECK(WaitEnded(*replay).message() == "wrong rendezvous token");

  auto right = Connect(server->port());
  // The Welcome's proof is checked; b and a, and none of the others, form the round.
  CHECK(JoinAs(*right, "a", "s3cret").back().has_round_started());
  CHECK(server->coordinator().View("job")->active == 2);
}

TEST_CASE("a bad message ends that stream with its reason, and only that stream") {
  auto server = StartServer();
  auto good = Connect(server->port());
  auto bad = Connect(server->port());
  JoinAs(*good, "a");
  v1::AgentMessage message = Join("b");
  message.mutable_join()->set_nproc(0);
  SendFirstJoin(*bad, message, "");
  absl::Status status = WaitEnded(*bad);
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(status.message()).find("nproc") != std::string::npos);
  CHECK(server->coordinator().View("job")->pending == 1);
}

TEST_CASE("messages over the size limit are refused") {
  auto server = StartServer();
  auto client = Connect(server->port());
  v1::AgentMessage message = Join("a");
  message.mutable_join()->set_node_id(std::string(100 * 1024, 'x'));
  REQUIRE(Next(*client).front().has_challenge());
  client->Write(message);  // The client's own limit may refuse it before sending.
  absl::Status status = WaitEnded(*client);
  CHECK(status.code() == absl::StatusCode::kResourceExhausted);
  CHECK(server->coordinator().job_count() == 0);
}

// A Session stream in raw bytes on `channel`, under `context`.
std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> RawSession(
    const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context) {
  grpc::internal::RpcMethod method("/elrun.rdzv.v1.Rendezvous/Session", grpc::internal::RpcMethod::BIDI_STREAMING,
                                   channel);
  return std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(), method,
                                                                                            context));
}

// Sends `bytes` as one raw message on a Session stream and returns how the stream ended. A
// second message from the coordinator (after its Challenge: the bytes parsed) cancels the
// stream; `replies` counts them.
grpc::Status SendRaw(int port, const std::string& bytes, int* replies = nullptr) {
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = RawSession(channel, &context);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer buffer(&slice, 1);
  stream->Write(buffer);
  grpc::ByteBuffer reply;
  int count = 0;
  while (stream->Read(&reply)) {
    if (replies != nullptr) *replies = count + 1;
    if (++count == 2) context.TryCancel();  // The Challenge, then an answer to the message.
  }
  return stream->Finish();
}

TEST_CASE("unparsable or truncated messages end the stream with INVALID_ARGUMENT, not OK") {
  auto server = StartServer();
  std::string whole = Join("a").SerializeAsString();
  for (const std::string& bytes : {std::string("\xff\xff\xff\xff garbage"), whole.substr(0, whole.size() / 2)}) {
    grpc::Status status = SendRaw(server->port(), bytes);
    CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_MESSAGE(status.error_message().find("unparsable message") != std::string::npos, status.error_message());
  }
  CHECK(server->coordinator().job_count() == 0);
  int replies = 0;  // The whole message parses: the agent joined and was answered.
  CHECK(SendRaw(server->port(), whole, &replies).error_code() == grpc::StatusCode::CANCELLED);
  CHECK(replies == 2);  // The Challenge, then the Welcome: it was read as a Join.
}

// Entries of `dir` whose names start with `prefix`.
std::vector<std::string> Entries(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> found;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) found.push_back(e->d_name);
    }
    ::closedir(d);
  }
  return found;
}

TEST_CASE("the private socket directory goes with the server, and a killed one's with the next") {
  const char* tmp = std::getenv("TMPDIR");  // As the server picks it.
  const std::string base = tmp != nullptr && *tmp != '\0' && std::strlen(tmp) < 64 ? tmp : "/tmp";
  std::string mine = "elrun-rdzv-" + std::to_string(::getpid()) + "-";
  {
    auto server = StartServer();
    CHECK(Entries(base, mine).size() == 1);
  }
  CHECK(Entries(base, mine).empty());
  // What a coordinator killed with SIGKILL leaves: its directory, named with its dead pid.
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  REQUIRE(::waitpid(child, nullptr, 0) == child);
  std::string stale = base + "/elrun-rdzv-" + std::to_string(child) + "-test01";
  REQUIRE(::mkdir(stale.c_str(), 0700) == 0);
  FILE* socket_file = std::fopen((stale + "/coordinator.sock").c_str(), "w");
  REQUIRE(socket_file != nullptr);
  std::fclose(socket_file);
  auto server = StartServer();
  CHECK(::access(stale.c_str(), F_OK) != 0);
}

TEST_CASE("a connection whose session never proves the token is closed by the gate; a joined agent's stays") {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.token = "s3cret";
  options.gate.auth_timeout = std::chrono::milliseconds(500);
  auto started = CoordinatorServer::Start(options);
  REQUIRE_MESSAGE(started.ok(), started.status().ToString());
  auto server = *std::move(started);
  auto a = Connect(server->port());
  CHECK(JoinAs(*a, "a", "s3cret").front().has_waiting());
  // Issue 31's idle connection: it speaks HTTP/2 and opens a session, then never joins. A
  // connection of its own: gRPC shares one among channels to the same address otherwise.
  grpc::ChannelArguments own;
  own.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel =
      grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server->port()), grpc::InsecureChannelCredentials(), own);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto idle = RawSession(channel, &context);
  const auto opened = std::chrono::steady_clock::now();
  grpc::ByteBuffer challenge;
  CHECK(idle->Read(&challenge));
  while (idle->Read(&challenge)) {
  }
  const grpc::Status ended = idle->Finish();
  CHECK(ended.error_code() == grpc::StatusCode::UNAVAILABLE);                  // The connection went, not the session.
  CHECK(std::chrono::steady_clock::now() - opened < std::chrono::seconds(5));  // Not the 10 s first-Join limit.
  const GateCounts counts = server->gate_counts();
  CHECK(counts.authenticated == 1);  // The agent's connection, named by gRPC's peer.
  CHECK(counts.unauthenticated_closed == 1);
  // The agent's connection outlived the deadline: its node is still in, and a second one forms
  // the round with it.
  auto b = Connect(server->port());
  CHECK(JoinAs(*b, "b", "s3cret").back().has_round_started());
  CHECK(Next(*a).back().has_round_started());
}

TEST_CASE("a second server on the same port fails to start") {
  auto server = StartServer();
  ServerOptions options;
  options.listen = "127.0.0.1:" + std::to_string(server->port());
  auto second = CoordinatorServer::Start(options);
  CHECK(second.status().code() == absl::StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace elrun::rdzv
