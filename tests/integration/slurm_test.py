"""elrun under a real Slurm: munged, slurmctld and two slurmd nodes on this machine (one slurmd
per node name, each with its own port and spool dir), started by the test with a generated
munge key and torn down after it. `srun -N 2 elrun --nproc-per-node 2 job.py` needs no topology
flag: nodes, node rank, the rendezvous endpoint (the step's first host) and the run id come
from SLURM_*. scancel stops every process of the job. The node names are names this machine's
/etc/hosts gives a loopback address, so the endpoint resolves and nothing leaves loopback."""
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import harness
from harness import ElrunTestCase

SLURM_TOOLS = ["munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel"]
START_TIMEOUT_S = 30

ALLREDUCE = r'''
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(os.environ["OUT_DIR"], "rank.%d" % dist.get_rank()), "w") as f:
    f.write("%d %s %s %g" % (dist.get_world_size(), os.environ["LOCAL_RANK"],
                             os.environ["SLURMD_NODENAME"], t.item()))
dist.destroy_process_group()
'''

HANG = r'''echo "$$ $SLURMD_NODENAME $LOCAL_RANK" >> "$OUT_DIR/started"
exec sleep 300
'''


def loopback_names():
    """Names /etc/hosts maps to 127.0.0.0/8, in file order, without duplicates and without
    localhost (Slurm reads NodeName=localhost as this host's own name)."""
    names = []
    with open("/etc/hosts") as f:
        for line in f:
            fields = line.split("#")[0].split()
            if len(fields) >= 2 and fields[0].startswith("127."):
                names += [n for n in fields[1:]
                          if n not in names and "." not in n and n != "localhost"]
    return names


class SlurmCluster:
    """munged + slurmctld + one slurmd per node name, all under `root`, in their own sessions."""

    def __init__(self, root, nodes):
        self.root, self.nodes, self.procs, self.reserved = root, nodes, [], []
        self.conf = os.path.join(root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def path(self, name):
        return os.path.join(self.root, name)

    def start(self):
        os.makedirs(self.path("state"))
        key = self.path("munge.key")
        subprocess.run(["mungekey", "-c", "-k", key, "-b", "1024"], check=True, timeout=30)
        os.chmod(key, 0o400)
        self.spawn("munged", ["munged", "-F", "--force", "--key-file=" + key,
                              "--socket=" + self.path("munge.sock"),
                              "--pid-file=" + self.path("munged.pid"),
                              "--log-file=" + self.path("munged.log"),
                              "--seed-file=" + self.path("munge.seed")])
        # Held until stop(): slurmctld and each slurmd bind theirs with SO_REUSEADDR.
        self.reserved = [harness.ReservedPort() for _ in range(2 + len(self.nodes))]
        ports = [r.port for r in self.reserved]
        lines = [
            "ClusterName=elrun", "SlurmctldHost=localhost(127.0.0.1)",
            "SlurmctldPort=%d" % ports[0], "SlurmdPort=%d" % ports[1],
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            "AuthInfo=socket=" + self.path("munge.sock"),
            "StateSaveLocation=" + self.path("state"),
            "SlurmdSpoolDir=" + self.path("spool.%n"),
            "SlurmctldPidFile=" + self.path("slurmctld.pid"),
            "SlurmdPidFile=" + self.path("slurmd.%n.pid"),
            "SlurmctldLogFile=" + self.path("slurmctld.log"),
            "SlurmdLogFile=" + self.path("slurmd.%n.log"),
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "ReturnToService=2", "PropagateResourceLimits=NONE",
            "KillWait=5",
        ]
        for node, port in zip(self.nodes, ports[2:]):
            lines.append("NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 Port=%d CPUs=2 State=UNKNOWN"
                         % (node, node, port))
        lines.append("PartitionName=test Nodes=%s Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
                     % ",".join(self.nodes))
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.wait_for(lambda: os.path.exists(self.path("munge.sock")), "munged's socket")
        self.spawn("slurmctld", ["slurmctld", "-D", "-f", self.conf])
        for node in self.nodes:
            self.spawn("slurmd." + node, ["slurmd", "-D", "-N", node, "-f", self.conf])
        self.wait_for(self.all_idle, "every node idle in sinfo")

    def spawn(self, name, argv):
        with open(self.path(name + ".out"), "w") as out:
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                               env=self.env, start_new_session=True))

    def all_idle(self):
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True,
                             text=True, timeout=30).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}

    def wait_for(self, condition, what):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:  # Bounded: the daemons have no readiness signal.
            if condition():
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    raise AssertionError("%s exited with %s while waiting for %s\n%s"
                                         % (proc.args[0], proc.returncode, what, self.logs()))
            time.sleep(0.1)
        raise AssertionError("no %s within %d s\n%s" % (what, START_TIMEOUT_S, self.logs()))

    def run(self, argv, **kwargs):
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, **kwargs)

    def logs(self):
        text = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith((".log", ".out")):
                with open(self.path(name), errors="replace") as f:
                    text.append("--- %s\n%s" % (name, f.read()[-2000:]))
        return "\n".join(text)

    def stop(self):
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
        for proc in reversed(self.procs):  # slurmd before slurmctld before munged.
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=15)
        for reserved in self.reserved:
            reserved.close()


