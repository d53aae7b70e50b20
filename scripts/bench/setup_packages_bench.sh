#!/usr/bin/env bash
# How many Debian packages scripts/setup.sh installs on a fresh minimal Debian 12, how much it
# downloads and how long apt takes, before the split into modes (PACKAGES of setup.sh at
# $BEFORE_REV) and after it (RUN_PACKAGES, and RUN_PACKAGES + TEST_PACKAGES, of the working
# tree's setup.sh), and whether installing leaves daemons (munged, slurmd, slurmctld, etcd)
# running. torch (pip) is not measured.
#
# Usage (root, on Debian; installs debootstrap if missing): scripts/bench/setup_packages_bench.sh
# Writes docs/results/setup_packages.json and docs/results/setup_packages.md; logs stay in
# $WORK (default /var/tmp/setup_packages_bench, replaced on each run).
#
# How: debootstrap --variant=minbase bookworm into $SRV/bookworm, sources as on the host
# (bookworm, bookworm-updates, bookworm-security), one `apt-get update` there (not timed, so
# every case resolves against the same index), `apt-get clean`. Then, per case, a fresh
# `cp -a` copy of that tree, and everything in the copy runs inside `unshare --mount --pid
# --fork`: /proc, /sys and /dev/pts are mounted in a private mount namespace (gone with it, and
# unmounted explicitly as well), and any daemon a package starts is in the namespace's PID
# space, killed explicitly and in any case by the kernel when the namespace ends. Cases:
#   before     old PACKAGES, no /usr/sbin/policy-rc.d (the old setup.sh made none)
#   run        RUN_PACKAGES, policy-rc.d "exit 101" around apt (as the new setup.sh does)
#   run_split  RUN_PACKAGES again, `--download-only` first, then the install timed on its own
#   test       RUN_PACKAGES + TEST_PACKAGES, policy-rc.d "exit 101" around apt
# Each timed install is `DEBIAN_FRONTEND=noninteractive apt-get install -y -q <list>` with an
# empty /var/cache/apt/archives (cold: the time includes the download from the mirror).
# REPEATS=N (default 1) runs the cases N times, round-robin, each time in a fresh copy; the
# report gives every sample and the median. Counts and sizes come from the first round (and are
# checked to be the same in every round).
# Every chroot copy (and the base tree, unless KEEP_BASE=1) is removed at the end, after
# checking that nothing is mounted below it. Safe to rerun.
# shellcheck disable=SC2016  # dpkg-query formats are single-quoted on purpose
set -euo pipefail

SELF=$(readlink -f "$0")
REPO=${REPO:-$(cd "$(dirname "$SELF")/../.." && pwd)}
BEFORE_REV=${BEFORE_REV:-b30106f}
SRV=${SRV:-/srv}
BASE=$SRV/bookworm
WORK=${WORK:-/var/tmp/setup_packages_bench}
OUT_JSON=${OUT_JSON:-$REPO/docs/results/setup_packages.json}
OUT_MD=${OUT_MD:-$REPO/docs/results/setup_packages.md}
MIRROR=http://deb.debian.org/debian
SECURITY_MIRROR=http://deb.debian.org/debian-security
CASES=${CASES:-before run run_split test}
REPEATS=${REPEATS:-1}
DAEMON_RE='^(munged|slurmd|slurmctld|etcd)$'
CHROOT_ENV=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  HOME=/root TERM=dumb LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive)

# Mount points at or below $1 (deepest first).
mounts_under() {
  awk -v d="$1" '$2 == d || index($2, d "/") == 1 {print $2}' /proc/mounts | sort -r
}

# Removes a chroot tree: unmounts whatever is still mounted below it first, and refuses to
# delete while anything is.
safe_remove() {
  local dir=$1 m
  [ -e "$dir" ] || return 0
  for m in $(mounts_under "$dir"); do umount "$m" || umount -l "$m" || true; done
  if [ -n "$(mounts_under "$dir")" ]; then
    echo "bench: still mounted below $dir, not removing it:" >&2
    mounts_under "$dir" >&2
    return 1
  fi
  rm -rf --one-file-system "$dir"
}

