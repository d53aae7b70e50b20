#include "launcher/cli/options.h"

#include <csignal>
#include <map>

#include <CLI/CLI.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "launcher/cli/slurm_env.h"
#include "launcher/inject/fault_plan.h"
#include "launcher/os/numa_binding.h"

namespace elrun {
namespace {

constexpr char kUsage[] =
    "elrun: a torchrun-compatible launcher.\n"
    "Usage: elrun [options] TRAINING_SCRIPT|-m MODULE|--no-python BINARY [args...]\n"
    "Each option also reads PET_<NAME> (e.g. PET_NPROC_PER_NODE); the command line wins.\n"
    "'${local_rank}' in the script's arguments becomes each worker's local rank.";

// One option of the table below: its canonical dashed name, a short alias, whether it is a flag,
// its default and its help line. Both spellings (--a-b, --a_b) and PET_A_B are derived.
struct OptionDef {
  const char* name;
  const char* short_name;
  bool flag;
  const char* metavar;
  const char* default_value;
  const char* help;
};

constexpr OptionDef kOptions[] = {
    {"nnodes", "", false, "N|MIN:MAX", "1:1", "Number of nodes, N or MIN:MAX for an elastic job."},
    {"nproc-per-node", "", false, "N|cpu|gpu|auto", "1", "Workers per node: an integer, cpu, gpu or auto."},
    {"node-rank", "", false, "RANK", "0", "This node's rank for --rdzv-backend static (0..nnodes-1)."},
    {"master-addr", "", false, "ADDR", "127.0.0.1", "Address of node 0 for --rdzv-backend static."},
    {"master-port", "", false, "PORT", "",
     "Port of node 0's store for static jobs; default: a free port on one node, 29500 on several."},
    {"standalone", "", true, "", "0",
     "Single-node job on a free port, with a generated run id unless --rdzv-id is given; ignores the other rdzv "
     "options."},
    {"rdzv-backend", "", false, "NAME", "static",
     "static (node 0's store at --rdzv-endpoint or --master-addr:--master-port, as torchrun), "
     "grpc (c10d is an alias): elrun's elastic rendezvous, the default with --nnodes MIN:MAX, "
     "or etcd-v3: the same rendezvous with its state in an etcd cluster (no single point of failure)."},
    {"rdzv-endpoint", "", false, "HOST[:PORT]", "",
     "grpc/c10d: the coordinator, HOST[:PORT]; static: node 0's store, HOST:PORT; "
     "etcd-v3: the etcd members, HOST[:PORT],... (port 2379 by default)."},
    {"rdzv-id", "", false, "ID", "none", "Job id shared by all nodes of the job."},
    {"rdzv-conf", "", false, "K=V,...", "", "Rendezvous settings key=value,... (join_timeout, token, ...)."},
    {"max-restarts", "", false, "N", "0", "Restarts of the worker group after a failure."},
    {"monitor-interval", "", false, "SECONDS", "0.1",
     "Accepted for torchrun compatibility; elrun sees exits at once, without polling."},
    {"start-method", "", false, "METHOD", "spawn",
     "spawn or fork: workers are exec'd; forkserver: Python workers are forked from a server that has imported "
     "torch (and --preload) once, so a restart skips the import."},
    {"preload", "", false, "MOD,...", "", "With --start-method forkserver: modules the server imports besides torch."},
    {"auto-heartbeat", "", true, "", "0",
     "Beat for Python workers that do not: after each step of their first optimizer (torch's global step hook)."},
    {"keep-survivors", "", true, "", "0",
     "Restart only a failed worker; workers that can (elrun-train on the CPU, any --strategy, not fp16) regroup "
     "in place with the job's state from memory, not its checkpoint; across nodes, a new round regroups the "
     "workers every node kept (grpc and c10d backends, every node with this option). The group restarts where "
     "a worker cannot."},
    {"role", "", false, "NAME", "default", "Role name of these workers (ROLE_NAME, log prefixes)."},
    {"log-dir", "", false, "DIR", "",
     "Base directory of <run_id>/attempt_<n>/<local_rank>/ logs; default: a new temp dir."},
    {"redirects", "r", false, "STD", "0",
     "Send worker streams to log files only: 0 none, 1 out, 2 err, 3 both, or 0:3,1:1 per rank."},
    {"tee", "t", false, "STD", "0", "Copy worker streams to log files and the console (same format)."},
    {"local-ranks-filter", "", false, "RANKS", "",
     "Show only these local ranks on the console (e.g. 0,1); the others go to their log files."},
    {"local-addr", "", false, "ADDR", "", "This node's address, used instead of guessing a host name."},
    {"module", "m", true, "", "0", "Run TRAINING_SCRIPT as a Python module (python -m)."},
    {"no-python", "", true, "", "0", "Execute TRAINING_SCRIPT directly instead of with Python."},
    {"run-path", "", true, "", "0", "Run the script with runpy.run_path in the worker interpreter."},
    {"signals-to-handle", "", false, "SIGNALS", "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
     "Signals forwarded to the workers before elrun exits."},
    {"shutdown-timeout", "", false, "SECONDS", "30", "Seconds between SIGTERM and SIGKILL when stopping workers."},
    {"worker-timeout", "", false, "SECONDS", "",
     "A worker that heartbeats (ELRUN_HEARTBEAT_FILE) and then goes this long without a beat is hung: "
     "its stacks are asked for, it is killed and the group restarts within --max-restarts."},
    {"worker-start-timeout", "", false, "SECONDS", "",
     "The same for a worker's first heartbeat, counted from its start."},
    {"straggler-factor", "", false, "F", "1.5",
     "Log a heartbeating worker whose median step time exceeds F times the job's median; 0 turns it off."},
    {"duplicate-stdout-filters", "", false, "A,B", "",
     "Also write tee'd stdout lines holding any of these strings to <attempt>/filtered_stdout.log "
     "(',,' is a comma)."},
    {"duplicate-stderr-filters", "", false, "A,B", "", "The same for stderr, to <attempt>/filtered_stderr.log."},
    {"virtual-local-rank", "", true, "", "0", "LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES its own device."},
    {"event-log-handler", "", false, "NAME", "null",
     "torchrun's event handler: null (its default) or dynamic_rendezvous, neither changing anything; elrun loads "
     "no Python plugins and refuses any other."},
    {"logs-specs", "", false, "NAME", "",
     "torchrun's LogsSpecs plugin; none: elrun's logs follow torchrun's default layout."},
    {"numa-binding", "", false, "MODE", "",
     "Bind each worker's CPUs and memory near its GPU: node, socket, exclusive or core-complex."},
    {"report-file", "", false, "PATH", "",
     "At the end, write this node's goodput report (JSON: wall time, time lost per fault, steps redone) here."},
    {"history-file", "", false, "PATH", "",
     "Multi-node jobs: append this node's history here as it happens, one JSON line per event (joined, "
     "round and ranks, workers started and gone, round ended, coordinator lost, left)."},
    {"inject-faults", "", false, "PLAN", "",
     "For experiments: kill or stop this node's workers (or elrun) on purpose, e.g. "
     "kill-worker@20-40s,stop-worker:1@step100,kill-worker@every30s (see docs/fault-tolerance.md)."},
    {"inject-seed", "", false, "N", "0", "Seed of --inject-faults' draws: a plan and a seed give the same faults."},
};

// torchrun's comma_separated_list: "a,b" -> {a, b}; ",," is a literal comma; "" -> {}.
std::vector<std::string> ParseFilterList(const std::string& text) {
  std::vector<std::string> items;
  if (text.empty()) return items;
  std::string current;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ',' && i + 1 < text.size() && text[i + 1] == ',') {
      current += ',';
      ++i;
    } else if (text[i] == ',') {
      items.push_back(current);
      current.clear();
    } else {
      current += text[i];
    }
  }
  items.push_back(current);
  return items;
}