@harness.elrun_only("elrun takes its topology from SLURM_*; torchrun needs flags")
class SlurmTest(ElrunTestCase):

    def setUp(self):
        super().setUp()
        missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
        self.assertEqual(missing, [], "Slurm is not installed: run scripts/setup.sh")
        names = loopback_names()
        if len(names) < 2:
            self.skipTest("needs two host names (not localhost) for loopback in /etc/hosts, found %s"
                          % names)
        # Short and world-traversable: munged's socket path has a 108-byte limit and must be
        # reachable by everyone.
        root = tempfile.mkdtemp(prefix="elrun-slurm-", dir="/tmp")
        os.chmod(root, 0o755)
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        self.cluster = SlurmCluster(root, names[:2])
        self.addCleanup(self.cluster.stop)
        self.cluster.start()

    def srun(self, args, **kwargs):
        env = self.env(OMP_NUM_THREADS="1", LOGLEVEL="INFO")
        env.update({k: v for k, v in self.cluster.env.items() if k == "SLURM_CONF"})
        return subprocess.Popen(["srun", "-N", "2", "--ntasks-per-node=1"] + args,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **kwargs)

    def test_srun_runs_a_two_node_torch_job_without_topology_flags(self):
        script = self.path("allreduce.py")
        with open(script, "w") as f:
            f.write(ALLREDUCE)
        started = time.monotonic()
        proc = self.srun(harness.elrun_command() + ["--nproc-per-node", "2", script])
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - started
        self.assertEqual(proc.returncode, 0, "srun failed\n%s\n%s\n%s" % (out, err, self.cluster.logs()))
        names = sorted(n for n in os.listdir(self.tmp) if n.startswith("rank."))
        self.assertEqual(names, ["rank.%d" % r for r in range(4)], "expected one record per rank")
        ranks = []
        for name in names:
            world, _, node, total = self.read_text(self.path(name)).split()
            ranks.append((int(name[5:]), int(world), node, float(total)))
        self.assertEqual({r[1] for r in ranks}, {4})
        self.assertEqual({r[3] for r in ranks}, {10.0}, "expected all_reduce of 1+2+3+4")
        self.assertEqual(sorted(r[2] for r in ranks), sorted(self.cluster.nodes * 2),
                         "expected two workers on each Slurm node")
        notes = re.findall(r"\[elrun\] info: from Slurm job (\d+): (.*)", err)
        self.assertEqual(len(notes), 2, "expected one line per node saying what came from Slurm\n" + err)
        first = sorted(self.cluster.nodes)[0]
        for job, note in notes:
            self.assertIn("--nnodes 2 (SLURM_STEP_NUM_NODES)", note)
            self.assertIn("--rdzv-endpoint %s:" % first, note)
            self.assertIn("--rdzv-id slurm-%s.0" % job, note)
        self.assertLess(took, 60)

    def test_scancel_stops_every_process(self):
        proc = self.srun(["-J", "hangjob"] + harness.elrun_command() +
                         ["--nproc-per-node", "2"] + self.sh_file(HANG, "hang.sh"))
        started = self.path("started")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:  # Bounded.
            if os.path.exists(started) and len(self.read_text(started).splitlines()) == 4:
                break
            time.sleep(0.1)
        workers = [int(line.split()[0]) for line in self.read_text(started).splitlines()]
        self.assertEqual(len(workers), 4, "expected 4 workers to start")
        job = self.cluster.run(["squeue", "-h", "-n", "hangjob", "-o", "%i"], timeout=30).stdout.strip()
        binary = harness.elrun_command()[0]
        agents = [p for p in harness.descendants(os.getpid()) if harness.cmdline(p).startswith(binary)]
        self.assertGreaterEqual(len(agents), 2, "expected an elrun (and its guardian) per node")
        self.assertEqual(self.cluster.run(["scancel", job], timeout=30).returncode, 0)
        proc.communicate(timeout=60)
        alive = harness.wait_dead(workers + agents, 30)
        self.assertEqual(alive, [], "expected every worker and elrun gone after scancel: %s"
                         % harness.describe(alive))


if __name__ == "__main__":
    harness.main()
