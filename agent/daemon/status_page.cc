#include "agent/daemon/status_page.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace elrun::rdzv {
namespace {

// The length of the valid UTF-8 sequence at text[i], or 0 when there is none.
size_t Utf8Length(absl::string_view text, size_t i) {
  unsigned char c = static_cast<unsigned char>(text[i]);
  size_t length = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (length == 0 || i + length > text.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    if ((static_cast<unsigned char>(text[i + k]) >> 6) != 0x2) return 0;
  }
  return length;
}

void Metric(std::string* out, const char* name, const char* type, const char* help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

// A Prometheus label value: backslash, double quote and newline escaped; other control bytes
// and invalid UTF-8 (agents' words) as U+FFFD.
std::string LabelValue(absl::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    size_t length = Utf8Length(text, i);
    if (length == 0 || (length == 1 && (c < 0x20 || c == 0x7f) && c != '\n')) {
      out += "\xef\xbf\xbd";
      i += length == 0 ? 1 : length;
      continue;
    }
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
    } else {
      out.append(text.data() + i, length);
    }
    i += length;
  }
  return out;
}

// The JSON number, or null.
std::string NumberOrNull(bool known, double value) { return known ? absl::StrCat(value) : "null"; }

}  // namespace

std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size();) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    size_t length = Utf8Length(text, i);
    if (length == 0) {
      out += "\\ufffd";
      ++i;
      continue;
    }
    if (length > 1) {
      out.append(text.data() + i, length);
    } else if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f || c == '<' || c == '>' || c == '&') {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += static_cast<char>(c);
    }
    i += length;
  }
  return out + "\"";
}