# Processes of the host whose root directory is one of our chroots: "pid comm root".
chroot_processes() {
  local p r
  for p in /proc/[0-9]*; do
    r=$(readlink "$p/root" 2>/dev/null) || continue
    case "$r" in
      "$BASE" | "$BASE"/* | "$BASE"-*) echo "${p#/proc/} $(cat "$p/comm" 2>/dev/null) $r" ;;
    esac
  done
}

cleanup() {
  local c
  for c in before run run_split test; do safe_remove "$BASE-$c" || true; done
  if [ "${KEEP_BASE:-0}" != 1 ]; then safe_remove "$BASE" || true; fi
}

# The words of bash array NAME in a setup.sh read on stdin, comments stripped.
extract_array() {
  awk -v name="$1" '
    !on && index($0, name "=(") == 1 { on = 1; $0 = substr($0, length(name) + 3) }
    on {
      sub(/#.*/, "")
      if (index($0, ")")) { print substr($0, 1, index($0, ")") - 1); exit }
      print
    }' | tr -s ' \t' '\n' | sed '/^$/d'
}

lists() {
  mkdir -p "$WORK/lists"
  git -C "$REPO" show "$BEFORE_REV:scripts/setup.sh" | extract_array PACKAGES >"$WORK/lists/before"
  extract_array RUN_PACKAGES <"$REPO/scripts/setup.sh" >"$WORK/lists/run"
  extract_array TEST_PACKAGES <"$REPO/scripts/setup.sh" >"$WORK/lists/test_only"
  cp "$WORK/lists/run" "$WORK/lists/run_split"
  cat "$WORK/lists/run" "$WORK/lists/test_only" >"$WORK/lists/test"
  local l
  for l in before run test_only; do
    if [ ! -s "$WORK/lists/$l" ] || grep -qvE '^[a-z0-9][a-z0-9+.-]+$' "$WORK/lists/$l"; then
      echo "bench: bad package list $l:" >&2
      cat "$WORK/lists/$l" >&2
      exit 1
    fi
  done
  git -C "$REPO" rev-parse "$BEFORE_REV" >"$WORK/lists/before_rev"
  git -C "$REPO" rev-parse HEAD >"$WORK/lists/head_rev"
  (git -C "$REPO" diff --quiet HEAD -- scripts/setup.sh && echo clean || echo modified) \
    >"$WORK/lists/setup_sh_state"
}

