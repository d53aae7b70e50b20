"""--start-method forkserver: Python workers forked from a server that imported torch once. A
forked worker sees what an exec'd one sees (argv, environment, working directory, unbuffered
streams, __file__, signal dispositions, exit codes, tracebacks without the server's frames), is
elrun's own child leading its own process group, and is killed with elrun by the guardian. A
restart forks again without importing torch; a server that died is started again; a server that
runs threads after --preload refuses with one line naming the option. --auto-heartbeat gives
progress heartbeats to scripts that never beat, exec'd or forked."""
import os
import re
import signal

import harness
from harness import ElrunTestCase, worker

DUMP_ENV = worker("dump_env.py")
DDP_RESUME = worker("torch_ddp_resume.py")

PROBE = r"""
import os, signal, sys
print("probe rank=%s pid=%d ppid=%d pgid=%d torch=%s file=%s argv=%s cwd=%s path0=%s mask=%s term=%s int=%s" % (
    os.environ["RANK"], os.getpid(), os.getppid(), os.getpgid(0), "torch" in sys.modules, __file__, sys.argv,
    os.getcwd(), sys.path[0], sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT).__name__), flush=True)
code = sys.argv[1]
if code == "raise":
    def inner():
        raise ValueError("from the script")
    inner()
if code == "wait":  # Until elrun's death kills it.
    import time
    time.sleep(60)
sys.exit(int(code))
"""


def comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