// kUsage already shows the usage line; CLI11's own would only say "elrun [OPTIONS]".
class UsageInDescriptionFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override { return "\n"; }
};

std::string PetName(const std::string& name) {
  return "PET_" + absl::AsciiStrToUpper(absl::StrReplaceAll(name, {{"-", "_"}}));
}

// Resolves one option: command line, else PET_ env, else the default.
struct Resolved {
  std::map<std::string, std::string> values;
  std::map<std::string, std::string> sources;  // "--name" or "PET_NAME", for messages.
  std::set<std::string> explicitly_set;

  const std::string& operator[](const std::string& name) const { return values.at(name); }
  bool Flag(const std::string& name) const {
    std::string v = absl::AsciiStrToLower(values.at(name));
    return v == "1" || v == "true" || v == "yes" || v == "on";
  }
  // "--nnodes=3:2" or "PET_NNODES=3:2", the way the user wrote it.
  std::string Input(const std::string& name) const { return absl::StrCat(sources.at(name), "=", values.at(name)); }
};

absl::Status Invalid(const Resolved& r, const std::string& name, const absl::Status& why) {
  return absl::InvalidArgumentError(absl::StrCat(r.Input(name), ": ", why.message()));
}

// Assigns `expr`'s value to `lhs`, or returns Invalid(r, name, its status) from the calling step.
#define ELRUN_ASSIGN_OR_INVALID(lhs, name, expr)                \
  do {                                                          \
    auto _value = (expr);                                       \
    if (!_value.ok()) return Invalid(r, name, _value.status()); \
    lhs = *std::move(_value);                                   \
  } while (0)

