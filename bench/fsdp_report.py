"""The sharding benchmark's report, from its result (docs/results/fsdp_bench.json): per-strategy
memory and step time against the ZeRO formulas and targets, the verdicts, every run, the
out-of-memory demonstration, and the chart.
"""
import shlex
import signal
import statistics
from types import SimpleNamespace

from bench.fsdp_model import (  # noqa: F401
    LABELS,
    MIB,
    STRATEGIES,
    TARGET_RSS_OVERHEAD,
    TARGET_RSS_RATIO,
    TARGET_STATE_RATIO,
    TARGET_STEP_RATIO,
    TARGET_ZERO2_RSS_RATIO,
    formula_text,
    mlp_text,
    zero_formula_bytes,
)
from bench import render
from bench.render import pyplot, report_head, save_figure, verdict
from tests.support.paths import REPO

TITLE = "Sharding: elrun-train's data-parallel strategies"


def markdown(result):
    """The report of one result, as fsdp_bench.py prints it: the benchmark's, then the
    demonstration's (either may be absent: --oom-only, no --oom-demo)."""
    return "\n".join(part for part in (bench_markdown(result), oom_markdown(result)) if part)


def bench_markdown(result):
    """The benchmark's part of the report, or "" when it did not run (--oom-only)."""
    if "runs" not in result:
        return ""
    args = SimpleNamespace(**result["options"])
    return report(args, result["runs"], summarize(args, result["runs"]),
                  list(result["machine"].items()), result["load"], result["elapsed_s"],
                  result["commands"])


def oom_markdown(result):
    """The out-of-memory demonstration's part, or "" when it did not run."""
    if "oom_demo" not in result:
        return ""
    args = SimpleNamespace(**result["options"])
    demo = result["oom_demo"]
    return "\n".join(oom_report(args, demo["results"], demo["limit_bytes"], demo["limit_source"]))


def plot_result(result, path):
    if "runs" in result:
        args = SimpleNamespace(**result["options"])
        plot(args, summarize(args, result["runs"]), path)


def per_run(runs, field):
    """Per run, the maximum over the ranks of a memory-json field."""
    return [max(r[field] for r in run["ranks"]) for run in runs]


def summarize(args, runs):
    """{strategy: {metric: median over runs}} plus ratios to ddp."""
    p, n = args.params, args.nproc
    out = {}
    for s, rs in runs.items():
        if not rs:
            continue
        med = lambda xs: statistics.median(xs)  # noqa: E731
        row = {"state": med(per_run(rs, "state_bytes")),
               "params": med(per_run(rs, "params_bytes")), "grads": med(per_run(rs, "grads_bytes")),
               "optimizer": med(per_run(rs, "optimizer_bytes")),
               "peak": med(per_run(rs, "peak_bytes")), "rss": med(per_run(rs, "peak_rss_bytes")),
               "baseline": med(per_run(rs, "baseline_rss_bytes")),
               "step": med(per_run(rs, "step_time_s")),
               "step_min": min(per_run(rs, "step_time_s")),
               "step_max": max(per_run(rs, "step_time_s")),
               "formula": zero_formula_bytes(s, p, n), "wall": med([r["wall_s"] for r in rs])}
        traces = [r["trace"] for r in rs if r.get("trace") and r["trace"]["steady_step_s"]]
        if traces:
            row["first"] = med([t["first_step_s"] for t in traces])
            row["steady"] = med([t["steady_step_s"] for t in traces])
            # Stability: the spread of the steady-state steps within each run, worst run.
            row["spread"] = max((max(t["gaps"]) - min(t["gaps"])) / t["steady_step_s"]
                                for t in traces)
        out[s] = row
    base = out.get("ddp")
    for row in out.values():
        row["state_x"] = row["state"] / base["state"] if base else None
        row["step_x"] = row["step"] / base["step"] if base else None
        row["rss_x"] = row["rss"] / base["rss"] if base else None
        # What the RSS holds beyond what the accounting explains plus what the process had
        # before the model existed: the allocator's and autograd's share.
        row["rss_over"] = row["rss"] / (row["peak"] + row["baseline"])
        if base and "steady" in row and "steady" in base:
            row["steady_x"] = row["steady"] / base["steady"]
    return out


def mib(x):
    return f"{x / MIB:.1f}"


def prose(section, /, *maps, **values):
    return render.prose("fsdp_bench", section, *maps, **values)