@harness.elrun_only("torchrun runs its workers with multiprocessing's spawn only for functions")
class ForkserverTest(ElrunTestCase):

    def probe(self, method, code, extra=(), nproc=1, entry="probe.py"):
        script = self.path("probe.py")
        with open(script, "w") as f:
            f.write(PROBE)
        return self.elrun(["--nproc-per-node", str(nproc), "--start-method", method] + list(extra) +
                          [entry, code])

    def probe_lines(self, result):
        return re.findall(r"^probe .*$", result.out, re.M)

    def test_a_forked_worker_sees_what_an_execd_one_sees(self):
        self.maxDiff = None
        spawned, forked = self.probe("spawn", "0"), self.probe("forkserver", "0")
        self.assertExit(spawned, 0)
        self.assertExit(forked, 0)
        strip = lambda line: re.sub(r"pid=\d+ ppid=\d+ pgid=\d+ torch=\w+ ", "", line)  # noqa: E731
        self.assertEqual([strip(l) for l in self.probe_lines(forked)],
                         [strip(l) for l in self.probe_lines(spawned)])
        for extra, entry in ((["--run-path"], "probe.py"), (["-m"], "probe")):  # runpy's ways, also alike.
            spawned = self.probe("spawn", "0", extra=extra, entry=entry)
            via_server = self.probe("forkserver", "0", extra=extra, entry=entry)
            self.assertExit(via_server, 0)
            self.assertEqual([strip(l) for l in self.probe_lines(via_server)],
                             [strip(l) for l in self.probe_lines(spawned)], extra)
        (line,) = self.probe_lines(forked)
        self.assertIn("torch=True", line)  # Imported by the server, before the script.
        self.assertIn("file=%s argv=['probe.py', '0'] cwd=%s" % (self.path("probe.py"), self.tmp), line)
        pid, pgid = re.search(r"pid=(\d+) ppid=\d+ pgid=(\d+)", line).groups()
        self.assertEqual(pid, pgid)  # It leads its own process group.
        env = {}
        for method in ("spawn", "forkserver"):
            result = self.elrun(["--start-method", method, DUMP_ENV, self.path()])
            self.assertExit(result, 0)
            env[method] = self.read_json("env_r0_a0.json")
            os.remove(self.path("env_r0_a0.json"))
        self.assertEqual(env["forkserver"]["argv"], env["spawn"]["argv"])
        self.assertTrue(env["forkserver"]["stdout_write_through"])
        drop = {"_", "TORCHELASTIC_RUN_ID", "MASTER_PORT", "ELRUN_HEARTBEAT_FILE",
                "TORCHELASTIC_ERROR_FILE"}  # Fresh in every run.
        self.assertEqual({k: v for k, v in env["forkserver"]["env"].items() if k not in drop},
                         {k: v for k, v in env["spawn"]["env"].items() if k not in drop})

    def test_exit_codes_and_tracebacks_are_the_scripts(self):
        for method in ("spawn", "forkserver"):
            self.assertExit(self.probe(method, "3"), 1)
            result = self.probe(method, "raise")
            self.assertExit(result, 1)
            self.assertIn('probe.py", line 11, in <module>', result.err)
            self.assertIn("ValueError: from the script", result.err)
            self.assertNotIn("elrun_forkserver", result.err, result)
            self.assertNotIn("runpy", result.err, result)

    def test_workers_are_elruns_children_and_die_with_it(self):
        script = self.path("probe.py")
        with open(script, "w") as f:
            f.write(PROBE)
        proc = self.start(["--nproc-per-node", "2", "--start-method", "forkserver", "probe.py", "wait"],
                          env=self.env())
        lines = [proc.stdout.readline().decode(), proc.stdout.readline().decode()]
        pids = []
        for line in lines:
            pid, ppid = re.search(r"pid=(\d+) ppid=(\d+)", line).groups()
            self.assertEqual(int(ppid), proc.pid, lines)
            pids.append(int(pid))
        servers = [p for p in harness.descendants(proc.pid)
                   if "elrun_forkserver.py" in harness.cmdline(p) and p not in pids]
        self.assertEqual(len(servers), 1)
        for pid in pids:  # Forked workers keep the server's command line; their name is the script's.
            self.assertEqual(comm(pid), "probe.py")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.assertAllDead(pids + servers, what="workers and forkserver of a killed elrun")
        self.assertEqual([d for d in os.listdir(self.tmp) if d.startswith("elrun_py_")], [])

    def test_a_restart_forks_again_and_a_dead_server_is_started_again(self):
        ckpt = self.path("ckpt")
        result = self.elrun(["--nproc-per-node", "2", "--max-restarts", "2", "--start-method", "forkserver",
                             "--inject-faults", "kill-worker:1@step10", "--report-file", self.path("r.json"),
                             DDP_RESUME, ckpt, "30", "5", "0.01"])
        self.assertExit(result, 0)
        starts = re.findall(r"rank (\d) starts at step (\d+) pid \d+ torch_preloaded (True|False)", result.out)
        self.assertEqual(sorted(starts), [("0", "0", "True"), ("0", "10", "True"), ("1", "0", "True"),
                                          ("1", "10", "True")], result)
        (fault,) = self.read_json("r.json")["faults"]
        self.assertTrue(fault["recovered"])
        # Kill the server between attempts: the next spawn starts another one.
        proc = self.start(["--nproc-per-node", "1", "--max-restarts", "1", "--start-method", "forkserver",
                           self.sh_probe_exit_once()], env=self.env())
        first = proc.stdout.readline().decode()
        self.assertIn("attempt 0", first)
        (server,) = [p for p in harness.descendants(proc.pid)
                     if "elrun_forkserver.py" in harness.cmdline(p) and "once.py" not in comm(p)]
        os.kill(server, signal.SIGKILL)
        harness.wait_dead([server], 10)
        with open(self.path("go"), "w"):
            pass
        result = self.finish(proc)
        self.assertExit(result, 0)
        self.assertIn("attempt 1 done", result.out)
        self.assertRegex(result.err, r"\[elrun\] warning: the forkserver is gone .*; starting the forkserver again")

    def sh_probe_exit_once(self):
        script = self.path("once.py")
        with open(script, "w") as f:
            f.write("import os, sys, time\n"
                    "attempt = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
                    "print('attempt %s' % attempt, flush=True)\n"
                    "if attempt == '0':\n"
                    "    while not os.path.exists('go'):\n"
                    "        time.sleep(0.01)\n"
                    "    sys.exit(5)\n"
                    "print('attempt 1 done', flush=True)\n")
        return "once.py"

    def test_a_server_with_threads_refuses_in_one_line(self):
        result = self.elrun(["--start-method", "forkserver", "--preload", "thread_at_import", DUMP_ENV, self.path()],
                            env=self.env(PYTHONPATH=harness.WORKERS))
        self.assertExit(result, 1)
        self.assertRegex(result.err, r"--start-method forkserver: the forkserver runs 1 other thread\(s\) after "
                         r"importing .*thread_at_import: at-import \(\d+\); forking would copy their locks but not "
                         r"them\. Run without --start-method forkserver")
        self.assertFalse(os.path.exists(self.path("env_r0_a0.json")))
        for bad in ("os;rm", "a b", ""):
            result = self.elrun(["--start-method", "forkserver", "--preload", bad + ",x", DUMP_ENV, self.path()])
            self.assertExit(result, 2)
            self.assertIn("expected Python module names", result.err)

    def test_no_python_workers_are_execd(self):
        result = self.elrun(["--start-method", "forkserver", "--no-python", "true"])
        self.assertExit(result, 0)
        self.assertIn("--start-method forkserver applies to Python workers; these are exec'd", result.err)

    def test_auto_heartbeat_beats_for_scripts_that_never_do(self):
        for method in ("spawn", "forkserver"):
            report = self.path("auto_%s.json" % method)
            result = self.elrun(["--nproc-per-node", "2", "--start-method", method, "--auto-heartbeat",
                                 "--report-file", report, DDP_RESUME, self.path("ck_" + method), "12", "100",
                                 "0.01", "auto"], env=self.env(PYTHONPATH="/nonexistent/user/path"))
            self.assertExit(result, 0)
            data = self.read_json(report)
            # AdamW keeps its step count: the beats name steps 0..11, on both workers.
            self.assertEqual(data["step"], 11, result)
            self.assertEqual(data["beats"], 24, result)
            self.assertIsNotNone(data["goodput"])


if __name__ == "__main__":
    harness.main()
