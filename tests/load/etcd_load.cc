// etcd_load: many simulated rendezvous nodes of the etcd-v3 backend in one process, for
// etcd_scale_bench.py. Each node is a real EtcdRendezvous (its own EtcdClient, lease, reader
// and writer threads; the one that leads replays the job's log) that behaves as an elrun agent
// without workers and without a token: it answers the Challenge with a Join (client nonce, no
// proof), and joins again after each RoundEnded. Every session opens at once, each from a
// thread of its own, as the agents of a real job start together (--open-threads K: K threads
// take the nodes in turn instead); one epoll thread drives every node over their event_fds.
//
// gRPC shares one connection among channels of a process with the same target and arguments
// (its global subchannel pool), so N EtcdClients to one address would multiplex every node's
// calls and watch over one TCP connection. Real agents each have their own; to spread the load
// over several connections, give --endpoints several lists of the same members on other client
// ports (etcd --listen-client-urls takes many), separated by ';'.
//
// Prints one line per event on stdout, times in seconds since the process started:
//   opened NODES SECONDS              every node's EtcdRendezvous::Open has returned
//   formed ROUND SECONDS NODES        every live node (not lost, its session not ended) has
//                                     RoundStarted for ROUND; once per round
//   progress SECONDS opened=.. challenged=.. welcomed=.. started=ROUND:COUNT ended=..
//                                     every --progress-ms (how far a slow formation got)
//   ended INDEX SECONDS REASON        a node's session ended without a "lose"
//   job_ended INDEX SECONDS DETAIL    the coordinator ended the job (first node only)
// and reads commands on stdin, one per line:
//   lose K     destroys the K nodes with the highest group ranks (each revokes its lease: a
//              clean exit); prints "lost K SECONDS" (when the destruction began) and then
//              "formed" when the survivors' next round has started
//   quit       destroys every node and exits 0
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "agent/coordinator/session_auth.h"
#include "agent/etcd/etcd_rendezvous.h"
#include "agent/net/process_setup.h"
#include "proto/rendezvous.pb.h"

namespace {

namespace v1 = elrun::rdzv::v1;
using Clock = std::chrono::steady_clock;

const Clock::time_point kStart = Clock::now();

double Seconds() { return std::chrono::duration<double>(Clock::now() - kStart).count(); }

struct Settings {
  std::string endpoints;
  std::string prefix = "/elrun/rdzv/";
  std::string run_id = "scale";
  int nodes = 1000;
  int min_nodes = -1;
  int lease_ms = 5000;
  int last_call_ms = 1000;
  int open_threads = 0;  // 0: one per node.
  int progress_ms = 1000;
};

std::mutex out_mu;  // One line at a time on stdout.

void Emit(const std::string& line) {
  std::lock_guard<std::mutex> lock(out_mu);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

std::string OneLine(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

struct Node {
  int index = 0;
  std::unique_ptr<elrun::rdzv::EtcdRendezvous> rdzv;
  // Touched by the driver thread only, except group_rank (read by "lose").
  bool challenged = false;
  bool welcomed = false;
  bool end_seen = false;
  std::atomic<int> group_rank{-1};
};

class Load {
 public:
  explicit Load(Settings settings) : s_(std::move(settings)), slots_(s_.nodes) {
    std::stringstream groups(s_.endpoints);
    std::string group;
    while (std::getline(groups, group, ';')) {
      std::stringstream in(group);
      std::string endpoint;
      std::vector<std::string> list;
      while (std::getline(in, endpoint, ',')) {
        if (!endpoint.empty()) list.push_back(endpoint);
      }
      if (!list.empty()) endpoints_.push_back(std::move(list));
    }
  }

  int Run() {
    if (endpoints_.empty()) {
      std::fprintf(stderr, "etcd_load: no endpoint\n");
      return 2;
    }
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (epoll_ < 0 || wake_ < 0) {
      std::perror("epoll/eventfd");
      return 1;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWakeTag;
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &ev);
    std::thread driver([this] { Drive(); });
    std::thread progress([this] { Progress(); });

    // Open: the threads take node indexes in turn.
    std::atomic<int> next{0};
    std::atomic<bool> failed{false};
    std::vector<std::thread> openers;
    const int open_threads = s_.open_threads > 0 ? std::min(s_.open_threads, s_.nodes) : s_.nodes;
    for (int t = 0; t < open_threads; ++t) {
      openers.emplace_back([&] {
        while (!failed) {
          int i = next++;
          if (i >= s_.nodes) return;
          if (!Open(i)) failed = true;
        }
      });
    }
    for (auto& t : openers) t.join();
    int code = 0;
    if (failed) {
      code = 1;
    } else {
      Emit("opened " + std::to_string(s_.nodes) + " " + Fixed(Seconds()));
      std::string command;
      while (std::getline(std::cin, command)) {
        if (command.rfind("lose ", 0) == 0) {
          Lose(std::stoi(command.substr(5)));
        } else if (command == "quit") {
          break;
        }
      }
    }
    stopping_ = true;
    Signal(wake_);
    driver.join();
    progress.join();
    // Leave: every remaining node revokes its lease (in parallel, as a job's agents would).
    std::vector<std::unique_ptr<Node>> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& slot : slots_) {
        if (slot) all.push_back(std::move(slot));
      }
    }
    Destroy(std::move(all));
    ::close(epoll_);
    ::close(wake_);
    return code;
  }

 private:
  static constexpr uint64_t kWakeTag = ~uint64_t{0};

  static void Signal(int fd) {
    uint64_t one = 1;
    (void)!::write(fd, &one, sizeof(one));
  }

  static std::string Fixed(double x) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.6f", x);
    return buf;
  }

