"""Every option of torchrun 2.11 (read from the installed torch's own parser, not a copy) is
known to elrun, under both spellings and as PET_<NAME>; torchrun's Python plugin options accept
their defaults and refuse anything else in one line; TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE,
--duplicate-stdout-filters and --virtual-local-rank behave as in torchrun."""
import json
import os
import re
import subprocess

import harness
from harness import ElrunTestCase, lines, sh, worker

DUMP_ENV = worker("dump_env.py")
TALK = 'echo "loss=$LOCAL_RANK"; echo "noise$LOCAL_RANK"; echo "acc,$LOCAL_RANK"'

# torchrun's own parser, dumped as JSON: [[option strings], dest, is_flag].
PARSER_DUMP = r'''
import json, argparse
from torch.distributed.run import get_args_parser
print(json.dumps([[a.option_strings, a.dest, isinstance(a, (argparse._StoreTrueAction,
                   argparse._StoreConstAction)) or a.nargs == 0]
                  for a in get_args_parser()._actions if a.option_strings]))
'''


# Every variable torchrun 2.11's launcher and agent read or export, and what elrun does with it.
# The test fails when the installed torch reads one that is not here, or docs/cli.md (its
# "Environment variables elrun reads" and the worker environment it links) does not name it.
TORCH_VARIABLES = {
    "TORCHELASTIC_ERROR_FILE": "per worker; in elrun's own environment, where the root cause goes",
    "TORCHELASTIC_RESTART_COUNT": "per worker",
    "TORCHELASTIC_MAX_RESTARTS": "per worker",
    "TORCHELASTIC_RUN_ID": "per worker",
    "TORCHELASTIC_USE_AGENT_STORE": "per worker: False",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "per worker: --signals-to-handle",
    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "the tee prefix",
    "TORCHELASTIC_ENABLE_FILE_TIMER": "the FileTimer watchdog (watchdog_test)",
    "TORCHELASTIC_TIMER_FILE": "the watchdog's FIFO, passed to the workers",
    "TORCHELASTIC_HEALTH_CHECK_PORT": "ignored: torch's own health check server starts nothing",
    "TORCH_ELASTIC_WORKER_IDENTICAL": "no effect: ranks come from the coordinator in one round",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "no effect: elrun never shares its store with workers",
    "TORCHELASTIC_ETCD_BINARY_PATH": "torch's etcd test server only",
}
TORCH_VARIABLE = r"\b(TORCHELASTIC_[A-Z_]+|TORCH_ELASTIC_[A-Z_]+|TORCH_DISABLE_SHARE_RDZV_TCP_STORE)\b"


