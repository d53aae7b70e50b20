"""The frame every benchmark shares: its common options (--json, --png, --wait-idle, --smoke,
--allow-dirty, timeouts, retries), the refusal to measure a dirty tree, retried runs, round-robin
cases, per-case state and private copies of the binaries.

Standard library only.
"""
import argparse
import contextlib
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

from bench import results
from bench.machine import wait_idle
from tests.support.procs import log


class RunError(Exception):
    """One measured run failed (non-zero exit, timeout, missing output)."""


# --- options ----------------------------------------------------------------------------------

def parser(bench, doc, png=True):
    """An ArgumentParser with the options every benchmark has: --json (default
    docs/results/<bench>.json, the result bench/report.py renders), --png (default
    bench/<bench>.png, not committed), --wait-idle, --smoke and --allow-dirty."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--json", default=results.default_path(bench),
                    help="the result (JSON) to write (default: %(default)s)")
    if png:
        ap.add_argument("--png", default=os.path.join(results.CHECKOUT, "bench", bench + ".png"),
                        help="plot to write (default: %(default)s)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each round, wait up to SECONDS until other processes use < 10%% of "
                         "the CPUs (default 0: do not wait)")
    ap.add_argument("--smoke", action="store_true",
                    help="a seconds-long run with the benchmark's smoke-sized options (explicit options "
                         "still win), its result and plot written to a temporary directory, a dirty tree "
                         "allowed: checks that the benchmark runs, asserts no figure")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="measure even with uncommitted changes to tracked files (the result says so)")
    ap.set_defaults(bench=bench)
    return ap


def add_run_options(ap, timeout, torchrun_timeout=None, retries=None):
    """--timeout, and, when given defaults, --torchrun-timeout and --retries."""
    ap.add_argument("--timeout", type=float, default=timeout,
                    help="seconds before one elrun run is killed (default %(default)s)")
    if torchrun_timeout is not None:
        ap.add_argument("--torchrun-timeout", type=float, default=torchrun_timeout,
                        help="seconds before one torchrun run is killed (default %(default)s)")
    if retries is not None:
        ap.add_argument("--retries", type=int, default=retries,
                        help="times a failed run is retried before its case is marked failed "
                             "(default %(default)s)")


def parse(ap, smoke, argv=None):
    """Parses argv (default sys.argv[1:]). With --smoke, `smoke` (the benchmark's smoke-sized
    options) comes first, so that options given explicitly still win, and the outputs go to a new
    temporary directory (under $TEST_TMPDIR in a Bazel test). Without --smoke or --allow-dirty, a
    tree with uncommitted changes to tracked files outside docs/ exits with status 2: a result must
    name the commit it measured."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(list(smoke) + argv if "--smoke" in argv else argv)
    if args.smoke:
        out = tempfile.mkdtemp(prefix=args.bench + ".smoke.", dir=os.environ.get("TEST_TMPDIR"))
        args.json = os.path.join(out, args.bench + ".json")
        if hasattr(args, "png"):
            args.png = os.path.join(out, args.bench + ".png")
        args.allow_dirty = True
        log(f"{args.bench}: smoke run ({' '.join(smoke)}), outputs in {out}")
    changes = results.uncommitted_changes()
    if changes and not args.allow_dirty:
        ap.exit(2, f"{ap.prog}: uncommitted changes to tracked files ({', '.join(changes[:3])}"
                   f"{' ...' if len(changes) > 3 else ''}): commit them so that the result names the "
                   f"commit it measured, or pass --allow-dirty\n")
    return args


def require_in_smoke(ap, args, *binaries):
    """With --smoke, a binary that is not there is an error (a full run reports the cases that
    need it as missing instead)."""
    missing = [path for path in binaries if not os.access(path, os.X_OK)]
    if args.smoke and missing:
        ap.error(f"--smoke: {', '.join(missing)} not found; build it with bazel first")


def options_record(args):
    """The parsed options as a JSON-able dict (what the reports read back as `args`)."""
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, list, type(None)))}


# --- runs -------------------------------------------------------------------------------------