base() {
  if [ -f "$BASE/.bench-base-ready" ]; then
    echo "bench: reusing $BASE (KEEP_BASE=1 last time)" >&2
    cp "$BASE"/.bench-meta/* "$WORK/"
    return
  fi
  safe_remove "$BASE"
  mkdir -p "$SRV"
  # The one tool this benchmark needs beyond scripts/setup.sh's.
  if ! command -v debootstrap >/dev/null; then
    apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >&2
  fi
  debootstrap --version >"$WORK/debootstrap_version"
  debootstrap --variant=minbase bookworm "$BASE" "$MIRROR" >"$WORK/debootstrap.log" 2>&1
  # debootstrap leaves no policy-rc.d behind, or does it: recorded, and removed if it does.
  if [ -e "$BASE/usr/sbin/policy-rc.d" ]; then
    { echo present; cat "$BASE/usr/sbin/policy-rc.d"; } >"$WORK/base_policy_rc_d"
    rm -f "$BASE/usr/sbin/policy-rc.d"
  else
    echo absent >"$WORK/base_policy_rc_d"
  fi
  # The host's sources (deb822), without its snapshot comments.
  rm -f "$BASE/etc/apt/sources.list"
  cat >"$BASE/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  [ -s "$BASE/etc/resolv.conf" ] || cp /etc/resolv.conf "$BASE/etc/resolv.conf"
  unshare --mount --pid --fork --propagation private -- "$SELF" __update "$BASE"
  chroot_processes >"$WORK/base_leftover_processes"
  mkdir -p "$BASE/.bench-meta"
  cp "$WORK"/debootstrap_version "$WORK"/base_* "$BASE/.bench-meta/"
  touch "$BASE/.bench-base-ready"
}

mount_chroot() {
  local root=$1
  mount -t proc proc "$root/proc"
  mount -t sysfs -o ro sysfs "$root/sys"
  mkdir -p "$root/dev/pts"
  mount --bind /dev/pts "$root/dev/pts"
}

umount_chroot() {
  local root=$1
  umount "$root/dev/pts" "$root/sys" "$root/proc"
}

# In the namespaces: apt-get update in the base tree.
inner_update() {
  local root=$1
  mount_chroot "$root"
  chroot "$root" "${CHROOT_ENV[@]}" apt-get update -q >"$WORK/base_update.log" 2>&1
  chroot "$root" "${CHROOT_ENV[@]}" apt-get clean
  chroot "$root" "${CHROOT_ENV[@]}" dpkg-query -W -f='${Package}\n' >"$WORK/base_packages"
  chroot "$root" "${CHROOT_ENV[@]}" apt-get --version | head -1 >"$WORK/base_apt_version"
  for f in "$root"/var/lib/apt/lists/*InRelease; do
    echo "$(basename "$f") $(sed -n 's/^Date: //p' "$f" | head -1)"
  done >"$WORK/base_release_dates"
  umount_chroot "$root"
}

cpu_busy() { awk '/^cpu / {print $2+$3+$4+$7+$8+$9, $5+$6}' /proc/stat; }
children_cpu() { awk '{print $16+$17}' "$1/proc/1/stat"; }  # ticks, pid 1 of our namespace

# Runs an apt command in the chroot, timed; $out/$name.{log,time}.
timed() {
  local root=$1 out=$2 name=$3
  shift 3
  local b0 c0 t0 t1 b1 c1 rc=0
  b0=$(cpu_busy) c0=$(children_cpu "$root") t0=$EPOCHREALTIME
  chroot "$root" "${CHROOT_ENV[@]}" "$@" >"$out/$name.log" 2>&1 || rc=$?
  t1=$EPOCHREALTIME b1=$(cpu_busy) c1=$(children_cpu "$root")
  echo "$t0 $t1 $rc $b0 $b1 $c0 $c1 $(getconf CLK_TCK) $(nproc) $(cut -d' ' -f1-3 /proc/loadavg)" \
    >"$out/$name.time"
  return $rc
}

# In the namespaces: one case in the chroot copy $root.
inner_case() {
  local case=$1 root=$2 out=$3
  local -a pkgs
  mapfile -t pkgs <"$WORK/lists/$case"
  mount_chroot "$root"
  local in=(chroot "$root" "${CHROOT_ENV[@]}")
  "${in[@]}" dpkg-query -W -f='${Package}\n' >"$out/pre_packages"
  # The resolver's trace says which package pulled each one in (and as Depends or Recommends).
  "${in[@]}" apt-get install -s -o Debug::pkgDepCache::AutoInstall=1 "${pkgs[@]}" \
    >"$out/simulate.log" 2>&1
  "${in[@]}" apt-get install -s --no-install-recommends "${pkgs[@]}" >"$out/simulate_norec.log" 2>&1
  "${in[@]}" apt-get install --assume-no "${pkgs[@]}" >"$out/assume_no.log" 2>&1 || true
  "${in[@]}" apt-get install -qq --print-uris "${pkgs[@]}" >"$out/uris" 2>&1
  [ -e "$root/usr/sbin/policy-rc.d" ] && echo present >"$out/policy_before" || echo absent >"$out/policy_before"
  if [ "$case" != before ]; then
    # What the new scripts/setup.sh does around apt.
    printf '#!/bin/sh\n# scripts/setup.sh: no service starts while elrun installs packages.\nexit 101\n' \
      >"$root/usr/sbin/policy-rc.d"
    chmod 755 "$root/usr/sbin/policy-rc.d"
    echo "exit 101 during apt" >"$out/policy"
  else
    echo none >"$out/policy"
  fi
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/archives/partial/*
  if [ "$case" = run_split ]; then
    timed "$root" "$out" download apt-get install -y -q --download-only "${pkgs[@]}"
  fi
  timed "$root" "$out" install apt-get install -y -q "${pkgs[@]}"
  rm -f "$root/usr/sbin/policy-rc.d"
  "${in[@]}" dpkg-query -W -f='${Package}\t${Version}\t${Installed-Size}\t${source:Package}\t${Section}\n' \
    >"$out/post_packages"
  # shellcheck disable=SC2012
  ls -l "$root"/var/cache/apt/archives/*.deb | awk '{print $5, $NF}' >"$out/debs"
  sleep 5  # let a daemon that forked on install settle (or die)
  local p self=$BASHPID
  : >"$out/processes"
  for p in "$root"/proc/[0-9]*; do
    p=${p##*/}
    [ "$p" = 1 ] || [ "$p" = "$self" ] && continue
    local comm args
    comm=$(cat "$root/proc/$p/comm" 2>/dev/null) || continue
    args=$(tr '\0' ' ' <"$root/proc/$p/cmdline" 2>/dev/null) || true
    printf '%s\t%s\t%s\n' "$p" "$comm" "$args" >>"$out/processes"
  done
  if [ -x "$root/bin/ps" ]; then "${in[@]}" ps -eo pid,ppid,user,comm,args >"$out/ps.txt" 2>&1 || true; fi
  # Kill every process the install left (daemons): TERM, then KILL.
  local pids
  pids=$(cut -f1 "$out/processes" | tr '\n' ' ')
  if [ -n "${pids// /}" ]; then
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    sleep 3
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 1
  fi
  local left=""
  for p in $pids; do [ -d "$root/proc/$p" ] && left+="$p "; done
  echo "${left:-none}" >"$out/left_after_kill"
  umount_chroot "$root"
}

