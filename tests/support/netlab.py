"""Test hosts with real links: network namespaces on one bridge, and faults made by the kernel.

A NetLab makes one namespace per test host (`<prefix>-h<N>`, address 10.200.0.<N>/24 on its
eth0) and a switch namespace (`<prefix>-sw`) that holds the bridge and the hosts' peer ends, so
nothing of the lab touches the machine's own network namespace, and no packet of a test can
reach another address. Processes run in a host with `lab.command(host, argv)` (`ip netns exec`,
which execs in place: the pid is the program's own).

Faults (heal(host) undoes those on that host: its link, the drops it applies, its loss;
heal_all() every one):
- cut(host): the host's link goes down at the switch (both directions, for everyone);
- drop(src, dst): packets from src to dst dropped by nftables in dst (one way; partition() makes
  both ways between two sides);
- lose(host, percent): each TCP packet the host sends lost with that probability.
Delay is not among them: this machine's kernel has no sch_netem (CONFIG_NET_SCH_NETEM unset, no
loadable modules); delay_relay.py delays a TCP connection's bytes instead.

close() kills every process still in the lab's namespaces and deletes them; it runs even after a
failed test (the tests register it as a cleanup), and sweep_stale() removes labs whose test
process died without closing them. Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root); unavailable()
says why not, for a skip.
"""
import os
import re
import signal
import subprocess

SUBNET = "10.200.0"
PREFIX = "elrunlab"
_NAME = re.compile(r"^%s(\d+)-(sw|h\d+)$" % PREFIX)


def _ip(*args, check=True):
    result = subprocess.run(["ip"] + list(args), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=20)
    if check and result.returncode != 0:
        raise RuntimeError("ip %s: %s" % (" ".join(args), result.stderr.strip()))
    return result


def unavailable():
    """Why namespaces can not be made here (for a skip), or None when they can."""
    probe = "%s%d-probe" % (PREFIX, os.getpid())
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return "cannot run ip: %s" % e
    if made.returncode != 0:
        return "cannot make a network namespace (ip netns add: %s)" % made.stderr.strip()
    try:
        nft = _ip("netns", "exec", probe, "nft", "add table inet probe", check=False)
        if nft.returncode != 0:
            return "nftables does not run in a namespace (scripts/setup.sh installs nft): %s" % nft.stderr.strip()
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _pids_in(ns):
    result = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def _delete(ns):
    # Bounded: processes that keep appearing (a forking worker) are killed again, 20 times at most.
    for _ in range(20):
        pids = _pids_in(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _ip("netns", "del", ns, check=False)


def sweep_stale():
    """Deletes the namespaces of labs whose test process is gone (a crashed run's leftovers)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        m = _NAME.match(name)
        if m and not os.path.exists("/proc/%s" % m.group(1)):
            _delete(name)


class NetLab:
    """`hosts` test hosts 1..hosts on one switch; see the module's docstring."""

    def __init__(self, hosts):
        sweep_stale()
        self.tag = "%s%d" % (PREFIX, os.getpid())
        self.switch = "%s-sw" % self.tag
        self.hosts = list(range(1, hosts + 1))
        self._made = []
        try:
            self._make()
        except Exception:
            self.close()
            raise

    def ns(self, host):
        return "%s-h%d" % (self.tag, host)

    def addr(self, host):
        return "%s.%d" % (SUBNET, host)

    def _port(self, host):
        return "p%d" % host  # The switch's end of the host's link.

    def _make(self):
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ["-n", self.switch]
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        _ip(*sw, "link", "set", "lo", "up")
        for host in self.hosts:
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip(*sw, "link", "add", self._port(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip(*sw, "link", "set", self._port(host), "master", "br0")
            _ip(*sw, "link", "set", self._port(host), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", "%s/24" % self.addr(host), "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self._nft(host, "add table inet lab")
            self._nft(host, "add chain inet lab input { type filter hook input priority 0; }")
            self._nft(host, "add chain inet lab output { type filter hook output priority 0; }")

    def _nft(self, host, rule):
        _ip("netns", "exec", self.ns(host), "nft", rule)

    def command(self, host, argv):
        """argv run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns(host)] + list(argv)

    # -- faults ---------------------------------------------------------------------------------

    def cut(self, host):
        """The host's link down at the switch: it reaches no one and no one reaches it."""
        _ip("-n", self.switch, "link", "set", self._port(host), "down")

    def drop(self, src, dst):
        """Packets from src to dst dropped (one way) until heal(dst)."""
        self._nft(dst, "add rule inet lab input ip saddr %s drop" % self.addr(src))

    def partition(self, side_a, side_b):
        """No packet between a host of side_a and one of side_b, either way."""
        for a in side_a:
            for b in side_b:
                self.drop(a, b)
                self.drop(b, a)

    def lose(self, host, percent):
        """Each TCP packet `host` sends lost with this probability (percent), independently."""
        self._nft(host, "add rule inet lab output meta l4proto tcp numgen random mod 100 < %d drop" % percent)

    def heal(self, host):
        """Undoes every fault on `host`: its link up, no drop or loss rule."""
        _ip("-n", self.switch, "link", "set", self._port(host), "up")
        self._nft(host, "flush table inet lab")
        self._nft(host, "add chain inet lab input { type filter hook input priority 0; }")
        self._nft(host, "add chain inet lab output { type filter hook output priority 0; }")

    def heal_all(self):
        for host in self.hosts:
            self.heal(host)

    def close(self):
        """Kills what still runs in the lab and deletes its namespaces."""
        for ns in reversed(self._made):
            _delete(ns)
        self._made = []
