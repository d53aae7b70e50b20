"""The members of a test etcd cluster: their ports, directories and processes, and the registry
that kills every member still running when the interpreter exits (etcd_cluster.py drives them).

Standard library only.
"""
import atexit
import ctypes
import os
import random
import signal
import socket

from tests.support.procs import kill_and_reap

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)

# Every member process still running, by pid, so that nothing leaks if a test forgets close() or
# the interpreter exits on an exception: the atexit hook SIGKILLs and reaps them.
RUNNING = {}


@atexit.register
def kill_running():
    for proc in list(RUNNING.values()):
        kill_and_reap(proc)
    RUNNING.clear()


def die_with_parent(parent):
    """preexec_fn of every member: SIGKILL when the test process dies (even by SIGKILL)."""
    def setup():
        if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # The parent died before prctl: nobody would kill us.
            os.kill(os.getpid(), signal.SIGKILL)
    return setup


def etcd_env():
    """Our environment minus etcd's and etcdctl's own variables (ETCD_*, ETCDCTL_*: etcd 3.4
    reads every flag from one, and they would change what the flags here say) and proxies."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ETCD_", "ETCDCTL_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")}
    env["ETCDCTL_API"] = "3"
    return env


def random_loopback_host():
    """A random address 127.a.b.c (c in 2..254); all of 127/8 is loopback on Linux, so clusters
    of concurrent tests (and the suite's 127.0.0.N agents) practically never share one."""
    return "127.%d.%d.%d" % (random.randint(1, 254), random.randint(0, 255),
                             random.randint(2, 254))


def pick_ports(host, count):
    """`count` distinct ports that were free on host a moment ago. etcd can not listen on port 0
    and report the port, so the kernel picks them here (bind port 0, read it back) and they are
    released before etcd binds them: another process may take one in between, which the cluster
    start detects (a member exits with "address already in use") and retries with new ports."""
    socks = []
    try:
        for _ in range(count):  # All held open together, so the kernel never repeats one.
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()



class EtcdError(RuntimeError):
    """The cluster did not start, did not become healthy, or an etcdctl call failed; the message
    ends with the tails of the member logs."""


class PortTaken(EtcdError):
    pass



class Member:
    """One etcd member: its name, ports, data dir, log file and process (None when not running)."""

    def __init__(self, index, host, client_port, peer_port, directory):
        self.index = index
        self.name = "member%d" % index
        self.host, self.client_port, self.peer_port = host, client_port, peer_port
        self.data_dir = os.path.join(directory, self.name + ".data")
        self.log_path = os.path.join(directory, self.name + ".log")
        self.proc = None
        self.stopped = False  # SIGSTOPped through EtcdCluster.kill (until its SIGCONT).
        self.id = None  # etcd's member id (an int), learned from endpoint status.

    @property
    def endpoint(self):
        return "%s:%d" % (self.host, self.client_port)

    def running(self):
        """The process exists (it may be SIGSTOPped)."""
        return self.proc is not None and self.proc.poll() is None

    def serving(self):
        """Running and not SIGSTOPped: etcdctl calls go to serving members only."""
        return self.running() and not self.stopped

    def log_tail(self, limit=6000):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode("utf-8", "replace")
        except OSError as e:
            return "<no log: %s>" % e