run_case() {
  local case=$1 round=$2 root=$BASE-$1 out=$WORK/$1/$2
  echo "bench: round $round, $case ($(wc -l <"$WORK/lists/$case") packages asked for)" >&2
  safe_remove "$root"
  rm -rf "$out"
  mkdir -p "$out"
  cp -a "$BASE" "$root"
  rm -rf "$root/.bench-base-ready" "$root/.bench-meta"
  unshare --mount --pid --fork --propagation private -- "$SELF" __case "$case" "$root" "$out"
  chroot_processes >"$out/host_leftover_processes"
  mounts_under "$root" >"$out/host_leftover_mounts"
  # Belt and braces: no process may live on in the copy.
  local pid
  while read -r pid _; do kill -KILL "$pid" 2>/dev/null || true; done <"$out/host_leftover_processes"
  sed -n 's/.* \([0-9]* newly installed\).*/\1/p' "$out/install.log" >&2
  safe_remove "$root"
}

report() {
  WORK=$WORK OUT_JSON=$OUT_JSON OUT_MD=$OUT_MD BEFORE_REV=$BEFORE_REV DAEMON_RE=$DAEMON_RE \
    /usr/bin/python3 - <<'PY'
import datetime, json, os, re, statistics
W = os.environ["WORK"]
daemon_re = re.compile(os.environ["DAEMON_RE"])

def rd(*p):
    try:
        with open(os.path.join(W, *p)) as f:
            return f.read()
    except FileNotFoundError:
        return ""

before_rev = rd("lists", "before_rev").strip()

def mb(s):  # apt's sizes ("1,234 MB", "567 kB", "2.1 GB") in MB (apt's are decimal)
    m = re.match(r"([\d.]+)\s*(B|kB|MB|GB)", s.replace(",", ""))
    return round(float(m.group(1)) * {"B": 1e-6, "kB": 1e-3, "MB": 1, "GB": 1e3}[m.group(2)], 1)

def timing(d, name):
    t = rd(d, name + ".time").split()
    if not t:
        return None
    t0, t1, rc = float(t[0]), float(t[1]), int(t[2])
    busy0, _, busy1, _ = map(float, t[3:7])
    c0, c1, hz, ncpu = float(t[7]), float(t[8]), float(t[9]), int(t[10])
    wall, ours = t1 - t0, (c1 - c0) / hz
    return {"wall_s": round(wall, 1), "rc": rc, "apt_cpu_s": round(ours, 1),
            "other_cpu_share": round(max(0.0, (busy1 - busy0) / hz - ours) / (wall * ncpu), 2),
            "loadavg_after": " ".join(t[11:14])}

def category(pkg, section):
    if pkg.startswith("golang-"):
        return "golang-*"
    if re.match(r"(clang|llvm|lld|libclang|libllvm)", pkg):
        return "llvm/clang"
    if pkg.startswith(("openjdk", "bazel")) or section.endswith("java") or pkg.endswith("-java"):
        return "java/bazel"
    if re.match(r"(slurm|libslurm|munge|libmunge|etcd|freeipmi|libipmi|librocm|libhdf5|librrd|libfreeipmi)", pkg):
        return "slurm/munge/etcd"
    if pkg.startswith("fonts-") or section.endswith("fonts"):
        return "fonts"
    if pkg.startswith("python3") or section.endswith("python"):
        return "python3"
    if re.match(r"(libx|libgtk|libwayland|libgl|libegl|mesa|libdrm|libgdk|libpango|libcairo|libatk|libatspi|at-spi|gir1|dconf|adwaita|libcups|cups|avahi|libavahi|dbus|libdbus|systemd|libsystemd|libpam-systemd|udev|libudev|polkit|libpolkit|upower|packagekit|libpackagekit|system-config|chromium)", pkg):
        return "desktop (X11/GTK/dbus/systemd/cups)"
    if pkg.startswith(("perl", "libperl")) or section.endswith("perl"):
        return "perl"
    if pkg.endswith("-dev"):
        return "other -dev"
    if pkg.startswith("lib"):
        return "other lib*"
    return "other"

def resolver(log, asked):
    """parent[pkg] = (package that pulled it in, 'Depends'|'Recommends'|...) from apt's trace."""
    parent = {}
    for line in log.splitlines():
        m = re.match(r"\s*Installing (\S+?)(?::\w+)? as (\S+) of (\S+?)(?::\w+)?$", line)
        if m and m.group(1) not in parent:
            parent[m.group(1)] = (m.group(3), m.group(2))
    def chain(p):
        c, seen = [p], {p}
        while c[-1] in parent and parent[c[-1]][0] not in seen:
            c.append(parent[c[-1]][0])
            seen.add(c[-1])
        return c
    def via_recommends(p):
        c = chain(p)
        return any(parent[x][1] == "Recommends" for x in c if x in parent)
    return parent, chain, via_recommends

SERVICE_MSG = re.compile(r"invoke-rc\.d|policy-rc\.d|Running in chroot|start-stop-daemon|runlevel|not started")

def analyse(case, d, asked):
    sim, inst, an = rd(d, "simulate.log"), rd(d, "install.log"), rd(d, "assume_no.log")
    m = re.search(r"(\d+) upgraded, (\d+) newly installed", inst)
    pre = set(rd(d, "pre_packages").split())
    post = {}
    for line in rd(d, "post_packages").splitlines():
        pkg, ver, isz, src, sec = (line.split("\t") + [""] * 5)[:5]
        post[pkg] = (ver, int(isz or 0), src, sec)
    new = sorted(set(post) - pre)
    debs = {}
    for line in rd(d, "debs").splitlines():
        size, path = line.split(None, 1)
        debs[os.path.basename(path).split("_")[0]] = int(size)
    uri_bytes = sum(int(l.split()[2]) for l in rd(d, "uris").splitlines() if l.startswith("'"))
    need = re.search(r"Need to get ([\d.,]+ [kMG]?B)", an)
    after = re.search(r"After this operation, ([\d.,]+ [kMG]?B) of additional", an)
    procs = [l.split("\t") for l in rd(d, "processes").splitlines() if l.strip()]
    parent, chain, via_rec = resolver(sim, asked)
    roots = {}
    for p in new:
        r = chain(p)[-1]
        r = r if r in asked else "(other)"
        roots[r] = roots.get(r, 0) + 1
    cats = {}
    for p in new:
        e = cats.setdefault(category(p, post[p][3]), {"packages": 0, "installed_MB": 0.0, "download_MB": 0.0})
        e["packages"] += 1
        e["installed_MB"] += post[p][1] / 1024
        e["download_MB"] += debs.get(p, 0) / 1e6
    for e in cats.values():
        e["installed_MB"], e["download_MB"] = round(e["installed_MB"], 1), round(e["download_MB"], 1)
    service = []
    setting = None
    for line in inst.splitlines():
        if line.startswith("Setting up "):
            setting = line.split()[2]
        elif SERVICE_MSG.search(line) and not line.startswith(("Get:", "Unpacking", "Preparing", "Selecting")):
            service.append({"package": setting, "message": line.strip()})
    notable = ["systemd-sysv", "dbus", "avahi-daemon", "polkitd", "cups-pk-helper", "udev", "libllvm15",
               "golang-go", "golang-github-aws-aws-sdk-go-dev", "openjdk-17-jre-headless", "libboost1.74-dev"]
    why = {p: " <- ".join("%s (%s)" % (x, parent[x][1]) if x in parent else x for x in chain(p))
           for p in notable if p in new}
    heavy = sorted(new, key=lambda p: -post[p][1])[:12]
    return {
        "packages_asked_for": len(asked),
        "newly_installed_simulated": int(re.search(r"(\d+) newly installed", sim).group(1)),
        "newly_installed_real": int(m.group(2)) if m else None,
        "newly_installed_dpkg_diff": len(new),
        "upgraded_base_packages": int(m.group(1)) if m else None,
        "newly_installed_without_recommends_simulated":
            int(re.search(r"(\d+) newly installed", rd(d, "simulate_norec.log")).group(1)),
        "newly_installed_via_a_recommends": sum(1 for p in new if via_rec(p)),
        "download_MB": mb(need.group(1)) if need else None,
        "download_MB_print_uris": round(uri_bytes / 1e6, 1),
        "installed_MB": mb(after.group(1)) if after else None,
        "installed_MB_dpkg_sum": round(sum(post[p][1] for p in new) / 1024, 1),
        "policy_rc_d": rd(d, "policy").strip(),
        "policy_rc_d_present_before_install": rd(d, "policy_before").strip(),
        "daemons_running_after_install": sorted({p[1] for p in procs if daemon_re.match(p[1])}),
        "processes_left_by_install": [{"comm": p[1], "args": p[2].strip()} for p in procs],
        "processes_left_after_kill": rd(d, "left_after_kill").strip(),
        "processes_in_chroot_seen_from_host_afterwards": [l for l in rd(d, "host_leftover_processes").splitlines() if l],
        "mounts_left_afterwards": rd(d, "host_leftover_mounts").split(),
        "service_start_messages": service,
        "new_packages_by_asked_package": dict(sorted(roots.items(), key=lambda kv: -kv[1])),
        "by_category": dict(sorted(cats.items(), key=lambda kv: -kv[1]["packages"])),
        "heaviest_installed": [{"package": p, "installed_MB": round(post[p][1] / 1024, 1),
                                "download_MB": round(debs.get(p, 0) / 1e6, 1)} for p in heavy],
        "why_installed": why,
        "newly_installed": new,
    }

names = {
    "before": "PACKAGES @ %s:scripts/setup.sh (one mode)" % before_rev[:7],
    "run": "RUN_PACKAGES @ working tree scripts/setup.sh (setup.sh run)",
    "test": "RUN_PACKAGES + TEST_PACKAGES @ working tree scripts/setup.sh (setup.sh test, the default)",
}

def rounds(case):
    d = os.path.join(W, case)
    return sorted((x for x in os.listdir(d) if x.isdigit()), key=int) if os.path.isdir(d) else []

def summary(samples):
    walls = [s["wall_s"] for s in samples]
    return {"median_s": round(statistics.median(walls), 1), "samples_s": walls,
            "other_cpu_share": [s["other_cpu_share"] for s in samples], "runs": samples}

cases = {}
for case in ["before", "run", "test"]:
    rs = rounds(case)
    if not rs:
        continue
    asked = rd("lists", case).split()
    r = {"list": names[case]}
    r.update(analyse(case, os.path.join(case, rs[0]), asked))
    r["asked"] = asked
    counts = [analyse(case, os.path.join(case, x), asked)["newly_installed_real"] for x in rs]
    r["newly_installed_real_every_round"] = counts
    r["daemons_running_after_install_every_round"] = [
        analyse(case, os.path.join(case, x), asked)["daemons_running_after_install"] for x in rs]
    cold = summary([timing(os.path.join(case, x), "install") for x in rs])
    r["cold_install_wall_s"] = cold["median_s"]
    r["cold_install"] = cold
    cases[case] = r
if "run" in cases and rounds("run_split"):
    rs = rounds("run_split")
    dl = summary([timing(os.path.join("run_split", x), "download") for x in rs])
    io = summary([timing(os.path.join("run_split", x), "install") for x in rs])
    cases["run"]["download_only_wall_s"] = dl["median_s"]
    cases["run"]["install_only_wall_s"] = io["median_s"]
    cases["run"]["split"] = {
        "how": "a fresh copy: apt-get install -y -q --download-only <list>, then apt-get install -y -q <list>",
        "download_only": dl, "install_only": io,
        "newly_installed_real_every_round": [
            analyse("run", os.path.join("run_split", x), cases["run"]["asked"])["newly_installed_real"] for x in rs],
        "daemons_running_after_install_every_round": [
            analyse("run", os.path.join("run_split", x), cases["run"]["asked"])["daemons_running_after_install"] for x in rs]}

stamps = []
for case in ["before", "run", "run_split", "test"]:
    for x in rounds(case):
        for n in ("download", "install"):
            t = rd(case, x, n + ".time").split()
            if t:
                stamps += [float(t[0]), float(t[1])]
def iso(t):
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")
base_policy = rd("base_policy_rc_d").strip().splitlines()
result = {
    "bench": "setup_packages",
    "date": iso(min(stamps)) if stamps else None,
    "measured_until": iso(max(stamps)) if stamps else None,
    "commit": rd("lists", "head_rev").strip(),
    "setup_sh_in_working_tree": rd("lists", "setup_sh_state").strip(),
    "before_commit": before_rev,
    "rounds": len(rounds("before") or rounds("run") or rounds("test")),
    "machine": {"cpus": os.cpu_count(),
                "note": "shared with other work while measuring: other_cpu_share is the share of all CPUs "
                        "that processes other than apt and its children used during a timed install"},
    "debian_base": {
        "tool": rd("debootstrap_version").strip(),
        "variant": "minbase", "suite": "bookworm", "arch": os.uname().machine,
        "mirror": "http://deb.debian.org/debian (bookworm, bookworm-updates), "
                  "http://deb.debian.org/debian-security (bookworm-security)",
        "snapshot": None,
        "index_dates": rd("base_release_dates").strip().splitlines(),
        "apt": rd("base_apt_version").strip(),
        "base_packages": len(rd("base_packages").split()),
        "policy_rc_d_after_debootstrap": base_policy[0] if base_policy else None,
        "recommends": "installed (apt's default, as scripts/setup.sh does)",
        "updates": "none applied to the base: the lists' dependencies upgrade a few base packages "
                   "(upgraded_base_packages)",
    },
    "method": "per case and round a fresh cp -a of the debootstrapped tree; apt-get update once in "
              "the base (not timed); each timed install cold (empty /var/cache/apt/archives); every "
              "step in unshare --mount --pid --fork with /proc, /sys (ro), /dev/pts mounted in the "
              "chroot; scripts/bench/setup_packages_bench.sh",
    "cases": cases,
}
with open(os.environ["OUT_JSON"], "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")

def fmt(v):
    return "—" if v is None else str(v)

def times(x):
    return fmt(x["median_s"]) if len(x["samples_s"]) == 1 else "%s (%s)" % (
        x["median_s"], ", ".join(map(str, x["samples_s"])))

label = {"before": "before (`%s`, one list)" % before_rev[:7], "run": "after, `setup.sh run`",
         "test": "after, `setup.sh test`"}
L = ["# Debian packages that scripts/setup.sh installs (fresh Debian 12 minbase)", ""]
L.append("Measured %s (UTC, start of the first timed install) on a %d-CPU machine shared with other work (%d round%s), by "
         "`scripts/bench/setup_packages_bench.sh`; all data in `setup_packages.json`. Base: "
         "`debootstrap --variant=minbase bookworm` (%s, %d packages; `/usr/sbin/policy-rc.d` "
         "after debootstrap: %s), live mirror deb.debian.org, no snapshot (index dates: %s). "
         "apt installs Recommends, as setup.sh. torch (pip) is not included."
         % (result["date"], os.cpu_count(), result["rounds"], "" if result["rounds"] == 1 else "s",
            result["debian_base"]["tool"], result["debian_base"]["base_packages"],
            result["debian_base"]["policy_rc_d_after_debootstrap"],
            "; ".join(l.replace("deb.debian.org_", "").replace("_InRelease", "").replace("_dists_", " ")
                      for l in result["debian_base"]["index_dates"])))
L.append("")
L.append("| | asked for | newly installed (simulated / real) | without Recommends | download MB | installed MB | cold install s | apt CPU s | download-only s | install-only s | other CPU load | daemons running after install |")
L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
for case, r in cases.items():
    sp = r.get("split")
    real = r["newly_installed_real_every_round"]
    L.append("| %s | %d | %d / %s | %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        label[case], r["packages_asked_for"], r["newly_installed_simulated"],
        str(real[0]) if len(set(real)) == 1 else ", ".join(map(str, real)),
        r["newly_installed_without_recommends_simulated"], fmt(r["download_MB"]), fmt(r["installed_MB"]),
        times(r["cold_install"]), ", ".join(str(x["apt_cpu_s"]) for x in r["cold_install"]["runs"]),
        times(sp["download_only"]) if sp else "—",
        times(sp["install_only"]) if sp else "—",
        "/".join("%d%%" % round(100 * x) for x in r["cold_install"]["other_cpu_share"]),
        ", ".join(sorted({d for x in r["daemons_running_after_install_every_round"] for d in x})) or "none"))