  bool Open(int i) {
    elrun::rdzv::EtcdRendezvousOptions options;
    options.etcd.endpoints = endpoints_[i % endpoints_.size()];
    options.prefix = s_.prefix;
    options.run_id = s_.run_id;
    options.node_id = "load-" + std::to_string(i);
    options.lease_ttl = std::chrono::milliseconds(s_.lease_ms);
    auto opened = elrun::rdzv::EtcdRendezvous::Open(options);
    if (!opened.ok()) {
      Emit("open_failed " + std::to_string(i) + " " + Fixed(Seconds()) + " " +
           OneLine(std::string(opened.status().message())));
      return false;
    }
    auto node = std::make_unique<Node>();
    node->index = i;
    node->rdzv = *std::move(opened);
    int fd = node->rdzv->event_fd();
    {
      std::lock_guard<std::mutex> lock(mu_);
      slots_[i] = std::move(node);
      ++opened_;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;  // Level-triggered, as event_fd is.
    ev.data.u64 = static_cast<uint64_t>(i);
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
    return true;
  }

  v1::AgentMessage MakeJoin(const Node& node, bool first) const {
    v1::AgentMessage message;
    v1::Join* join = message.mutable_join();
    join->set_protocol_version(elrun::rdzv::kProtocolVersion);
    join->set_run_id(s_.run_id);
    join->set_node_id("load-" + std::to_string(node.index));
    join->set_nproc(1);
    join->set_role("default");
    join->set_rank_hint(-1);
    join->set_master_addr("127.0.0.1");
    join->set_master_port(20000 + node.index % 40000);
    v1::JobSettings* settings = join->mutable_settings();
    settings->set_min_nodes(s_.min_nodes);
    settings->set_max_nodes(s_.nodes);
    settings->set_max_restarts(0);
    settings->set_last_call_timeout_ms(s_.last_call_ms);
    settings->set_join_timeout_ms(600000);
    settings->set_heartbeat_timeout_ms(s_.lease_ms);
    settings->set_close_timeout_ms(30000);
    // As ElasticAgent without a token or run token: the session's first Join carries the
    // client nonce and nothing else (no proof, no run key).
    if (first) join->set_client_nonce(elrun::rdzv::RandomNonce());
    return message;
  }

  // The driver: one thread over every node's event_fd.
  void Drive() {
    std::vector<epoll_event> events(256);
    while (!stopping_) {
      int n = ::epoll_wait(epoll_, events.data(), static_cast<int>(events.size()), 1000);
      for (int k = 0; k < n; ++k) {
        if (events[k].data.u64 == kWakeTag) continue;
        std::lock_guard<std::mutex> lock(mu_);
        Node* node = slots_[events[k].data.u64].get();
        if (node != nullptr) Handle(*node);
      }
    }
  }

  void Handle(Node& node) {  // mu_ held.
    for (const v1::CoordinatorMessage& message : node.rdzv->Take()) {
      if (message.has_challenge()) {
        if (!node.challenged) {
          node.challenged = true;
          ++challenged_;
          node.rdzv->Write(MakeJoin(node, true));
        }
      } else if (message.has_welcome()) {
        if (!node.welcomed) {
          node.welcomed = true;
          ++welcomed_;
        }
      } else if (message.has_round_started()) {
        node.group_rank = message.round_started().group_rank();
        Started(static_cast<int>(message.round_started().round()));
      } else if (message.has_round_ended()) {
        node.rdzv->Write(MakeJoin(node, false));
      } else if (message.has_job_ended()) {
        if (!job_ended_reported_) {
          job_ended_reported_ = true;
          Emit("job_ended " + std::to_string(node.index) + " " + Fixed(Seconds()) + " " +
               OneLine(message.job_ended().detail()));
        }
      }
    }
    if (!node.end_seen) {
      if (auto ended = node.rdzv->ended()) {
        node.end_seen = true;
        ++ended_;
        // It stays readable: stop watching it.
        ::epoll_ctl(epoll_, EPOLL_CTL_DEL, node.rdzv->event_fd(), nullptr);
        Emit("ended " + std::to_string(node.index) + " " + Fixed(Seconds()) + " " + OneLine(ended->ToString()));
        MaybeFormed(last_round_);  // One fewer node to wait for.
      }
    }
  }

  void Started(int round) {  // mu_ held.
    ++started_[round];
    last_round_ = std::max(last_round_, round);
    MaybeFormed(round);
  }

  // "formed" once per round, when every live node (not lost, session not ended) holds it.
  void MaybeFormed(int round) {  // mu_ held.
    int count = started_[round];
    if (round > 0 && count > 0 && count >= s_.nodes - lost_ - ended_ && formed_.insert(round).second) {
      Emit("formed " + std::to_string(round) + " " + Fixed(Seconds()) + " " + std::to_string(count));
    }
  }

  void Progress() {
    if (s_.progress_ms <= 0) return;
    auto next = Clock::now();
    while (!stopping_) {
      next += std::chrono::milliseconds(s_.progress_ms);
      while (!stopping_ && Clock::now() < next) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // The report's period.
      }
      if (stopping_) return;
      std::string line;
      {
        std::lock_guard<std::mutex> lock(mu_);
        line = "progress " + Fixed(Seconds()) + " opened=" + std::to_string(opened_) +
               " challenged=" + std::to_string(challenged_) + " welcomed=" + std::to_string(welcomed_) +
               " started=" + std::to_string(last_round_) + ":" +
               std::to_string(last_round_ > 0 ? started_[last_round_] : 0) + " ended=" + std::to_string(ended_) +
               " lost=" + std::to_string(lost_);
      }
      Emit(line);
    }
  }