def table(args, summary):
    lines = prose("table")
    for s in args.strategies:
        r = summary.get(s)
        if r is None:
            continue
        state_x = f"{r['state_x']:.3f}" if r["state_x"] is not None else "—"
        step_x = f"{r['step_x']:.2f}" if r["step_x"] is not None else "—"
        rss_x = f"{r['rss_x']:.3f}" if r["rss_x"] is not None else "—"
        lines.append(
            f"| {LABELS[s]} | {mib(r['state'])} ({mib(r['params'])} + {mib(r['grads'])} + "
            f"{mib(r['optimizer'])}) | {mib(r['formula'])} ({formula_text(s)}) | "
            f"{r['state'] / r['formula']:.3f} | {state_x} | {mib(r['peak'])} | "
            f"{mib(r['baseline'])} | {mib(r['rss'])} | {rss_x} | {r['rss_over']:.3f} | "
            f"{r['step']:.3f} ({r['step_min']:.3f}–{r['step_max']:.3f}) | {step_x} |")
    return lines


def trace_table(args, summary):
    lines = prose("trace_table")
    for s in args.strategies:
        r = summary.get(s)
        if r is None or "steady" not in r:
            continue
        x = f"{r['steady_x']:.2f}" if r.get("steady_x") is not None else "—"
        lines.append(f"| {s} | {r['step']:.3f} | {r['first']:.3f} | {r['steady']:.3f} | {x} | "
                     f"{100 * r['spread']:.0f}% |")
    return lines


def verdicts(summary):
    f, d, z = summary.get("fsdp"), summary.get("ddp"), summary.get("zero2")
    if not f or not d:
        return ["(no verdicts: the fsdp and ddp rows are both needed)"]
    mibs = {name: {k: mib(v) for k, v in r.items() if isinstance(v, (int, float))} for name, r in summary.items()}
    values = dict(f=f, d=d, z=z, fm=mibs["fsdp"], dm=mibs["ddp"], zm=mibs.get("zero2"),
                  accounted=mib(f["peak"] + f["baseline"]), state_target=TARGET_STATE_RATIO,
                  step_target=TARGET_STEP_RATIO, rss_target=TARGET_RSS_RATIO,
                  zero2_target=TARGET_ZERO2_RSS_RATIO, overhead_target=TARGET_RSS_OVERHEAD,
                  v_state=verdict(f["state_x"], TARGET_STATE_RATIO), v_step=verdict(f["step_x"], TARGET_STEP_RATIO),
                  v_steady=verdict(f["steady_x"], TARGET_STEP_RATIO) if "steady_x" in f else None,
                  v_rss=verdict(f["rss_x"], TARGET_RSS_RATIO),
                  v_zero2=verdict(z["rss_x"], TARGET_ZERO2_RSS_RATIO) if z else None,
                  v_over=verdict(f["rss_over"], TARGET_RSS_OVERHEAD))
    return (prose("verdicts", **values) + (prose("verdict_steady", **values) if "steady_x" in f else [])
            + prose("verdict_rss", **values) + (prose("verdict_zero2", **values) if z else [])
            + prose("verdict_overhead", **values))


def runs_table(args, runs):
    lines = prose("runs_table")
    for s in args.strategies:
        for run in runs.get(s, []):
            share = f"{100 * run['foreign']:.0f}%" if run["foreign"] is not None else "?"
            for r in run["ranks"]:
                lines.append(f"| {s} | {run['round']} | {r['rank']} | {mib(r['state_bytes'])} | "
                             f"{mib(r['peak_bytes'])} | {mib(r['baseline_rss_bytes'])} | "
                             f"{mib(r['peak_rss_bytes'])} | "
                             f"{r['step_time_s']:.3f} | {run['wall_s']:.1f} | {share} |")
    return lines


def notes(args, summary):
    d = summary.get("ddp")
    out = prose("note_ddp", buckets=mib(4 * args.params), peak=mib(d["peak"]),
                extra=mib(d["peak"] - d["state"])) if d else []
    widths = [28 * 28] + list(args.mlp_hidden) + [10]
    layer = max(a * b for a, b in zip(widths, widths[1:])) * 4
    return out + prose("notes", layer=mib(layer), max_steps=args.max_steps,
                       trace=prose("trace")[0] if args.trace else "")


