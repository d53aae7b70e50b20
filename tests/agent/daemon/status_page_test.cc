// What elrun-rdzv's --http-listen serves: metrics, JSON, escaping of what agents send.
#include "agent/daemon/status_page.h"

#include <doctest/doctest.h>

namespace elrun::rdzv {
namespace {

CoordinatorSnapshot Sample() {
  CoordinatorSnapshot s;
  s.sessions = 3;
  s.counters.rounds_started = 4;
  s.counters.restarts = 1;
  s.counters.refused["unauthenticated"] = 2;
  s.counters.evictions["no_heartbeat"] = 1;
  JobStatus job;
  job.run_id = "job";
  job.phase = "running";
  job.round = 2;
  job.restart_count = 1;
  job.settings.set_max_restarts(3);
  job.settings.set_min_nodes(1);
  job.settings.set_max_nodes(2);
  job.last_failure = "node a: \"boom\"\n<script>alert(1)</script>";
  v1::Progress progress;
  progress.set_step(120);
  progress.set_goodput(0.5);
  progress.set_lost_s(2.25);
  progress.set_faults(1);
  job.nodes.push_back({"node-a", "active", 0, 2, "10.0.0.1", progress});
  job.nodes.push_back({"node-b", "wait_listed", -1, 1, "10.0.0.2", std::nullopt});
  s.jobs.push_back(job);
  return s;
}

TEST_CASE("JSON strings escape quotes, control characters, markup and invalid UTF-8") {
  CHECK(JsonString("plain") == "\"plain\"");
  CHECK(JsonString("a\"b\\c") == "\"a\\\"b\\\\c\"");
  CHECK(JsonString("line\nnext\t\x1b[31m") == "\"line\\u000anext\\u0009\\u001b[31m\"");
  CHECK(JsonString("<script>&") == "\"\\u003cscript\\u003e\\u0026\"");
  CHECK(JsonString("caf\xc3\xa9") == "\"caf\xc3\xa9\"");
  CHECK(JsonString("bad\xff\xc3") == "\"bad\\ufffd\\ufffd\"");
  CHECK(JsonString(std::string("nul\0x", 5)) == "\"nul\\u0000x\"");
}

TEST_CASE("the status JSON holds every job and node, escaped") {
  std::string json = StatusJson(Sample());
  CHECK(json ==
        "{\"sessions\": 3, \"jobs\": [{\"run_id\": \"job\", \"phase\": \"running\", \"round\": 2, "
        "\"restarts\": 1, \"max_restarts\": 3, \"min_nodes\": 1, \"max_nodes\": 2, \"last_failure\": "
        "\"node a: \\\"boom\\\"\\u000a\\u003cscript\\u003ealert(1)\\u003c/script\\u003e\", \"nodes\": "
        "[{\"node_id\": \"node-a\", \"state\": \"active\", \"group_rank\": 0, \"nproc\": 2, \"master_addr\": "
        "\"10.0.0.1\", \"step\": 120, \"goodput\": 0.5, \"lost_s\": 2.25, \"faults\": 1}, {\"node_id\": \"node-b\", "
        "\"state\": \"wait_listed\", \"group_rank\": -1, \"nproc\": 1, \"master_addr\": \"10.0.0.2\", \"step\": null, "
        "\"goodput\": null, \"lost_s\": null, \"faults\": null}]}]}");
  CHECK(StatusJson(CoordinatorSnapshot{}) == "{\"sessions\": 0, \"jobs\": []}");
}

TEST_CASE("metrics in Prometheus text format, every label present even at zero") {
  GateCounts gate;
  gate.open = 2;
  gate.admitted = 7;
  gate.refused = 1;
  gate.unauthenticated_closed = 5;
  gate.evicted = 6;
  gate.authenticated = 3;
  std::string text = MetricsText(Sample(), gate);
  for (const char* line : {"# TYPE elrun_rdzv_jobs gauge\n",
                           "elrun_rdzv_jobs{phase=\"running\"} 1\n",
                           "elrun_rdzv_jobs{phase=\"done\"} 0\n",
                           "elrun_rdzv_nodes{state=\"active\"} 1\n",
                           "elrun_rdzv_nodes{state=\"wait_listed\"} 1\n",
                           "elrun_rdzv_sessions 3\n",
                           "# TYPE elrun_rdzv_rounds_started_total counter\n",
                           "elrun_rdzv_rounds_started_total 4\n",
                           "elrun_rdzv_restarts_total 1\n",
                           "elrun_rdzv_node_losses_total 0\n",
                           "elrun_rdzv_evictions_total{reason=\"no_heartbeat\"} 1\n",
                           "elrun_rdzv_evictions_total{reason=\"job_ended\"} 0\n",
                           "elrun_rdzv_refused_total{reason=\"unauthenticated\"} 2\n",
                           "elrun_rdzv_refused_total{reason=\"permission_denied\"} 0\n",
                           "elrun_rdzv_connections_open 2\n",
                           "elrun_rdzv_connections_total{result=\"admitted\"} 7\n",
                           "elrun_rdzv_connections_total{result=\"refused\"} 1\n",
                           "elrun_rdzv_connections_total{result=\"unauthenticated_closed\"} 5\n",
                           "elrun_rdzv_connections_total{result=\"evicted\"} 6\n",
                           "elrun_rdzv_connections_total{result=\"authenticated\"} 3\n",
                           "# TYPE elrun_rdzv_node_goodput gauge\n",
                           "elrun_rdzv_node_goodput{run_id=\"job\",node_id=\"node-a\"} 0.5\n",
                           "elrun_rdzv_node_step{run_id=\"job\",node_id=\"node-a\"} 120\n",
                           "elrun_rdzv_node_time_lost_seconds{run_id=\"job\",node_id=\"node-a\"} 2.25\n"}) {
    CHECK_MESSAGE(text.find(line) != std::string::npos, line);
  }
  // Every sample line: a metric name, optional labels, a number.
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    std::string line = text.substr(start, end - start);
    start = end + 1;
    if (line[0] == '#') continue;
    CHECK_MESSAGE(line.rfind("elrun_rdzv_", 0) == 0, line);
    CHECK_MESSAGE(line.find(' ') != std::string::npos, line);
  }
}

TEST_CASE("label values from agents are escaped; nodes without a known goodput have no goodput sample") {
  CoordinatorSnapshot s = Sample();
  s.jobs[0].run_id = "a\"b\\c\nd\x01\xff";
  std::string text = MetricsText(s, GateCounts{});
  CHECK(text.find(
            "elrun_rdzv_node_goodput{run_id=\"a\\\"b\\\\c\\nd\xef\xbf\xbd\xef\xbf\xbd\",node_id=\"node-a\"} 0.5\n") !=
        std::string::npos);
  CHECK(text.find("node-b") == std::string::npos);
}

TEST_CASE("the page inserts agent text only as text") {
  const std::string& page = StatusPageHtml();
  CHECK(page.find("innerHTML") == std::string::npos);
  CHECK(page.find("textContent") != std::string::npos);
  CHECK(page.find("status.json\" + location.search") != std::string::npos);
}

}  // namespace
}  // namespace elrun::rdzv