def with_retries(c, retries, fn, errors=(RunError, subprocess.TimeoutExpired)):
    """fn() with up to `retries` more tries; failed tries are recorded in c.failures.

    c needs .key, .launcher and a list .failures."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except errors as ex:
            c.failures.append(str(ex))
            log(f"  {c.key} / {c.launcher}: run failed ({ex})"
                + ("; retrying" if attempt < retries else "; giving up on this case"))
            if attempt == retries:
                raise


class CaseState:
    """What one benchmark case collects: its samples, the messages of failed runs that were
    retried, the error that failed it, or why it was not run (`missing`)."""

    def __init__(self, missing=None):
        self.missing = missing
        self.samples = []
        self.failures = []
        self.error = None

    @property
    def status(self):
        """None when the case ran; else the text its table row shows instead of figures."""
        if self.missing:
            return self.missing
        if self.error:
            return "FAILED: " + self.error
        return None


def case_rounds(cases, retries, one, wait_idle_s, foreign):
    """The measured rounds over CaseState cases that each take c.runs runs: round i (after up to
    wait_idle_s seconds of waiting for an idle machine, measured by foreign, a ForeignCpu) gives
    every case with runs left and no error one run, one(c) with retries; a run that still fails
    marks its case failed (c.error)."""
    rounds = max((c.runs for c in cases), default=0)
    for i in range(rounds):
        wait_idle(wait_idle_s)
        log(f"round {i + 1}/{rounds}")

        def one_round():
            for c in cases:
                if c.error or i >= c.runs:
                    continue
                try:
                    c.samples.append(with_retries(c, retries, lambda: one(c)))
                except (RunError, subprocess.TimeoutExpired) as ex:
                    c.error = str(ex)

        foreign.phase(one_round)


def round_robin(group, runs, one, label, wait_idle_s=0):
    """Runs one(case) `runs` times for each case of `group` (dicts with "runs" and "errors" lists),
    round-robin, so that slow drift hits every case alike, each round after up to wait_idle_s
    seconds of waiting for an idle machine: a result is appended to case["runs"] and logged with
    label(case, i, result); a RuntimeError, OSError or timeout to case["errors"] (its head and
    tail when long)."""
    for i in range(runs):
        wait_idle(wait_idle_s)
        for case in group:
            try:
                sample = one(case)
                case["runs"].append(sample)
                log(label(case, i, sample))
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
                text = str(error)
                case["errors"].append(text if len(text) <= 800 else text[:300] + " ... " + text[-500:])
                log(label(case, i, None) + ": " + text[:300])


def on_copies(args, name, run, binaries=None):
    """run(tmp) on private copies of the binaries (private_copies; default elrun and elrun-train);
    a RunError is the benchmark's failure: logged, exit status 1."""
    try:
        with private_copies(args, name, binaries or {"elrun": "elrun", "train": "elrun-train"}) as tmp:
            return run(tmp)
    except RunError as ex:
        log(f"{name}: FAILED: {ex}")
        return 1


class Lines:
    """A child's stdout (proc.stdout, a pipe), line by line, each wait with a deadline. on_line sees
    every line; `error` (default RuntimeError) is raised when no line is accepted in time or the
    child (called `name` in the message) exits first."""

    def __init__(self, proc, name, error=RuntimeError, on_line=None):
        self.proc, self.name, self.error, self.buffer = proc, name, error, b""
        self.on_line = on_line or (lambda text: None)

    def expect(self, accept, what, timeout):
        """The fields of the first line for which accept(fields) is true."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                self.on_line(text)
                fields = text.split()
                if fields and accept(fields):
                    return fields
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise self.error("no %s within %.0f s (%s %s)" % (
                    what, timeout, self.name, "exited %s" % self.proc.returncode
                    if self.proc.poll() is not None else "running"))
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if chunk:
                    self.buffer += chunk


@contextlib.contextmanager
def private_copies(args, name, binaries):
    """A private TMPDIR, removed at the end (launchers make a log directory per run under it),
    holding copies of the binaries taken now, so that a rebuild during the benchmark cannot mix
    builds. `binaries`: {attribute: file name}; each copy's path goes to args.<attribute>_copy."""
    tmp = tempfile.mkdtemp(prefix=name + ".")
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = tmp
    try:
        os.makedirs(os.path.join(tmp, "bin"))
        for attribute, file_name in binaries.items():
            setattr(args, attribute + "_copy",
                    shutil.copy2(getattr(args, attribute), os.path.join(tmp, "bin", file_name)))
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