def report(args, runs, summary, info, load, elapsed, commands):
    wait = prose("wait", vars(args))[0] if args.wait_idle > 0 else ""
    out = report_head(
        "Sharding benchmark: elrun-train ddp / zero1 / zero2 / fsdp / no_shard", info,
        prose("how", vars(args), mlp=mlp_text(args.mlp_hidden), params_mib=mib(4 * args.params), wait=wait,
              elapsed=elapsed)[0], load)
    out += table(args, summary)
    out += prose("medians", nproc=args.nproc, params=args.params)
    out += verdicts(summary)
    if args.trace:
        out += trace_table(args, summary)
    out += ["", "Notes:", ""]
    out += notes(args, summary)
    out += runs_table(args, runs)
    out += prose("commands")
    for s in args.strategies:
        out.append(shlex.join(commands[s]).replace(REPO + "/", ""))
    out += ["```", ""]
    return "\n".join(out)


def plot(args, summary, path):
    plt = pyplot()

    names = [s for s in args.strategies if s in summary]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.8))
    x = range(len(names))
    bottom = [0.0] * len(names)
    for part, color in (("params", "#2a7ab0"), ("grads", "#7fb3d5"), ("optimizer", "#e8a33d")):
        vals = [summary[s][part] / MIB for s in names]
        ax1.bar(x, vals, 0.6, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.scatter(x, [summary[s]["formula"] / MIB for s in names], marker="_", s=900, color="black",
                zorder=3, label="ZeRO formula")
    for i, s in enumerate(names):
        ax1.text(i, bottom[i] * 1.02, f"{bottom[i]:.0f}", ha="center", va="bottom", fontsize=8)
    if "ddp" in summary:
        ax1.axhline(TARGET_STATE_RATIO * summary["ddp"]["state"] / MIB, color="green",
                    linestyle="--", linewidth=1,
                    label=f"fsdp target ≤ {TARGET_STATE_RATIO:g}× ddp")
    ax1.set_ylim(0, max(bottom) * 1.35)
    ax1.set_title("Model state per rank (MiB)", fontsize=10)
    ax1.legend(fontsize=8, loc="upper center", ncol=2)

    w = 0.38
    ax2.bar([i - w / 2 for i in x], [summary[s]["peak"] / MIB for s in names], w,
            color="#7fb3d5", label="peak (accounting)")
    rss = [summary[s]["rss"] / MIB for s in names]
    ax2.bar([i + w / 2 for i in x], rss, w, color="#c0504d", label="peak RSS (VmHWM)")
    # The baseline (resident before the model was built) as the hatched bottom of the RSS bar.
    ax2.bar([i + w / 2 for i in x], [summary[s]["baseline"] / MIB for s in names], w,
            color="#e6b0ae", edgecolor="#7f2a27", hatch="///", linewidth=0.5,
            label="of which baseline RSS")
    for i, v in enumerate(rss):
        ax2.text(i + w / 2, v * 1.01, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    top2 = max(rss + [summary[s]["peak"] / MIB for s in names])
    if "ddp" in summary:
        ax2.axhline(TARGET_RSS_RATIO * summary["ddp"]["rss"] / MIB, color="green",
                    linestyle="--", linewidth=1,
                    label=f"fsdp target ≤ {TARGET_RSS_RATIO:g}× ddp's peak RSS")
    ax2.set_ylim(0, top2 * 1.4)
    ax2.set_title("Peak memory per rank (MiB, max over ranks)", fontsize=10)
    ax2.legend(fontsize=8, loc="upper center", ncol=2)

    steps = [summary[s]["step"] for s in names]
    err = [[summary[s]["step"] - summary[s]["step_min"] for s in names],
           [summary[s]["step_max"] - summary[s]["step"] for s in names]]
    ax3.bar(x, steps, 0.6, color="#2a7ab0", yerr=err, capsize=4, label="step_time_s")
    if all("steady" in summary[s] for s in names):
        ax3.scatter(x, [summary[s]["steady"] for s in names], marker="_", s=900, color="black",
                    zorder=3, label="steady-state step")
    for i, s in enumerate(names):
        ax3.text(i + 0.32, summary[s]["step"], f"{summary[s]['step']:.2f}", ha="left",
                 va="center", fontsize=8)
    if "ddp" in summary:
        ax3.axhline(TARGET_STEP_RATIO * summary["ddp"]["step"], color="green", linestyle="--",
                    linewidth=1, label=f"fsdp target ≤ {TARGET_STEP_RATIO:g}× ddp")
    top = max([summary[s]["step_max"] for s in names]
              + ([TARGET_STEP_RATIO * summary["ddp"]["step"]] if "ddp" in summary else []))
    ax3.set_ylim(0, top * 1.4)
    ax3.set_title("Step time (s; median, whiskers min/max)", fontsize=10)
    ax3.legend(fontsize=8, loc="upper left")
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=9)
    fig.suptitle(f"elrun-train strategies: MLP {mlp_text(args.mlp_hidden)} "
                 f"({args.params / 1e6:.1f}M params), Adam, "
                 f"{args.nproc} ranks × batch {args.batch_size} × 1 thread", fontsize=11)
    save_figure(fig, path)


# --- out-of-memory demonstration -------------------------------------------------------------

def oom_killed(r):
    """Whether the kernel's OOM killer acted in r's cgroup (where the kernel does not count its
    kills: the limit was hit and the root cause is a SIGKILL elrun did not send)."""
    if r["oom_kills"] is not None:
        return r["oom_kills"] > 0
    return bool(r["failcnt"]) and any("-9 (SIGKILL)" in l and "not sent by elrun" in l
                                      for l in r["root_cause"])


def exit_text(r):
    if r["error"]:
        return "not run"
    if r["timed_out"]:
        return f"timed out after {r.get('wall_s', 0):.0f} s"
    rc = r["rc"]
    if rc is not None and rc < 0:
        return f"{rc} ({signal.Signals(-rc).name})" if -rc in signal.valid_signals() else str(rc)
    return str(rc)


def oom_report(args, results, limit_bytes, limit_source):
    """The demonstration's markdown lines."""
    out = prose("oom_head")
    if results and results[0]["error"]:
        out += [f"- The demonstration cannot run here: {results[0]['error']}.", ""]
        return out
    cg = results[0]["cgroup"].split()[0]
    controls = ("memory.limit_in_bytes = memory.memsw.limit_in_bytes (no swap)" if cg == "v1"
                else "memory.max, memory.swap.max = 0")
    out += prose("oom_limit", limit=limit_bytes / MIB, cg=cg, controls=controls,
                 limit_source=limit_source, nproc=args.nproc, max_steps=args.max_steps,
                 timeout=args.timeout)
    for r in results:
        kills = "?" if r["oom_kills"] is None else str(r["oom_kills"])
        if r["oom_kills"] is None and r["failcnt"] is not None:
            kills += f" (limit hit {r['failcnt']} times)"
        usage = f"{r['max_usage'] / MIB:.0f}" if r["max_usage"] is not None else "?"
        out.append(f"| {r['strategy']} | {r['limit_bytes'] / MIB:.0f} | {exit_text(r)} | {kills} | "
                   f"{r['last_step']} of {args.max_steps} | {usage} |")
    for r in results:
        if r["rc"] != 0 and (r["root_cause"] or r.get("stderr_tail")):
            out += ["", f"elrun's report of the {r['strategy']} run:", "", "```"]
            out += r["root_cause"] or [l[6:] for l in r["stderr_tail"].splitlines()]
            out.append("```")
    d = next((r for r in results if r["strategy"] == "ddp"), None)
    f = next((r for r in results if r["strategy"] == "fsdp"), None)
    why = []
    if d is None or d["rc"] == 0:
        why.append("ddp did not fail (the limit is not below what it needs"
                   + (f": its cgroup max usage was {d['max_usage'] / MIB:.0f} MiB; a limit "
                      f"between fsdp's and ddp's cgroup max usage may show it"
                      if d and d["max_usage"] else "") + ")")
    elif not oom_killed(d):
        why.append(f"ddp failed ({exit_text(d)}) but not by the OOM killer")
    if f is None:
        why.append("fsdp did not run")
    elif f["rc"] != 0:
        why.append(f"fsdp failed too ({exit_text(f)}"
                   + (", OOM-killed" if oom_killed(f) else "") + ")")
    elif f["last_step"] != args.max_steps:
        why.append(f"fsdp reached step {f['last_step']} of {args.max_steps}")
    out += prose("oom_verdict", nproc=args.nproc,
                 shown="**shown**" if not why else f"**not shown**: {'; '.join(why)}")
    return out