def torch_variables():
    """The variables named in torch.distributed's launcher, agent and rendezvous sources."""
    out = subprocess.run([harness.PYTHON, "-c", "import torch.distributed, os; "
                          "print(os.path.dirname(torch.distributed.__file__))"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    root = out.strip().splitlines()[-1]
    names = set()
    for top in ["run.py", "elastic", "launcher"]:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        names.update(re.findall(TORCH_VARIABLE, f.read()))
        if top == "run.py":
            with open(os.path.join(root, top)) as f:
                names.update(re.findall(TORCH_VARIABLE, f.read()))
    return names


def torchrun_options():
    out = subprocess.run([harness.PYTHON, "-c", PARSER_DUMP], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


class TorchrunOptionsTest(ElrunTestCase):

    @harness.elrun_only("compares elrun's --help with torchrun's parser")
    def test_every_torchrun_option_is_known_to_elrun(self):
        result = self.elrun(["--help"])
        self.assertExit(result, 0)
        options = torchrun_options()
        self.assertGreater(len(options), 25, "expected torchrun 2.11's ~30 options")
        for strings, dest, _ in options:
            if dest == "help":
                continue
            for option in strings:
                self.assertIn(option, result.out, "torchrun's %s is missing from elrun --help"
                              % option)
            self.assertIn("PET_" + dest.upper(), result.out,
                          "expected PET_%s for torchrun's --%s" % (dest.upper(), dest))

    def test_every_variable_torchrun_reads_is_handled_and_documented(self):
        found = torch_variables()
        self.assertIn("TORCHELASTIC_ENABLE_FILE_TIMER", found, "expected to read torch's sources")
        self.assertEqual(sorted(found - set(TORCH_VARIABLES)), [],
                         "torch reads variables this test (and elrun) does not know")
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        text = ""
        for doc in ("README.md", os.path.join("docs", "cli.md")):
            with open(os.path.join(root, doc)) as f:
                text += f.read()
        self.assertEqual([v for v in TORCH_VARIABLES if "`%s`" % v not in text], [],
                         "expected the README or docs/cli.md to say what elrun does with each")

    @harness.elrun_only("elrun's line about --numa-binding on a machine without GPUs")
    def test_numa_binding_without_gpus_runs_unbound_with_one_line(self):
        # This machine has no NVIDIA GPU: every mode is accepted, the workers run with elrun's
        # own affinity, and one line says so (the planning itself is numa_binding_test's, the
        # binding of a real process posix_process_table_test's).
        for mode in ["node", "socket", "exclusive", "core-complex"]:
            result = self.elrun(["--numa-binding", mode, "--nproc-per-node", "2"] +
                                sh("grep Cpus_allowed_list /proc/self/status"),
                                env=self.env(OMP_NUM_THREADS="1"))
            self.assertExit(result, 0)
            self.assertEqual(lines(result.err), ["[elrun] warning: --numa-binding: no NVIDIA GPU "
                                                 "on this machine; workers are not bound"], result)
            with open("/proc/self/status") as f:
                own = [l for l in f.read().splitlines() if l.startswith("Cpus_allowed_list")]
            self.assertEqual(lines(result.out), own * 2, result)

    @harness.elrun_only("elrun's refusals of torchrun's Python plugins")
    def test_plugin_options_accept_their_defaults_and_refuse_the_rest(self):
        result = self.elrun(["--event-log-handler", "null", "--logs_specs", ""] + sh("exit 0"))
        self.assertExit(result, 0)
        for args, says in [
                (["--event-log-handler", "console"], "elrun loads no Python event handlers"),
                (["--logs-specs", "mine"], "elrun loads no Python LogsSpecs plugins"),
                (["--numa-binding", "bogus"], "expected node, socket, exclusive or core-complex")]:
            result = self.elrun(args + sh("touch ran"))
            self.assertExit(result, 2)
            self.assertEqual(len(lines(result.err)), 1, "expected one line\n%s" % result)
            self.assertIn(says, result.err, result)
            self.assertFalse(os.path.exists(self.path("ran")), "expected no worker to start")

    def test_log_line_prefix_template(self):
        env = self.env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="<${role_name}|${rank}|${local_rank}> ")
        result = self.elrun(["--nproc-per-node", "2", "--role", "trainer", "--tee", "1",
                             "--log-dir", self.path("logs")] + sh(TALK), env=env)
        self.assertExit(result, 0)
        for rank in (0, 1):
            self.assertIn("<trainer|%d|%d> loss=%d" % (rank, rank, rank), lines(result.out),
                          "expected the template's prefix on tee'd lines\n%s" % result)

    @harness.elrun_only("torchrun's filtered log lies below a run directory of its own naming")
    def test_duplicate_stdout_filters(self):
        result = self.elrun(["--nproc-per-node", "2", "--rdzv-id", "job", "--tee", "1",
                             "--log-dir", self.path("logs"),
                             "--duplicate-stdout-filters", "loss,acc,,"] + sh(TALK))
        self.assertExit(result, 0)
        filtered = self.read_text(self.path("logs", "job", "attempt_0", "filtered_stdout.log"))
        # "acc,," is the literal "acc,"; "noise" lines match nothing.
        self.assertEqual(sorted(filtered.splitlines()),
                         ["[default0]:acc,0", "[default0]:loss=0", "[default1]:acc,1",
                          "[default1]:loss=1"])
        self.assertIn("[default0]:noise0", lines(result.out), "expected every line on the console")

    def test_virtual_local_rank(self):
        result = self.elrun(["--nproc-per-node", "2", "--virtual-local-rank", DUMP_ENV, self.tmp],
                            env=self.env(CUDA_VISIBLE_DEVICES="3,5"))
        self.assertExit(result, 0)
        records = [self.read_json(n) for n in sorted(os.listdir(self.tmp)) if n.startswith("env_")]
        self.assertEqual(sorted((r["env"]["RANK"], r["env"]["LOCAL_RANK"],
                                 r["env"]["CUDA_VISIBLE_DEVICES"]) for r in records),
                         [("0", "0", "3"), ("1", "0", "5")],
                         "expected LOCAL_RANK 0 everywhere and each worker's own device\n%s" % result)

    @harness.elrun_only("elrun checks the device count before starting")
    def test_virtual_local_rank_without_enough_devices(self):
        result = self.elrun(["--nproc-per-node", "3", "--virtual-local-rank"] + sh("touch ran"),
                            env=self.env(CUDA_VISIBLE_DEVICES="3,5"))
        self.assertExit(result, 2)
        self.assertIn("local rank 2 has no device in CUDA_VISIBLE_DEVICES=3,5", result.err)


if __name__ == "__main__":
    harness.main()