L.append("")
L.append("Times are medians (samples in brackets). `before` ran without a policy-rc.d, as the old "
         "setup.sh; `run` and `test` with `exit 101` in `/usr/sbin/policy-rc.d` during apt, removed "
         "afterwards, as the new one. Other CPU load: the share of the machine's CPUs that other "
         "processes used during the timed install (one per round); apt CPU s: the CPU time of apt and "
         "its children (dpkg, maintainer scripts), steadier than the wall time on a shared machine.")
L.append("")
L.append("New packages by the asked-for package that pulled them in (apt's resolver trace; a "
         "dependency shared by several counts for the first), top 8:")
L.append("")
for case, r in cases.items():
    L.append("- %s: %s" % (label[case], ", ".join(
        "%s %d" % kv for kv in list(r["new_packages_by_asked_package"].items())[:8])))
L.append("")
L.append("What the new packages are (count / installed MB):")
L.append("")
cats_all = {c for r in cases.values() for c in r["by_category"]}
L.append("| group | " + " | ".join(label[c] for c in cases) + " |")
L.append("|---|" + "---|" * len(cases))
for c in sorted(cats_all, key=lambda c: -max(r["by_category"].get(c, {}).get("packages", 0) for r in cases.values())):
    L.append("| %s | %s |" % (c, " | ".join(
        "%d / %.0f" % (r["by_category"][c]["packages"], r["by_category"][c]["installed_MB"])
        if c in r["by_category"] else "0" for r in cases.values())))
