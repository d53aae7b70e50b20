"""The frame every benchmark shares: its common options, retried runs, per-case state, private
copies of the binaries, and the formatting of medians against targets.

Standard library only.
"""
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile

from tests.support import results
from tests.support.procs import log


class RunError(Exception):
    """One measured run failed (non-zero exit, timeout, missing output)."""


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


# --- options ----------------------------------------------------------------------------------

def add_output_options(ap, png_default, png_help="plot to write",
                       json_help="also write the raw samples to this file", bench=None):
    """--png and --json. With `bench`, --json defaults to docs/results/<bench>.json, the result
    that scripts/bench/report.py renders."""
    ap.add_argument("--png", default=png_default, help=png_help + " (default: %(default)s)")
    if bench:
        ap.add_argument("--json", default=results.default_path(bench),
                        help="the result (JSON) to write (default: %(default)s)")
    else:
        ap.add_argument("--json", help=json_help)


def add_run_options(ap, timeout, torchrun_timeout=None, retries=None, wait_idle_help=None):
    """--timeout, and, when given defaults, --torchrun-timeout and --retries; --wait-idle."""
    ap.add_argument("--timeout", type=float, default=timeout,
                    help="seconds before one elrun run is killed (default %(default)s)")
    if torchrun_timeout is not None:
        ap.add_argument("--torchrun-timeout", type=float, default=torchrun_timeout,
                        help="seconds before one torchrun run is killed (default %(default)s)")
    if retries is not None:
        ap.add_argument("--retries", type=int, default=retries,
                        help="times a failed run is retried before its case is marked failed "
                             "(default %(default)s)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help=wait_idle_help or "before the warm-ups and before each round, wait up to "
                    "SECONDS until other processes use < 10%% of the CPUs (default 0: do not wait)")


def options_record(args):
    """The parsed options as a JSON-able dict (what the reports read back as `args`)."""
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, list, type(None)))}


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


# --- formatting -------------------------------------------------------------------------------

def report_head(title, info, how, load):
    """The head every benchmark report opens with: its title, the machine facts in `info` (pairs),
    `how` (one bullet: what ran and how, the benchmark's own words) and the other processes' load."""
    return [f"## {title}", ""] + [f"- **{k}**: {v}" for k, v in info] + [how, f"- **load**: {load}", ""]


def fmt(x, digits=1):
    return f"{x:.{digits}f}"


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def verdict(value, target):
    return "yes" if value <= target else "NO"


def round_robin(group, runs, one, label):
    """Runs one(case) `runs` times for each case of `group` (dicts with "runs" and "errors" lists),
    round-robin, so that slow drift hits every case alike: a result is appended to case["runs"]
    and logged with label(case, i, result); a RuntimeError, OSError or timeout to case["errors"]
    (its head and tail when long)."""
    for i in range(runs):
        for case in group:
            try:
                sample = one(case)
                case["runs"].append(sample)
                log(label(case, i, sample))
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
                text = str(error)
                case["errors"].append(text if len(text) <= 800 else text[:300] + " ... " + text[-500:])
                log(label(case, i, None) + ": " + text[:300])


def median_range(case, key):
    """(median, min, max) of case["runs"][*][key] where present, or None."""
    xs = [run[key] for run in case["runs"] if run.get(key) is not None]
    return stats(xs) if xs else None


def median_cell(s, digits=2):
    """A median_range as "median (min-max)", or "failed"."""
    return "failed" if s is None else f"{fmt(s[0], digits)} ({fmt(s[1], digits)}-{fmt(s[2], digits)})"
