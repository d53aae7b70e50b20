// elrun-rdzv: the rendezvous coordinator as its own daemon, serving many jobs (isolated by run
// id) for elrun agents started with --rdzv-endpoint pointing here. Prints
// "elrun-rdzv listening on HOST:PORT" once ready (the status page, if any, is up by then); stops on SIGINT or SIGTERM.
// With
// --http-listen it also serves Prometheus metrics (/metrics), the jobs as JSON (/status.json)
// and a live status page (/), behind the same token.
#include <sys/signalfd.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <iostream>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "agent/daemon/http_listener.h"
#include "agent/daemon/status_page.h"
#include "agent/grpc/coordinator_server.h"
#include "agent/net/process_setup.h"
#include "release/build_info.h"

namespace {

// Writes "PORT\n" to `path` atomically (a temp file renamed over it).
bool WritePortFile(const std::string& path, int port) {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  bool ok = f != nullptr && std::fprintf(f, "%d\n", port) >= 0;
  if (f != nullptr && std::fclose(f) != 0) ok = false;
  return ok && std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  elrun::SetUpProcess();
  elrun::rdzv::ServerOptions options;
  std::string port_file;
  std::string http_listen;
  std::string http_port_file;
  CLI::App app("elrun-rdzv: the elrun rendezvous coordinator, serving many jobs by run id.", "elrun-rdzv");
  app.add_option("--listen", options.listen, "host:port to serve on; port 0 picks a free one")->capture_default_str();
  app.add_option("--tls-cert", options.tls.cert, "PEM certificate (enables TLS)");
  app.add_option("--tls-key", options.tls.key, "PEM private key of --tls-cert");
  app.add_option("--tls-ca", options.tls.ca, "PEM CA: agents must present a certificate it signed");
  app.add_option("--port-file", port_file, "write the bound port to this file once listening");
  app.add_option("--http-listen", http_listen,
                 "host:port for the status page, /metrics and /status.json (port 0: a free one)");
  app.add_option("--http-port-file", http_port_file, "write the bound HTTP port to this file");
  app.add_flag("--require-run-token", options.require_run_token,
               "refuse a run without a credential of its own (run_token): the daemon's token then reaches no run");
  app.add_option("--max-connections", options.gate.max_connections,
                 "open connections in all; 0: what the descriptor limit allows, at most 4096")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-connections-per-peer", options.gate.max_per_peer,
                 "open connections from one address; 0: --max-connections / 8, at least 64")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  bool version = false;
  app.add_flag("--version", version, "print the version and the commit it was built from, and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help() << "The job token comes from ELRUN_RDZV_TOKEN (never from the command line).\n";
    return 0;
  } catch (const CLI::ParseError& error) {
    std::cerr << "elrun-rdzv: " << error.what() << "; see elrun-rdzv --help\n";
    return 2;
  }
  if (version) {
    std::cout << elrun::VersionLine("elrun-rdzv");
    return 0;
  }
  if (options.tls.cert.empty() != options.tls.key.empty()) {
    std::cerr << "elrun-rdzv: --tls-cert and --tls-key go together\n";
    return 2;
  }
  if (const char* token = std::getenv("ELRUN_RDZV_TOKEN")) options.token = token;

  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  ::sigprocmask(SIG_BLOCK, &stop, nullptr);  // Before gRPC starts its threads.

  auto server = elrun::rdzv::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::cerr << "elrun-rdzv: " << server.status().message() << "\n";
    return 1;
  }
  std::unique_ptr<elrun::rdzv::HttpListener> http;
  if (!http_listen.empty()) {
    elrun::rdzv::CoordinatorServer* coordinator = server->get();
    auto started = elrun::rdzv::HttpListener::Start(
        http_listen, options.token, [coordinator](const std::string& path) -> elrun::rdzv::HttpResponse {
          if (path == "/") return {200, "text/html; charset=utf-8", elrun::rdzv::StatusPageHtml()};
          if (path == "/metrics") {
            return {200, "text/plain; version=0.0.4; charset=utf-8",
                    elrun::rdzv::MetricsText(coordinator->coordinator().Snapshot(), coordinator->gate_counts())};
          }
          if (path == "/status.json") {
            return {200, "application/json", elrun::rdzv::StatusJson(coordinator->coordinator().Snapshot())};
          }
          return {404, "text/plain; charset=utf-8", "not found: try /, /metrics or /status.json\n"};
        });
    if (!started.ok()) {
      std::cerr << "elrun-rdzv: --http-listen: " << started.status().message() << "\n";
      return 1;
    }
    http = *std::move(started);
    std::string http_host = http_listen.substr(0, http_listen.rfind(':'));
    std::cout << "elrun-rdzv status page on http://" << http_host << ":" << http->port() << "/" << std::endl;
    if (!http_port_file.empty() && !WritePortFile(http_port_file, http->port())) {
      std::cerr << "elrun-rdzv: cannot write --http-port-file " << http_port_file << "\n";
      return 1;
    }
  }
  std::string host = options.listen.substr(0, options.listen.rfind(':'));
  std::cout << "elrun-rdzv listening on " << host << ":" << (*server)->port()
            << (options.token.empty() ? " (no token: any agent that can reach it may join)" : "") << std::endl;
  if (!port_file.empty() && !WritePortFile(port_file, (*server)->port())) {
    std::cerr << "elrun-rdzv: cannot write --port-file " << port_file << "\n";
    return 1;
  }
  int signo = 0;
  ::sigwait(&stop, &signo);
  http.reset();
  (*server)->Shutdown();
  return 0;
}
