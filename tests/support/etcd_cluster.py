"""A real etcd v3 cluster on loopback for the integration tests (Debian's etcd 3.4 and etcdctl).

    with EtcdCluster(self.tmp, members=3) as cluster:
        elrun(["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", cluster.endpoints, ...])
        cluster.kill(cluster.leader())

Every member listens on one random loopback address 127.a.b.c (client and peer ports picked by
the kernel), keeps its data dir and its log (member<i>.log) in a fresh directory under the
caller's temp dir, and runs with test timings (heartbeat 100 ms, election timeout 1 s, pre-vote).
Members are our children with a parent-death signal of SIGKILL, are recorded in a module-wide
registry that an atexit hook SIGKILLs, and are SIGTERMed, then SIGKILLed, and reaped by close():
none outlives the test, even one that fails or dies. etcdctl runs with every wait bounded.
Single-threaded, like harness: members get SIGKILL when the *thread* that started them exits.
Standard library only; tests.support.procs supplies pidfd waits; etcd_member.py the members and
their registry, etcd_tls.py the certificates. Self-test, from the repository root:
python3 -m tests.support.etcd_cluster
"""
import base64
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request

from tests.support.etcd_member import (RUNNING, EtcdError, Member, PortTaken,  # noqa: F401
                                       die_with_parent, etcd_env, pick_ports, random_loopback_host)
from tests.support.etcd_tls import TlsFiles, make_tls_files  # noqa: F401
from tests.support.procs import DEATH_TIMEOUT_S, cmdline, describe, is_running, wait_dead

ETCD = os.environ.get("ETCD_BIN", "/usr/bin/etcd")
ETCDCTL = os.environ.get("ETCDCTL_BIN", "/usr/bin/etcdctl")

# Bounds for the waits of this module; none of them is a synchronisation sleep.
HEALTHY_TIMEOUT_S = 20.0  # A started cluster to serve linearizable reads on every member.
LEADER_TIMEOUT_S = 10.0  # A leader to be elected among the surviving members.
STOP_TIMEOUT_S = 5.0  # A member to exit after SIGTERM before it gets SIGKILL.
ETCDCTL_TIMEOUT_S = 15.0  # One etcdctl invocation (its own dial/command timeouts are shorter).
POLL_S = 0.1  # Between two polls of the cluster's state; etcd offers nothing to wait on.
START_ATTEMPTS = 3  # Whole-cluster starts when a port we picked was taken (see _pick_ports).


def _series_sum(body, name, labels):
    """The sum of the labelled series `name` of Prometheus text `body` that carry every
    label=value of `labels` (all of them for {}); 0 when there is none."""
    wanted = ['%s="%s"' % item for item in labels.items()]
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + "{"):
            series, value = line.rsplit(None, 1)
            if all(w in series[len(name) + 1:-1].split(",") for w in wanted):
                total += float(value)
    return total