// The job's size and this node's place in it: --nnodes, --nproc-per-node, --node-rank, --master-*.
absl::Status ReadSize(const Resolved& r, const DeviceCounts& devices, JobSpec* spec) {
  std::pair<int, int> nnodes;
  ELRUN_ASSIGN_OR_INVALID(nnodes, "nnodes", ParseNnodes(r["nnodes"]));
  spec->min_nodes = nnodes.first;
  spec->max_nodes = nnodes.second;
  ELRUN_ASSIGN_OR_INVALID(spec->nproc_per_node, "nproc-per-node", ParseNprocPerNode(r["nproc-per-node"], devices));
  ELRUN_ASSIGN_OR_INVALID(spec->node_rank, "node-rank", ParseInt(r["node-rank"], 0, 1 << 20));
  spec->master_addr = r["master-addr"];
  if (!r["master-port"].empty()) {
    ELRUN_ASSIGN_OR_INVALID(spec->master_port, "master-port", ParseInt(r["master-port"], 1, 65535));
  }
  spec->node_rank_given = r.explicitly_set.count("node-rank") > 0;
  return absl::OkStatus();
}

// The rendezvous: --standalone, --rdzv-*, --max-restarts.
absl::Status ReadRendezvous(const Resolved& r, JobSpec* spec) {
  spec->standalone = r.Flag("standalone");
  spec->rdzv_backend = absl::AsciiStrToLower(r["rdzv-backend"]);
  if (!r.explicitly_set.count("rdzv-backend") && spec->min_nodes != spec->max_nodes) {
    spec->rdzv_backend = "grpc";  // An elastic size needs a real rendezvous.
  }
  spec->rdzv_endpoint = r["rdzv-endpoint"];
  spec->rdzv_id = r["rdzv-id"];
  ELRUN_ASSIGN_OR_INVALID(spec->rdzv_conf, "rdzv-conf", ParseRdzvConf(r["rdzv-conf"]));
  ELRUN_ASSIGN_OR_INVALID(spec->max_restarts, "max-restarts", ParseInt(r["max-restarts"], 0, 1 << 30));
  return absl::OkStatus();
}

// How workers start and where their output goes: --monitor-interval, --start-method, --role, logs,
// --redirects, --tee, --local-ranks-filter, the entrypoint's kind, signals, --shutdown-timeout.
absl::Status ReadWorkers(const Resolved& r, JobSpec* spec) {
  std::chrono::milliseconds interval;
  ELRUN_ASSIGN_OR_INVALID(interval, "monitor-interval", ParseSeconds(r["monitor-interval"]));
  spec->monitor_interval_s = interval.count() / 1000.0;
  spec->start_method = r["start-method"];
  if (spec->start_method != "spawn" && spec->start_method != "fork" && spec->start_method != "forkserver") {
    return Invalid(r, "start-method", absl::InvalidArgumentError("expected spawn, fork or forkserver"));
  }
  spec->role = r["role"];
  if (spec->role.empty()) return Invalid(r, "role", absl::InvalidArgumentError("must not be empty"));
  spec->log_dir = r["log-dir"];
  ELRUN_ASSIGN_OR_INVALID(spec->redirects, "redirects", ParseStdSetting(r["redirects"]));
  ELRUN_ASSIGN_OR_INVALID(spec->tee, "tee", ParseStdSetting(r["tee"]));
  if (!r["local-ranks-filter"].empty()) {
    ELRUN_ASSIGN_OR_INVALID(spec->local_ranks_filter, "local-ranks-filter", ParseRankList(r["local-ranks-filter"]));
  }
  spec->local_addr = r["local-addr"];
  spec->module = r.Flag("module");
  spec->no_python = r.Flag("no-python");
  spec->run_path = r.Flag("run-path");
  ELRUN_ASSIGN_OR_INVALID(spec->signals_to_handle, "signals-to-handle", ParseSignalList(r["signals-to-handle"]));
  ELRUN_ASSIGN_OR_INVALID(spec->shutdown_timeout, "shutdown-timeout", ParseSeconds(r["shutdown-timeout"]));
  return absl::OkStatus();
}