  void Lose(int count) {
    std::vector<std::unique_ptr<Node>> doomed;
    double at;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<int> live;
      for (int i = 0; i < s_.nodes; ++i) {
        if (slots_[i]) live.push_back(i);
      }
      std::sort(live.begin(), live.end(),
                [this](int a, int b) { return slots_[a]->group_rank > slots_[b]->group_rank; });
      for (int k = 0; k < count && k < static_cast<int>(live.size()); ++k) {
        Node& node = *slots_[live[k]];
        if (node.end_seen) {
          --ended_;  // Counted as lost from now on.
        } else {
          ::epoll_ctl(epoll_, EPOLL_CTL_DEL, node.rdzv->event_fd(), nullptr);
        }
        doomed.push_back(std::move(slots_[live[k]]));
      }
      lost_ += static_cast<int>(doomed.size());
      at = Seconds();
    }
    Emit("lost " + std::to_string(count) + " " + Fixed(at));  // Before "formed" of the next round.
    Destroy(std::move(doomed));
  }

  // Destroys nodes from several threads at once: each destructor joins the node's threads,
  // revokes its lease and runs the cleanup transaction.
  void Destroy(std::vector<std::unique_ptr<Node>> nodes) {
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    size_t n = std::min<size_t>(nodes.size(), 32);
    for (size_t t = 0; t < n; ++t) {
      threads.emplace_back([&] {
        for (size_t i = next++; i < nodes.size(); i = next++) nodes[i].reset();
      });
    }
    for (auto& t : threads) t.join();
  }

  const Settings s_;
  std::vector<std::vector<std::string>> endpoints_;  // Node i uses list i % size().
  int epoll_ = -1;
  int wake_ = -1;
  std::atomic<bool> stopping_{false};

  std::mutex mu_;
  std::vector<std::unique_ptr<Node>> slots_;  // By index; null until opened or once lost.
  std::map<int, int> started_;                // Round -> nodes that have it.
  std::set<int> formed_;                      // Rounds reported formed.
  int last_round_ = 0;
  int opened_ = 0;
  int challenged_ = 0;
  int welcomed_ = 0;
  int ended_ = 0;
  int lost_ = 0;
  bool job_ended_reported_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  elrun::SetUpProcess();  // As elrun does: the simulated nodes cost what real agents cost.
  Settings settings;
  CLI::App app("etcd_load: simulated elrun nodes on the etcd-v3 rendezvous backend (for etcd_scale_bench.py)");
  app.add_option("--endpoints", settings.endpoints,
                 "etcd members, HOST:PORT[,HOST:PORT...]; several such lists separated by ';' (the same "
                 "members on other client ports): node i uses list i mod their number")
      ->required();
  app.add_option("--prefix", settings.prefix, "key prefix of the jobs")->capture_default_str();
  app.add_option("--run-id", settings.run_id, "the job's run id")->capture_default_str();
  app.add_option("--nodes", settings.nodes, "simulated nodes")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--min-nodes", settings.min_nodes, "the job's minimum (default: nodes - nodes/100)");
  app.add_option("--lease-ms", settings.lease_ms, "lease TTL = heartbeat_timeout_ms")
      ->check(CLI::Range(1000, 600000))
      ->capture_default_str();
  app.add_option("--last-call-ms", settings.last_call_ms, "the job's last_call_timeout_ms")
      ->check(CLI::Range(0, 600000))
      ->capture_default_str();
  app.add_option("--open-threads", settings.open_threads,
                 "threads opening the sessions, taking the nodes in turn (0: one per node, all at once)")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--progress-ms", settings.progress_ms, "period of the progress lines (0: none)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (settings.min_nodes <= 0 || settings.min_nodes > settings.nodes) {
    settings.min_nodes = settings.nodes - settings.nodes / 100;
  }
  // Every node holds an eventfd and the process many sockets: lift the soft limit.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
  }
  Load load(settings);
  return load.Run();
}
