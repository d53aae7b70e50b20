// Coverage-guided fuzzing (libFuzzer, clang) of what the network feeds the rendezvous:
// - the coordinator's handling of agent messages: sessions connect, send, leave and time passes
//   as the input says; each Join starts from a valid one with the input's bytes merged over it
//   (MergeFromString), so the fuzzer spends its time on the checks, not on finding the version;
// - the agent's handling of coordinator messages: arbitrary bytes parsed as a
//   CoordinatorMessage, its RoundStarted validated and its texts escaped for the console.
// A crash, a sanitizer report or a broken invariant (__builtin_trap) is a finding.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "agent/coordinator/coordinator.h"
#include "agent/coordinator/wire_checks.h"

namespace elrun::rdzv {
namespace {

// Every RoundStarted the coordinator sends must be one an agent accepts as well-formed.
class CheckingSink : public SessionSink {
 public:
  void Send(const v1::CoordinatorMessage& message) override {
    if (!message.has_round_started()) return;
    const v1::RoundStarted& r = message.round_started();
    if (r.group_rank() < 0 || r.group_rank() >= r.group_world_size()) __builtin_trap();
    if (r.world_size() < r.group_world_size() || r.rank_offset() < 0 || r.rank_offset() >= r.world_size()) {
      __builtin_trap();
    }
    if (r.restart_count() < 0 || r.master_port() < 1 || r.master_port() > 65535) __builtin_trap();
    if (!IsHostOrAddress(r.master_addr())) __builtin_trap();
  }
  void Close(const absl::Status&) override {}
};

v1::AgentMessage ValidJoin(int session) {
  v1::AgentMessage m;
  v1::Join* join = m.mutable_join();
  join->set_protocol_version(kProtocolVersion);
  join->set_run_id(session % 2 ? "a" : "b");
  join->set_node_id("n" + std::to_string(session));
  join->set_nproc(1 + session % 3);
  join->set_role("default");
  join->set_rank_hint(-1);
  join->set_master_addr("127.0.0." + std::to_string(session + 1));
  join->set_master_port(20000 + session);
  v1::JobSettings* s = join->mutable_settings();
  s->set_min_nodes(2);
  s->set_max_nodes(4);
  s->set_max_restarts(3);
  s->set_last_call_timeout_ms(500);
  s->set_join_timeout_ms(20000);
  s->set_heartbeat_timeout_ms(5000);
  s->set_close_timeout_ms(30000);
  return m;
}

void FuzzCoordinator(const uint8_t* data, size_t size) {
  Coordinator coordinator(Coordinator::Options{std::chrono::seconds(10), "",
                                               [](SessionId id) { return std::string(32, static_cast<char>(id)); }});
  constexpr int kSessions = 8;
  std::map<int, std::unique_ptr<CheckingSink>> sinks;
  TimePoint now{std::chrono::seconds(1000)};
  size_t i = 0;
  while (i + 2 <= size) {
    uint8_t op = data[i];
    size_t length = data[i + 1];
    i += 2;
    if (length > size - i) length = size - i;
    std::string bytes(reinterpret_cast<const char*>(data + i), length);
    i += length;
    int session = op % kSessions;
    SessionId id = 100 + session;
    switch ((op / kSessions) % 4) {
      case 0:  // Connect, or a Join merged from the bytes.
        if (!sinks.count(session)) {
          sinks[session] = std::make_unique<CheckingSink>();
          coordinator.OnConnect(id, sinks[session].get(), now);
        } else {
          v1::AgentMessage join = ValidJoin(session);
          join.MergeFromString(bytes);  // Partial or failed merges are inputs too.
          coordinator.OnMessage(id, join, now).IgnoreError();
        }
        break;
      case 1:  // Any message, straight from the bytes.
        if (sinks.count(session)) {
          v1::AgentMessage message;
          if (message.ParseFromString(bytes)) coordinator.OnMessage(id, message, now).IgnoreError();
        }
        break;
      case 2:  // Time passes.
        now += std::chrono::milliseconds(length * 97);
        coordinator.Tick(now);
        break;
      case 3:  // The session ends.
        if (sinks.count(session)) {
          coordinator.OnDisconnect(id, now);
          sinks.erase(session);
        }
        break;
    }
  }
  for (auto& [session, sink] : sinks) coordinator.OnDisconnect(100 + session, now);
  if (coordinator.job_count() != 0) __builtin_trap();  // Nobody left: every job forgotten.
}

void FuzzAgent(const uint8_t* data, size_t size) {
  v1::CoordinatorMessage message;
  if (!message.ParseFromArray(data, static_cast<int>(size))) return;
  if (message.has_round_started()) {
    absl::Status valid = ValidateRoundStarted(message.round_started(), {2, 1, 4, 3, 1});
    if (valid.ok() && !IsHostOrAddress(message.round_started().master_addr())) __builtin_trap();
  }
  for (const std::string* text : {&message.round_ended().detail(), &message.job_ended().detail()}) {
    std::string shown = EscapeForConsole(*text);
    for (char c : shown) {
      if ((static_cast<unsigned char>(c) < 0x20 && c != ' ') || c == 0x7f) __builtin_trap();
    }
  }
}

}  // namespace
}  // namespace elrun::rdzv

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] & 1) {
    elrun::rdzv::FuzzAgent(data + 1, size - 1);
  } else {
    elrun::rdzv::FuzzCoordinator(data + 1, size - 1);
  }
  return 0;
}