// elrun's supervision: worker timeouts, stragglers, duplicate-output filters, reports, heartbeats,
// --keep-survivors, --preload, injected faults.
absl::Status ReadSupervision(const Resolved& r, JobSpec* spec) {
  for (auto [name, field] : {std::pair{"worker-timeout", &spec->worker_timeout_s},
                             std::pair{"worker-start-timeout", &spec->worker_start_timeout_s}}) {
    if (r[name].empty()) continue;
    std::chrono::milliseconds limit;
    ELRUN_ASSIGN_OR_INVALID(limit, name, ParseSeconds(r[name]));
    if (limit.count() <= 0) return Invalid(r, name, absl::InvalidArgumentError("must be positive"));
    *field = limit.count() / 1000.0;
  }
  if (!r["straggler-factor"].empty()) {
    double factor = 0;
    if (!absl::SimpleAtod(r["straggler-factor"], &factor) || !(factor > 1.0 || factor == 0) || factor > 1e6) {
      return Invalid(r, "straggler-factor", absl::InvalidArgumentError("expected a number above 1, or 0 for off"));
    }
    if (factor > 0) spec->straggler_factor = factor;
  }
  spec->duplicate_stdout_filters = ParseFilterList(r["duplicate-stdout-filters"]);
  spec->duplicate_stderr_filters = ParseFilterList(r["duplicate-stderr-filters"]);
  spec->virtual_local_rank = r.Flag("virtual-local-rank");
  spec->report_file = r["report-file"];
  spec->history_file = r["history-file"];
  spec->auto_heartbeat = r.Flag("auto-heartbeat");
  spec->keep_survivors = r.Flag("keep-survivors");
  for (const std::string& module : ParseFilterList(r["preload"])) {
    bool valid = !module.empty() && module.size() <= 200;
    for (char c : module) valid = valid && (absl::ascii_isalnum(c) || c == '_' || c == '.');
    if (!valid) return Invalid(r, "preload", absl::InvalidArgumentError("expected Python module names, MOD,..."));
    spec->preload.push_back(module);
  }
  spec->inject_faults = r["inject-faults"];
  if (!spec->inject_faults.empty()) {
    if (absl::Status plan = ParseFaultPlan(spec->inject_faults).status(); !plan.ok()) {
      return Invalid(r, "inject-faults", plan);
    }
  }
  if (!absl::SimpleAtoi(r["inject-seed"], &spec->inject_seed)) {
    return Invalid(r, "inject-seed", absl::InvalidArgumentError("expected an integer from 0 to 2^64-1"));
  }
  return absl::OkStatus();
}

// torchrun's Python plugins: their defaults are what elrun does; others cannot be loaded. And
// --numa-binding's mode.
absl::Status RefusePluginsAndReadNuma(const Resolved& r, JobSpec* spec) {
  std::string handler = r["event-log-handler"];
  if (handler != "null" && handler != "dynamic_rendezvous") {
    return Invalid(r, "event-log-handler",
                   absl::InvalidArgumentError("elrun loads no Python event handlers; only null "
                                              "(torchrun's default) is accepted"));
  }
  if (!r["logs-specs"].empty()) {
    return Invalid(r, "logs-specs",
                   absl::InvalidArgumentError("elrun loads no Python LogsSpecs plugins; its logs follow "
                                              "torchrun's default layout (--log-dir, --redirects, --tee)"));
  }
  if (!r["numa-binding"].empty()) {
    std::string mode = r["numa-binding"];
    if (!ParseNumaMode(mode)) {
      return Invalid(r, "numa-binding", absl::InvalidArgumentError("expected node, socket, exclusive or core-complex"));
    }
    spec->numa_binding = mode;
  }
  return absl::OkStatus();
}