std::string MetricsText(const CoordinatorSnapshot& snapshot, const GateCounts& gate) {
  const CoordinatorCounters& c = snapshot.counters;
  std::map<std::string, int> phases{{"gathering", 0}, {"running", 0}, {"done", 0}};
  std::map<std::string, int> states{{"pending", 0}, {"wait_listed", 0}, {"active", 0}, {"stopping", 0}, {"done", 0}};
  for (const JobStatus& job : snapshot.jobs) {
    ++phases[job.phase];
    for (const NodeStatus& node : job.nodes) ++states[node.state];
  }
  std::string out;
  Metric(&out, "elrun_rdzv_jobs", "gauge", "Jobs the coordinator holds, by phase.");
  for (const auto& [phase, n] : phases) absl::StrAppend(&out, "elrun_rdzv_jobs{phase=\"", phase, "\"} ", n, "\n");
  Metric(&out, "elrun_rdzv_nodes", "gauge", "Nodes of all jobs, by state.");
  for (const auto& [state, n] : states) absl::StrAppend(&out, "elrun_rdzv_nodes{state=\"", state, "\"} ", n, "\n");
  Metric(&out, "elrun_rdzv_sessions", "gauge", "Open agent sessions, joined or not.");
  absl::StrAppend(&out, "elrun_rdzv_sessions ", snapshot.sessions, "\n");
  Metric(&out, "elrun_rdzv_rounds_started_total", "counter", "Rounds started.");
  absl::StrAppend(&out, "elrun_rdzv_rounds_started_total ", c.rounds_started, "\n");
  Metric(&out, "elrun_rdzv_restarts_total", "counter", "Worker failures that spent a restart.");
  absl::StrAppend(&out, "elrun_rdzv_restarts_total ", c.restarts, "\n");
  Metric(&out, "elrun_rdzv_node_losses_total", "counter", "Rounds ended because a node died, hung or left.");
  absl::StrAppend(&out, "elrun_rdzv_node_losses_total ", c.node_losses, "\n");
  Metric(&out, "elrun_rdzv_jobs_ended_total", "counter", "Jobs ended, by result.");
  absl::StrAppend(&out, "elrun_rdzv_jobs_ended_total{result=\"succeeded\"} ", c.jobs_succeeded, "\n");
  absl::StrAppend(&out, "elrun_rdzv_jobs_ended_total{result=\"failed\"} ", c.jobs_failed, "\n");
  Metric(&out, "elrun_rdzv_evictions_total", "counter", "Sessions closed by the coordinator, by reason.");
  std::map<std::string, uint64_t> evictions{{"no_heartbeat", 0}, {"did_not_rejoin", 0}, {"job_ended", 0}};
  for (const auto& [reason, n] : c.evictions) evictions[reason] = n;
  for (const auto& [reason, n] : evictions) {
    absl::StrAppend(&out, "elrun_rdzv_evictions_total{reason=\"", reason, "\"} ", n, "\n");
  }
  Metric(&out, "elrun_rdzv_node_goodput", "gauge",
         "Each node's goodput so far (its elrun's measure from the heartbeats), 0 to 1; absent until known.");
  for (const JobStatus& job : snapshot.jobs) {
    for (const NodeStatus& node : job.nodes) {
      if (!node.progress || node.progress->goodput() < 0) continue;
      absl::StrAppend(&out, "elrun_rdzv_node_goodput{run_id=\"", LabelValue(job.run_id), "\",node_id=\"",
                      LabelValue(node.node_id), "\"} ", node.progress->goodput(), "\n");
    }
  }
  Metric(&out, "elrun_rdzv_node_step", "gauge", "The highest step each node's workers reached; absent before a beat.");
  Metric(&out, "elrun_rdzv_node_time_lost_seconds", "gauge", "Time each node lost to faults so far.");
  for (const JobStatus& job : snapshot.jobs) {
    for (const NodeStatus& node : job.nodes) {
      if (!node.progress) continue;
      const std::string labels =
          absl::StrCat("{run_id=\"", LabelValue(job.run_id), "\",node_id=\"", LabelValue(node.node_id), "\"} ");
      if (node.progress->step() >= 0)
        absl::StrAppend(&out, "elrun_rdzv_node_step", labels, node.progress->step(), "\n");
      absl::StrAppend(&out, "elrun_rdzv_node_time_lost_seconds", labels, node.progress->lost_s(), "\n");
    }
  }
  Metric(&out, "elrun_rdzv_refused_total", "counter", "Agent messages refused, by status.");
  std::map<std::string, uint64_t> refused{
      {"unauthenticated", 0}, {"permission_denied", 0}, {"invalid_argument", 0}, {"failed_precondition", 0}};
  for (const auto& [reason, n] : c.refused) refused[reason] = n;
  for (const auto& [reason, n] : refused) {
    absl::StrAppend(&out, "elrun_rdzv_refused_total{reason=\"", reason, "\"} ", n, "\n");
  }
  Metric(&out, "elrun_rdzv_connections_open", "gauge", "TCP connections being relayed now.");
  absl::StrAppend(&out, "elrun_rdzv_connections_open ", gate.open, "\n");
  Metric(&out, "elrun_rdzv_connections_total", "counter", "TCP connections, by what the gate did.");
  absl::StrAppend(&out, "elrun_rdzv_connections_total{result=\"admitted\"} ", gate.admitted, "\n");
  absl::StrAppend(&out, "elrun_rdzv_connections_total{result=\"refused\"} ", gate.refused, "\n");
  absl::StrAppend(&out, "elrun_rdzv_connections_total{result=\"silent_closed\"} ", gate.silent_closed, "\n");
  absl::StrAppend(&out, "elrun_rdzv_connections_total{result=\"unauthenticated_closed\"} ", gate.unauthenticated_closed,
                  "\n");
  absl::StrAppend(&out, "elrun_rdzv_connections_total{result=\"evicted\"} ", gate.evicted, "\n");
  absl::StrAppend(&out, "elrun_rdzv_connections_total{result=\"authenticated\"} ", gate.authenticated, "\n");
  return out;
}