class EtcdCluster:
    """A `members`-member etcd cluster on a random loopback address, started and healthy on
    construction (or __enter__), stopped by close() (or __exit__).

    tmpdir: where the cluster's directory (data dirs and member logs) is made.
    auth: None, or (user, password): the root user is created with that password and auth
    enabled once the cluster is healthy; every etcdctl call then passes --user user:password.
    tls: None, or TlsFiles: client URLs become https with that server certificate (peers stay
    http); the cluster listens on tls.ip when set. host: the loopback address (else tls.ip, else
    random). extra_args: more etcd flags for every member.

    endpoints / endpoint_list: every member's client host:port (as --rdzv-endpoint takes them),
    killed members included; live_endpoint_list: only serving members' (running, not stopped).
    Member i is self.members[i] (name, ports, data_dir, log_path, proc).

    lab, lab_hosts: member i runs in test host lab_hosts[i] of a netlab.NetLab, on that host's
    address and etcd's own ports (2379, 2380: the namespace holds nothing else); etcdctl runs in
    the host of the first member it is given. /metrics is not read there (metric() gives None)."""

    def __init__(self, tmpdir, members=3, auth=None, tls=None, host=None, extra_args=(), lab=None, lab_hosts=None):
        if members < 1:
            raise ValueError("members must be >= 1")
        self.tmpdir = tmpdir
        self.size = members
        self.auth = auth
        self.tls = tls
        self.fixed_host = host or (tls.ip if tls is not None else None)
        self.extra_args = list(extra_args)
        self.lab, self.lab_hosts = lab, list(lab_hosts or [])
        if lab is not None and len(self.lab_hosts) != members:
            raise ValueError("lab_hosts must name one test host per member")
        self.members = []
        self.dir = None
        self.token = None
        self._closed = False
        self._start()

    # -- addresses ------------------------------------------------------------------------------

    @property
    def scheme(self):
        return "https" if self.tls is not None else "http"

    @property
    def host(self):
        return self.members[0].host

    @property
    def endpoint_list(self):
        return [m.endpoint for m in self.members]

    @property
    def endpoints(self):
        return ",".join(self.endpoint_list)

    @property
    def live_endpoint_list(self):
        """host:port of the members that are running and not SIGSTOPped."""
        return [m.endpoint for m in self.members if m.serving()]

    def client_url(self, i):
        return "%s://%s" % (self.scheme, self.members[i].endpoint)

    # -- starting -------------------------------------------------------------------------------

    def _start(self):
        failures = []
        for attempt in range(1, START_ATTEMPTS + 1):
            self.dir = tempfile.mkdtemp(prefix="etcd.", dir=self.tmpdir)
            self.token = "elrun-test-%s" % os.path.basename(self.dir)
            if self.lab is not None:
                self.members = [Member(i, self.lab.addr(h), 2379, 2380, self.dir) for i, h in enumerate(self.lab_hosts)]
            else:
                host = self.fixed_host or random_loopback_host()
                ports = pick_ports(host, 2 * self.size)
                self.members = [Member(i, host, ports[2 * i], ports[2 * i + 1], self.dir) for i in range(self.size)]
            try:
                for i in range(self.size):
                    self._spawn(i)
                self._wait_healthy(HEALTHY_TIMEOUT_S)
                break
            except PortTaken as e:
                # A port picked by pick_ports was taken before etcd bound it; another address
                # and fresh ports make a repeat practically impossible.
                failures.append("attempt %d: %s" % (attempt, e))
                self._stop_all()
                self._remove_data()
            except BaseException:
                self._stop_all()
                raise
        else:
            raise EtcdError("etcd cluster did not start in %d attempts (ports taken):\n%s\n%s"
                            % (START_ATTEMPTS, "\n".join(failures), self.logs()))
        for m in self.members:
            status = self._status(m.index)
            if status is None:
                self._stop_all()
                raise EtcdError("etcd %s was healthy but then gave no endpoint status\n%s"
                                % (m.name, self.logs()))
            m.id = status["header"]["member_id"]
        if self.auth is not None:
            user, password = self.auth
            self.etcdctl("user", "add", "%s:%s" % (user, password), auth=False)
            self.etcdctl("auth", "enable", auth=False)  # Grants the root role to user root.

    def _member_args(self, m):
        initial = ",".join("%s=http://%s:%d" % (o.name, o.host, o.peer_port)
                           for o in self.members)
        client = self.client_url(m.index)
        peer = "http://%s:%d" % (m.host, m.peer_port)
        args = [ETCD, "--name", m.name, "--data-dir", m.data_dir,
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.token,
                "--heartbeat-interval", "100", "--election-timeout", "1000", "--pre-vote",
                "--bcrypt-cost", "4",  # The minimum: each etcdctl --user call hashes once.
                # etcd 3.4 defaults to the deprecated capnslog logger; zap logs JSON lines.
                "--logger", "zap", "--log-outputs", "stderr"]
        if self.tls is not None:
            args += ["--cert-file", self.tls.cert, "--key-file", self.tls.key,
                     "--trusted-ca-file", self.tls.ca,
                     "--client-cert-auth=%s" % str(bool(self.tls.client_cert_auth)).lower()]
        return args + self.extra_args

    def _spawn(self, i):
        m = self.members[i]
        # Appends: a restarted member's log follows its first life's.
        args = self._member_args(m)
        if self.lab is not None:
            args = self.lab.command(self.lab_hosts[i], args)
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, env=etcd_env(),
                                      cwd=self.dir, preexec_fn=die_with_parent(os.getpid()))
        RUNNING[m.proc.pid] = m.proc

    def _wait_healthy(self, timeout, members=None):
        """Polls `etcdctl endpoint health` (a linearizable read on each endpoint) of the running
        `members` (default: all) until every one answers; raises PortTaken when a member
        exited because its port was taken, EtcdError when one exited otherwise or on timeout."""
        members = [self.members[i] for i in (members if members is not None
                                              else range(self.size))]
        deadline = time.monotonic() + timeout
        last = None
        for _ in range(int(timeout / POLL_S) + 10):  # Bounded: each round polls or times out.
            for m in members:
                if not m.running():
                    tail = m.log_tail()
                    if "address already in use" in tail:
                        raise PortTaken("%s: port %d or %d was taken"
                                         % (m.name, m.client_port, m.peer_port))
                    raise EtcdError("etcd %s exited (%s) while the cluster started\n%s"
                                    % (m.name, m.proc.returncode, self.logs()))
            last = self._run_ctl(["endpoint", "health", "--dial-timeout=500ms",
                                  "--command-timeout=1s"],
                                 [self.client_url(m.index) for m in members], auth=False,
                                 timeout=5.0)
            if last.returncode == 0:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        raise EtcdError("etcd cluster %s was not healthy within %.0f s; last etcdctl endpoint "
                        "health said:\n%s%s\n%s" % (self.endpoints, timeout, last.stdout,
                                                    last.stderr, self.logs()))

    # -- etcdctl --------------------------------------------------------------------------------

    def _ctl_flags(self, auth):
        flags = []
        if self.tls is not None:
            flags += ["--cacert", self.tls.ca,
                      "--cert", self.tls.client_cert or self.tls.cert,
                      "--key", self.tls.client_key or self.tls.key]
        if auth and self.auth is not None:
            flags += ["--user", "%s:%s" % self.auth]
        return flags

    def _run_ctl(self, args, urls, auth=True, timeout=ETCDCTL_TIMEOUT_S):
        argv = [ETCDCTL, "--endpoints", ",".join(urls)] + self._ctl_flags(auth) + list(args)
        if self.lab is not None:
            first = next(m for m in self.members if urls and m.endpoint in urls[0])
            argv = self.lab.command(self.lab_hosts[first.index], argv)
        try:
            return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=etcd_env(), timeout=timeout,
                                  universal_newlines=True)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(argv, -1, _text(e.stdout), _text(e.stderr) +
                                               "\n<etcdctl killed after %.0f s>" % timeout)

    def etcdctl_result(self, *args, endpoints=None, auth=True, timeout=ETCDCTL_TIMEOUT_S):
        """Runs `etcdctl ARGS` against the serving members (or `endpoints`, member indexes),
        with the cluster's TLS and auth flags (auth=False: without --user); returns its
        subprocess.CompletedProcess (returncode -1 when killed after timeout)."""
        indexes = endpoints if endpoints is not None else [m.index for m in self.members
                                                           if m.serving()]
        return self._run_ctl(args, [self.client_url(i) for i in indexes], auth, timeout)

    def etcdctl(self, *args, check=True, endpoints=None, auth=True, timeout=ETCDCTL_TIMEOUT_S):
        """etcdctl_result's stdout. check: raise EtcdError (with its output and the member logs)
        unless etcdctl exits 0."""
        proc = self.etcdctl_result(*args, endpoints=endpoints, auth=auth, timeout=timeout)
        if check and proc.returncode != 0:
            raise EtcdError("etcdctl %s failed (exit %s):\n%s%s\n%s"
                            % (" ".join(args), proc.returncode, proc.stdout, proc.stderr,
                               self.logs()))
        return proc.stdout

    def put(self, key, value):
        self.etcdctl("put", key, value)

    def get(self, key):
        """The value of key (str), or None when it does not exist."""
        kvs = json.loads(self.etcdctl("get", key, "-w", "json")).get("kvs") or []
        return _b64(kvs[0]["value"]) if kvs else None

    def keys(self, prefix=""):
        """The keys under prefix ("" = all), sorted, as str."""
        out = self.etcdctl("get", "--prefix", "--keys-only", "-w", "json", "--", prefix)
        return sorted(_b64(kv["key"]) for kv in json.loads(out).get("kvs") or [])

    def metric(self, i, name, labels=None):
        """The value of member i's metric `name` (a counter or gauge of /metrics): the series
        without labels, or the sum of those that carry every label=value of `labels`; 0 when
        none has been exported yet for `labels`. Raises EtcdError when the member does not
        answer, or has no unlabelled series `name`."""
        body = self._metrics(i, timeout=ETCDCTL_TIMEOUT_S)
        if body is None:
            raise EtcdError("member %d did not serve /metrics\n%s" % (i, self.logs()))
        if labels is not None:
            return _series_sum(body, name, labels)
        for line in body.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise EtcdError("member %d has no metric %s" % (i, name))

    def leases(self):
        """The ids of the cluster's leases, sorted."""
        out = json.loads(self.etcdctl("lease", "list", "-w", "json"))
        return sorted(lease["id"] for lease in out.get("leases") or [])

    # -- leadership and failures ----------------------------------------------------------------

    def _status(self, i, timeout=5.0):
        """Member i's `endpoint status` (the Status object of -w json), or None when it does not
        answer."""
        proc = self._run_ctl(["endpoint", "status", "-w", "json", "--dial-timeout=500ms",
                              "--command-timeout=1s"], [self.client_url(i)], auth=False,
                             timeout=timeout)
        if proc.returncode != 0:
            return None
        try:
            return json.loads(proc.stdout)[0]["Status"]
        except (ValueError, LookupError):
            return None

    def _leader_once(self, exclude=()):
        """The index of the member that the serving members (but `exclude`) agree leads, and
        that says so itself; None when there is none (yet)."""
        by_id = {m.id: m.index for m in self.members}
        votes = set()
        for m in self.members:
            if not m.serving() or m.index in exclude:
                continue
            status = self._status(m.index)
            if status is None or not status.get("leader"):
                return None
            votes.add(by_id.get(status["leader"]))
        if len(votes) != 1:
            return None
        leader = votes.pop()
        if leader is None or leader in exclude or not self.members[leader].serving():
            return None
        return leader

    def leader(self, timeout=LEADER_TIMEOUT_S):
        """The index of the current leader: the member whose id is the leader id that every
        serving member reports (etcdctl's IsLeader). Polls while an election is under way;
        raises EtcdError when the serving members agree on no serving leader within timeout."""
        return self.wait_for_leader(timeout=timeout)

    def wait_for_leader(self, exclude=None, timeout=LEADER_TIMEOUT_S):
        """Waits until the serving members (but `exclude`, an index or a list of them) agree on
        a leader that is not in exclude, and returns its index."""
        excluded = set() if exclude is None else (
            {exclude} if isinstance(exclude, int) else set(exclude))
        deadline = time.monotonic() + timeout
        for _ in range(int(timeout / POLL_S) + 10):  # Bounded: each round polls or times out.
            leader = self._leader_once(excluded)
            if leader is not None:
                return leader
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        raise EtcdError("serving members %s agreed on no leader outside %s within %.0f s\n%s"
                        % ([m.index for m in self.members if m.serving()], sorted(excluded),
                           timeout, self.logs()))

    def kill(self, i, sig=signal.SIGKILL, wait=True, timeout=DEATH_TIMEOUT_S):
        """Sends sig to member i and, with wait (for a signal that ends it), waits until it has
        exited and returns its Popen returncode (-sig). wait=False: e.g. SIGSTOP, after which
        the member counts as not serving (etcdctl, leader, live_endpoint_list skip it) until a
        SIGCONT."""
        m = self.members[i]
        if not m.running():
            raise EtcdError("etcd %s is not running" % m.name)
        m.proc.send_signal(sig)  # Our unreaped child: the pid is still its.
        if sig == signal.SIGSTOP:
            m.stopped = True
        elif sig == signal.SIGCONT:
            m.stopped = False
        return self._reap(m, timeout) if wait else None

    def restart(self, i, timeout=HEALTHY_TIMEOUT_S):
        """Starts killed member i again on its data dir and ports, and waits until it is
        healthy (which needs a quorum of running members)."""
        if self.members[i].running():
            raise EtcdError("etcd %s is still running" % self.members[i].name)
        self.members[i].stopped = False
        self._spawn(i)
        self._wait_healthy(timeout, members=[i])

    # -- stopping -------------------------------------------------------------------------------

    def _reap(self, m, timeout):
        alive = wait_dead([m.proc.pid], timeout)
        if alive:
            raise EtcdError("etcd %s (pid %d) still runs %.0f s after the signal"
                            % (m.name, m.proc.pid, timeout))
        rc = m.proc.wait(timeout=DEATH_TIMEOUT_S)
        RUNNING.pop(m.proc.pid, None)
        return rc

    def _metrics(self, i, timeout=1.0):
        """Member i's /metrics (Prometheus text), or None when it does not answer (or runs in
        a test host, out of this process's reach)."""
        if self.lab is not None:
            return None
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.client_cert or self.tls.cert,
                                    self.tls.client_key or self.tls.key)
        try:
            with urllib.request.urlopen(self.client_url(i) + "/metrics", timeout=timeout,
                                        context=context) as reply:
                return reply.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return None

    def _active_peers(self, i):
        """How many peers member i's raft transport counts as connected (the
        etcd_network_active_peers gauge of its /metrics), or None when it does not answer."""
        body = self._metrics(i)
        return None if body is None else _series_sum(body, "etcd_network_active_peers", {})

    def _stop_all(self):
        """SIGTERM to every running member, SIGKILL to those still running after
        STOP_TIMEOUT_S, and reaps them all.

        The leader goes last, once it has seen every peer go: on SIGTERM an etcd 3.4 leader first
        hands leadership to the follower it counts as connected and waits up to 7 s (5 s + 2
        election timeouts) for that to happen, which never does when that follower stops too.
        With no peer counted as connected it skips the transfer and exits at once; a peer
        counts until a redial fails (about 0.1 s after it exits), hence the wait on /metrics."""
        running = [m for m in self.members if m.proc is not None and m.proc.poll() is None]
        leader = self._leader_once() if len(running) > 1 and running[0].id else None
        for m in running:
            m.stopped = False  # SIGCONT follows every SIGTERM below.
        followers = [m for m in running if m.index != leader]
        self._terminate([m.proc for m in followers])
        if leader is not None:
            deadline = time.monotonic() + 2.0
            for _ in range(30):  # Bounded: polls for 2 s at most, then stops it regardless.
                if self._active_peers(leader) in (0, None) or time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S)
            self._terminate([self.members[leader].proc])
        for m in self.members:  # Killed ones were reaped by kill(); forget them all.
            if m.proc is not None:
                RUNNING.pop(m.proc.pid, None)

    def _terminate(self, procs):
        for proc in procs:
            proc.terminate()
            proc.send_signal(signal.SIGCONT)  # A member a test SIGSTOPped.
        stubborn = wait_dead([p.pid for p in procs], STOP_TIMEOUT_S)
        for proc in procs:
            if proc.pid in stubborn:
                proc.kill()
        for proc in procs:
            try:
                proc.wait(timeout=DEATH_TIMEOUT_S)
            finally:
                RUNNING.pop(proc.pid, None)

    def _remove_data(self):
        # WAL segments are preallocated (64 MB each): drop them, keep the logs.
        for m in self.members:
            shutil.rmtree(m.data_dir, ignore_errors=True)

    def close(self):
        """Stops every member (SIGTERM, then SIGKILL after a bound) and waits for them; removes
        the data dirs (kept with ELRUN_KEEP_TMP), never the logs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_all()
        finally:
            if os.environ.get("ELRUN_KEEP_TMP") is None:
                self._remove_data()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- diagnostics ----------------------------------------------------------------------------

    def logs(self, limit=6000):
        """The tail of every member's log, with a header each, for failure messages."""
        return "\n".join("--- etcd %s (%s, %s) log %s ---\n%s"
                         % (m.name, m.endpoint,
                            "running" if m.running() else
                            "not started" if m.proc is None else "exit %s" % m.proc.returncode,
                            m.log_path, m.log_tail(limit))
                         for m in self.members)


