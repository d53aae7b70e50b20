"""The out-of-memory demonstration's runs: ddp and fsdp, the same job, each in a memory cgroup of
one limit (fsdp_cgroup.py); fsdp_report.py says whether ddp failed for lack of memory where fsdp
trained. Part of fsdp_bench.py.
"""
import os
import subprocess
import tempfile
import time

from bench.fsdp_cgroup import CGROUP_PREFIX, MemoryCgroup
from bench.fsdp_model import MIB
from bench.fsdp_report import exit_text
from bench.fsdp_runs import STEP_LINE, TAG_VAR, command, last_lines, read_until_exit
from tests.support.paths import REPO
from tests.support.procs import clean_env, kill_tagged, log, stop_launcher

OOM_STRATEGIES = ("ddp", "fsdp")


def root_cause_lines(stderr):
    """elrun's failure report, condensed: its FAILED header and the root cause's rank and exitcode
    lines."""
    lines = [l.rstrip() for l in stderr.splitlines()]
    out = [l.strip() for l in lines if " FAILED (run_id " in l][:1]
    for i, line in enumerate(lines):
        if line.startswith("Root Cause"):
            out.append(line.strip())
            for detail in lines[i + 1:]:
                if detail.startswith(("---", "===")):
                    break
                if detail.strip().startswith(("rank ", "exitcode ", "error ")):
                    out.append(detail.strip())
            break
    return out


def oom_run(args, strategy, env, limit_bytes):
    """One run of `strategy` in a fresh memory cgroup of limit_bytes; never raises RunError: a
    failed run is a result here."""
    res = {"strategy": strategy, "limit_bytes": limit_bytes, "rc": None, "timed_out": False,
           "last_step": None, "oom_kills": None, "failcnt": None, "max_usage": None,
           "root_cause": [], "error": None, "cgroup": None}
    cg, why = MemoryCgroup.create(f"{CGROUP_PREFIX}-{os.getpid()}-{strategy}", limit_bytes)
    if cg is None:
        res["error"] = why
        return res
    res["cgroup"] = f"{cg.version} {cg.path}"
    tag = f"{args.tag}:oom:{strategy}"
    env = dict(env, **{TAG_VAR: tag})
    argv = command(args, strategy, args.train_copy, args.elrun_copy, trace=True)
    lines = []
    try:
        with tempfile.TemporaryFile() as err:
            t0 = time.monotonic()
            try:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=err, env=env, cwd=REPO, start_new_session=True,
                                     preexec_fn=cg.join)
            except (OSError, subprocess.SubprocessError) as ex:
                res["error"] = f"could not start elrun in the cgroup {cg.path}: {ex}"
                return res
            try:
                lines = read_until_exit(p, t0 + args.timeout)
                res["rc"] = p.returncode
            except subprocess.TimeoutExpired:
                res["timed_out"] = True
            finally:  # Also on Ctrl-C: the launcher is in its own session; stop it here.
                p.stdout.close()
                stop_launcher(p, TAG_VAR, tag)
            res["wall_s"] = time.monotonic() - t0
            err.seek(0)
            stderr = err.read().decode(errors="replace")
        res.update(cg.stats())
    finally:
        kill_tagged(TAG_VAR, tag)
        cg.remove()
    steps = [int(m.group(2)) for _, l in lines for m in [STEP_LINE.match(l)] if m]
    res["last_step"] = max(steps) if steps else 0
    if res["rc"] != 0:
        res["root_cause"] = root_cause_lines(stderr)
        res["stderr_tail"] = last_lines(stderr, 6)
    return res


def oom_demo(args, limit_bytes):
    """Runs ddp and fsdp under one memory limit; their results (oom_run's)."""
    env = clean_env((TAG_VAR,))
    results = []
    for s in OOM_STRATEGIES:
        log(f"oom demo: {s} under a {limit_bytes / MIB:.0f} MiB memory cgroup")
        r = oom_run(args, s, env, limit_bytes)
        results.append(r)
        if r["error"]:
            log(f"  cannot run the out-of-memory demonstration here: {r['error']}")
            break
        log(f"  {s}: exit {exit_text(r)}, OOM kills {r['oom_kills']}, last step "
            f"{r['last_step']}/{args.max_steps}"
            + (f", cgroup max usage {r['max_usage'] / MIB:.0f} MiB" if r["max_usage"] else ""))
    return results