std::string StatusJson(const CoordinatorSnapshot& snapshot) {
  std::string out = absl::StrCat("{\"sessions\": ", snapshot.sessions, ", \"jobs\": [");
  for (size_t j = 0; j < snapshot.jobs.size(); ++j) {
    const JobStatus& job = snapshot.jobs[j];
    absl::StrAppend(&out, j ? ", " : "", "{\"run_id\": ", JsonString(job.run_id),
                    ", \"phase\": ", JsonString(job.phase), ", \"round\": ", job.round,
                    ", \"restarts\": ", job.restart_count, ", \"max_restarts\": ", job.settings.max_restarts(),
                    ", \"min_nodes\": ", job.settings.min_nodes(), ", \"max_nodes\": ", job.settings.max_nodes(),
                    ", \"last_failure\": ", JsonString(job.last_failure), ", \"nodes\": [");
    for (size_t n = 0; n < job.nodes.size(); ++n) {
      const NodeStatus& node = job.nodes[n];
      absl::StrAppend(&out, n ? ", " : "", "{\"node_id\": ", JsonString(node.node_id),
                      ", \"state\": ", JsonString(node.state), ", \"group_rank\": ", node.group_rank,
                      ", \"nproc\": ", node.nproc, ", \"master_addr\": ", JsonString(node.master_addr));
      const v1::Progress* p = node.progress ? &*node.progress : nullptr;
      absl::StrAppend(&out, ", \"step\": ", p && p->step() >= 0 ? absl::StrCat(p->step()) : "null",
                      ", \"goodput\": ", NumberOrNull(p && p->goodput() >= 0, p ? p->goodput() : 0),
                      ", \"lost_s\": ", NumberOrNull(p, p ? p->lost_s() : 0),
                      ", \"faults\": ", p ? absl::StrCat(p->faults()) : "null", "}");
    }
    out += "]}";
  }
  return out + "]}";
}

const std::string& StatusPageHtml() {
  static const std::string* const kPage = new std::string(R"html(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>elrun-rdzv</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.4em 0 1.2em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
.failure { color: #a00; white-space: pre-wrap; }
#error { color: #a00; }
</style>
</head>
<body data-refreshes="0">
<h1>elrun-rdzv</h1>
<p id="summary">loading...</p>
<p id="error"></p>
<div id="jobs"></div>
<script>
"use strict";
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function render(status) {
  const jobs = document.getElementById("jobs");
  jobs.replaceChildren();
  document.getElementById("summary").textContent =
      status.jobs.length + " job(s), " + status.sessions + " session(s); updated " +
      new Date().toLocaleTimeString();
  for (const job of status.jobs) {
    const section = el("section");
    section.dataset.runId = job.run_id;
    section.append(el("h2", "run " + job.run_id));
    section.append(el("p", job.phase + ", round " + job.round + ", restarts " + job.restarts +
        " of " + job.max_restarts + ", nodes " + job.nodes.length + " (min " + job.min_nodes +
        ", max " + job.max_nodes + ")", "job-summary"));
    if (job.last_failure) section.append(el("p", "last failure: " + job.last_failure, "failure"));
    const table = el("table");
    const head = el("tr");
    for (const h of ["group rank", "node", "state", "workers", "address", "step", "goodput", "lost (s)",
                     "faults"]) head.append(el("th", h));
    table.append(head);
    for (const node of job.nodes) {
      const row = el("tr");
      row.className = "node";
      const known = (v, f) => v === null ? "-" : f(v);
      for (const v of [node.group_rank >= 0 ? node.group_rank : "-", node.node_id, node.state,
                       node.nproc, node.master_addr, known(node.step, s => s),
                       known(node.goodput, g => (100 * g).toFixed(1) + "%"),
                       known(node.lost_s, l => l.toFixed(2)), known(node.faults, f => f)]) {
        row.append(el("td", v));
      }
      table.append(row);
    }
    section.append(table);
    jobs.append(section);
  }
  document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes) + 1);
}
async function refresh() {
  try {
    const response = await fetch("status.json" + location.search, {cache: "no-store"});
    if (!response.ok) throw new Error("status.json: HTTP " + response.status);
    render(await response.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = String(e);
  }
}
refresh();
setInterval(refresh, 1000);
</script>
</body>
</html>
)html");
  return *kPage;
}

}  // namespace elrun::rdzv