def _b64(data):
    return base64.b64decode(data).decode("utf-8", "backslashreplace")


def _text(data):
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


# ---------------------------------------------------------------------------------------------
# Self-test.

def _self_test():
    def check(cluster, label):
        cluster.put("/selftest/" + label, "v1")
        assert cluster.get("/selftest/" + label) == "v1", cluster.logs()
        assert cluster.get("/selftest/missing") is None
        assert cluster.keys("/selftest/") == ["/selftest/" + label], cluster.keys("/selftest/")
        assert cluster.keys("") == ["/selftest/" + label], cluster.keys("")
        assert len(cluster.endpoint_list) == 3 and cluster.endpoints.count(",") == 2
        old = cluster.leader()
        cluster.kill(old)
        new = cluster.wait_for_leader(exclude=old)
        assert new != old and len(cluster.live_endpoint_list) == 2
        cluster.put("/selftest/" + label + "/after", "v2")
        assert cluster.get("/selftest/" + label + "/after") == "v2"
        assert cluster.keys("/selftest/" + label) == ["/selftest/" + label,
                                                       "/selftest/" + label + "/after"]
        print("%s: %s leader %d killed, new leader %d (%.2f s)"
              % (label, cluster.endpoints, old, new, time.monotonic() - start))

    base = tempfile.mkdtemp(prefix="etcd_cluster_selftest.")
    start = time.monotonic()
    try:
        with EtcdCluster(base, members=3) as cluster:
            check(cluster, "plain")
            cluster.restart([m.index for m in cluster.members if not m.running()][0])
            assert len(cluster.live_endpoint_list) == 3
        with EtcdCluster(base, members=3, auth=("root", "pw")) as cluster:
            check(cluster, "auth")
            out = cluster.etcdctl_result("get", "x", auth=False)
            assert out.returncode != 0 and "user name is empty" in out.stderr, out
        tls = make_tls_files(base, client_cert_auth=True)
        with EtcdCluster(base, members=3, tls=tls) as cluster:
            assert cluster.host == tls.ip
            check(cluster, "tls")
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()
                and is_running(int(p)) and "etcd" in cmdline(int(p))
                and base in cmdline(int(p))]
        assert not pids, "etcd members left running: %s" % describe(pids)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("etcd_cluster self-test ok (%.2f s)" % (time.monotonic() - start))


if __name__ == "__main__":
    _self_test()