// Options that exclude each other.
absl::Status CheckCombinations(const Resolved& r, JobSpec* spec) {
  if (spec->module && spec->no_python) {
    return absl::InvalidArgumentError("-m/--module and --no-python cannot be used together");
  }
  if (spec->run_path && (spec->module || spec->no_python)) {
    return absl::InvalidArgumentError("--run-path cannot be combined with -m or --no-python");
  }
  return absl::OkStatus();
}

// The backend the options add up to: --standalone's local rendezvous, the static rendezvous'
// endpoint and fixed size, etcd's v2 refused.
absl::Status ResolveBackend(const Resolved& r, JobSpec* spec) {
  if (spec->standalone) {
    // torchrun: a local c10d rendezvous on a free port with a fresh id.
    spec->min_nodes = spec->max_nodes = 1;
    spec->rdzv_backend = "c10d";
    spec->rdzv_endpoint = "localhost:0";
    if (!r.explicitly_set.count("rdzv-id")) {
      spec->rdzv_id_generated = true;
    }
  }
  if (spec->rdzv_backend == "static") {
    // torchrun's static rendezvous: --rdzv-endpoint HOST:PORT is node 0's store, the workers'
    // MASTER_ADDR and MASTER_PORT (over --master-addr/--master-port).
    if (!spec->rdzv_endpoint.empty()) {
      auto endpoint = ParseEndpoint(spec->rdzv_endpoint);
      if (!endpoint.ok()) return Invalid(r, "rdzv-endpoint", endpoint.status());
      if (!endpoint->port || *endpoint->port == 0) {
        return Invalid(r, "rdzv-endpoint",
                       absl::InvalidArgumentError("the static rendezvous needs HOST:PORT, node 0's store "
                                                  "(or --rdzv-backend c10d for elrun's rendezvous)"));
      }
      spec->master_addr = endpoint->host;
      spec->master_port = *endpoint->port;
    }
    if (spec->min_nodes != spec->max_nodes) {
      return Invalid(r, "nnodes",
                     absl::InvalidArgumentError("--rdzv-backend static needs a fixed N; use grpc for MIN:MAX"));
    }
    if (spec->node_rank >= spec->max_nodes) {
      return Invalid(r, "node-rank",
                     absl::InvalidArgumentError(absl::StrCat("must be below --nnodes=", spec->max_nodes)));
    }
  } else if (spec->rdzv_backend == "etcd" || spec->rdzv_backend == "etcd-v2") {
    return Invalid(r, "rdzv-backend",
                   absl::InvalidArgumentError("elrun speaks etcd's v3 API only: use --rdzv-backend etcd-v3"));
  } else if (spec->rdzv_backend != "c10d" && spec->rdzv_backend != "grpc" && spec->rdzv_backend != "etcd-v3") {
    return Invalid(r, "rdzv-backend", absl::InvalidArgumentError("expected static, grpc, c10d or etcd-v3"));
  }
  return absl::OkStatus();
}

#undef ELRUN_ASSIGN_OR_INVALID