L.append("")
for case, r in cases.items():
    L.append("Heaviest new packages, %s: %s." % (label[case], ", ".join(
        "%s %.0f MB" % (h["package"], h["installed_MB"]) for h in r["heaviest_installed"][:8])))
    L.append("")
for case, r in cases.items():
    for p, c in r["why_installed"].items():
        if p in ("systemd-sysv", "golang-go", "libllvm15"):
            L.append("Why %s, %s: %s." % (p, label[case], c))
            L.append("")
for case, r in cases.items():
    msgs = {}
    for m in r["service_start_messages"]:
        msgs.setdefault(m["message"], []).append(m["package"])
    if msgs:
        L.append("Service-start messages in apt's output, %s: %s." % (label[case], "; ".join(
            "`%s` (%s)" % (k, ", ".join(sorted(set(filter(None, v))))) for k, v in msgs.items())))
        L.append("")
    if r["processes_left_by_install"]:
        L.append("Processes the install left running, %s (killed): %s." % (
            label[case], "; ".join("`%s`" % p["args"] for p in r["processes_left_by_install"])))
        L.append("")
L.append("What a chroot can and cannot show about services: it has no running init, so "
         "`/run/systemd/system` is absent and the units' `deb-systemd-invoke start` is skipped, and "
         "invoke-rc.d finds no runlevel (systemd's `runlevel` says \"Running in chroot, ignoring "
         "request.\" once chromium's Recommends have brought systemd-sysv in; without it, \"could not "
         "determine current runlevel\"), so it declines to start an init script with or without a "
         "policy-rc.d, which then only adds its \"denied\" line. On a booted systemd machine the same "
         "packages would start their services unless policy-rc.d says 101; this benchmark does not "
         "measure that case.")