absl::Status BuildSpec(const Resolved& r, const std::vector<std::string>& rest, const DeviceCounts& devices,
                       JobSpec* spec) {
  // The steps in order; the first error is the answer.
  absl::Status status = ReadSize(r, devices, spec);
  for (auto step :
       {ReadRendezvous, ReadWorkers, ReadSupervision, RefusePluginsAndReadNuma, CheckCombinations, ResolveBackend}) {
    if (!status.ok()) return status;
    status = step(r, spec);
  }
  if (!status.ok()) return status;
  // The entrypoint and its arguments.
  if (rest.empty()) {
    return absl::InvalidArgumentError(
        spec->module ? "-m needs a module name; usage: elrun [options] -m MODULE [args...]"
                     : "missing TRAINING_SCRIPT; usage: elrun [options] TRAINING_SCRIPT [args...]");
  }
  spec->training_script = rest.front();
  spec->training_script_args.assign(rest.begin() + 1, rest.end());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ParsedCommandLine> ParseCommandLine(const std::vector<std::string>& args, const EnvLookup& env,
                                                   const DeviceCounts& devices) {
  CLI::App app(kUsage, "elrun");
  app.formatter(std::make_shared<UsageInDescriptionFormatter>());
  app.prefix_command();  // Everything from the training script on belongs to the workers.
  app.set_help_flag("-h,--help", "Print this help and exit.");
  bool version = false;  // Not torchrun's: elrun's own, as `elrun-rdzv --version`.
  app.add_flag("--version", version, "Print elrun's version and the commit it was built from, and exit.");
  app.get_formatter()->column_width(34);

  std::map<std::string, std::string> cli_values;
  std::map<std::string, CLI::Option*> cli_options;
  std::map<std::string, bool> flag_values;
  for (const OptionDef& def : kOptions) {
    std::string name = def.name;
    std::string underscored = absl::StrReplaceAll(name, {{"-", "_"}});
    std::string names = absl::StrCat("--", name);
    if (underscored != name) absl::StrAppend(&names, ",--", underscored);
    if (*def.short_name) absl::StrAppend(&names, ",-", def.short_name);
    std::string help = absl::StrCat(def.help, " [env ", PetName(name), "]");
    CLI::Option* option;
    if (def.flag) {
      option = app.add_flag(names, flag_values[name], help);
    } else {
      option = app.add_option(names, cli_values[name], help)->type_name(def.metavar);
      if (*def.default_value) option->default_str(def.default_value);
    }
    cli_options[name] = option;
  }

  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    return ParsedCommandLine{app.help(), {}};
  } catch (const CLI::ParseError& error) {
    std::string message = error.what();
    return absl::InvalidArgumentError(absl::StrCat(message, "; see elrun --help"));
  }

  if (version) {
    ParsedCommandLine parsed;
    parsed.version = true;
    return parsed;
  }
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front().size() > 1 && rest.front()[0] == '-' && rest.front() != "--") {
    return absl::InvalidArgumentError(absl::StrCat("unknown option ", rest.front(), "; see elrun --help"));
  }
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());

  Resolved resolved;
  for (const OptionDef& def : kOptions) {
    std::string name = def.name;
    std::string pet = PetName(name);
    if (cli_options[name]->count() > 0) {
      resolved.values[name] = def.flag ? (flag_values[name] ? "1" : "0") : cli_values[name];
      resolved.sources[name] = absl::StrCat("--", name);
      resolved.explicitly_set.insert(name);
    } else if (std::optional<std::string> value = env(pet)) {
      resolved.values[name] = *value;
      resolved.sources[name] = pet;
      resolved.explicitly_set.insert(name);
    } else {
      resolved.values[name] = def.default_value;
      resolved.sources[name] = absl::StrCat("--", name);
    }
  }

  // Under Slurm, what the command line and PET_ left unset comes from SLURM_* (not with
  // --standalone, which is a job of this node alone).
  ParsedCommandLine parsed;
  if (!resolved.Flag("standalone")) {
    auto slurm = SlurmValues([&env](const std::string& name) { return env(name); });
    if (!slurm.ok()) return absl::InvalidArgumentError(absl::StrCat("Slurm: ", slurm.status().message()));
    std::vector<std::string> taken;
    for (const SlurmValue& v : *slurm) {
      if (resolved.explicitly_set.count(v.option)) continue;
      resolved.values[v.option] = v.value;
      resolved.sources[v.option] = v.source;
      resolved.explicitly_set.insert(v.option);
      taken.push_back(absl::StrCat("--", v.option, " ", v.value, " (", v.source, ")"));
    }
    if (!taken.empty()) {
      parsed.slurm_note =
          absl::StrCat("from Slurm job ", env("SLURM_JOB_ID").value_or("?"), ": ", absl::StrJoin(taken, ", "));
    }
  }
  absl::Status status = BuildSpec(resolved, rest, devices, &parsed.spec);
  if (!status.ok()) return status;
  parsed.spec.log_line_prefix_template = env("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE");
  if (parsed.spec.virtual_local_rank) {
    if (std::optional<std::string> visible = env("CUDA_VISIBLE_DEVICES")) {
      int count = static_cast<int>(std::vector<std::string>(absl::StrSplit(*visible, ',')).size());
      if (parsed.spec.nproc_per_node > count) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--virtual-local-rank: local rank ", count, " has no device in CUDA_VISIBLE_DEVICES=", *visible, " (",
            count, " entries for --nproc-per-node ", parsed.spec.nproc_per_node, ")"));
      }
    }
  }
  return parsed;
}

}  // namespace elrun