L.append("")
L.append("Commands (each case in a fresh `cp -a` copy of the base, inside "
         "`unshare --mount --pid --fork`, with /proc, /sys and /dev/pts mounted in the chroot):")
L.append("")
L.append("```sh")
L.append("debootstrap --variant=minbase bookworm /srv/bookworm http://deb.debian.org/debian")
L.append("# /etc/apt/sources.list.d/debian.sources: bookworm bookworm-updates; bookworm-security")
L.append("chroot /srv/bookworm apt-get update -q; chroot /srv/bookworm apt-get clean  # not timed")
L.append("cp -a /srv/bookworm /srv/bookworm-$case; chroot /srv/bookworm-$case ...:")
L.append("apt-get install -s -o Debug::pkgDepCache::AutoInstall=1 $LIST   # N newly installed, why")
L.append("apt-get install -s --no-install-recommends $LIST")
L.append("apt-get install --assume-no $LIST                  # download and installed size")
L.append("printf '#!/bin/sh\\nexit 101\\n' >/usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d  # run, test only")
L.append("rm -rf /var/cache/apt/archives/*.deb               # cold")
L.append("time apt-get install -y -q --download-only $LIST   # run_split only")
L.append("time DEBIAN_FRONTEND=noninteractive apt-get install -y -q $LIST")
L.append("rm -f /usr/sbin/policy-rc.d; sleep 5; ls /proc      # processes left: listed, then killed")
L.append("```")
L.append("")
L.append("Rerun: `scripts/bench/setup_packages_bench.sh` as root (`REPEATS=N` for N rounds; it "
         "removes its chroots at the end, `KEEP_BASE=1` keeps /srv/bookworm for the next run).")
with open(os.environ["OUT_MD"], "w") as f:
    f.write("\n".join(L) + "\n")
print("\n".join(L))
PY
}

case "${1:-all}" in
  __update) inner_update "$2" ;;
  __case) inner_case "$2" "$3" "$4" ;;
  report) report ;;
  clean) cleanup ;;
  all)
    [ "$(id -u)" = 0 ] || { echo "bench: run as root" >&2; exit 1; }
    command -v debootstrap >/dev/null || { echo "bench: apt-get install debootstrap first" >&2; exit 1; }
    rm -rf "$WORK"
    mkdir -p "$WORK"
    trap cleanup EXIT
    lists
    base
    for r in $(seq "$REPEATS"); do
      for c in $CASES; do run_case "$c" "$r"; done
    done
    report
    ;;
  *) echo "usage: $0 [all|report|clean]" >&2; exit 2 ;;
esac
