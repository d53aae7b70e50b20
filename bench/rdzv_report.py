"""The rendezvous benchmark's report, from its result (docs/results/rdzv_bench.json): the markdown
table of formation and recovery medians against targets, notes and commands, and the plot.
"""
import statistics
from types import SimpleNamespace

from bench import render
from bench.rdzv_runs import TAG_VAR
from bench.render import (
    failed_runs,
    namespaces,
    pyplot,
    report_head,
    save_figure,
    stats,
    target_row,
)
from tests.support.paths import REPO

TITLE = "Rendezvous: elrun gRPC vs torchrun c10d"
TORCHRUN_AGENT_MIB = 235  # RSS of one idle torchrun agent (python3 + torch) on this machine.
TORCHRUN_BUDGET_MIB = 250  # What the memory check reserves per torchrun agent.
TARGETS_S = {8: 0.3, 128: 3.0}  # formation, elrun
TARGET_RECOVERY_S = 1.0

ELRUN_DAEMON = "elrun (elrun-rdzv daemon)"
ELRUN_EMBEDDED = "elrun (coordinator embedded in an agent)"
TORCHRUN = "torchrun c10d (--monitor_interval 0.1)"
FLOOR = "harness floor: N x /bin/true"
LAUNCHERS = [ELRUN_DAEMON, ELRUN_EMBEDDED, TORCHRUN]


def cases_of(result):
    """The result's cases as objects with the fields the report reads."""
    return namespaces(result["cases"], missing=None)


def markdown(result):
    """The report of one result, as rdzv_bench.py prints it."""
    cases = cases_of(result)
    args = SimpleNamespace(**result["options"])
    return report(args, cases, summarize(cases, args.recovery_cap), list(result["machine"].items()),
                  result["load"], result["elapsed_s"])


def plot_result(result, path):
    args = SimpleNamespace(**result["options"])
    plot(summarize(cases_of(result), args.recovery_cap), args.sizes, args.recovery_cap, path)


def summarize(cases, cap):
    """{(key, launcher, n): (median, min, max, runs, failed) or a string, plus 'note' entries}"""
    out = {}
    for c in cases:
        k = (c.key, c.launcher, c.n)
        if c.status and not c.samples:
            out[k] = c.status
            continue
        if c.key == "formation":
            out[k] = (*stats(c.samples), len(c.samples), len(c.failures))
        else:
            ok = [r["recovered_s"] for r in c.samples if r["recovered_s"] is not None]
            n = len(c.samples)
            if ok:
                out[k] = (*stats(ok), len(ok), len(c.failures))
                if len(ok) < n:
                    out[("note",) + k] = (f"no new round within {cap:g} s in {n - len(ok)} of {n} "
                                          f"runs (left out of the statistics)")
            else:
                out[k] = f"no new round within {cap:g} s ({n} of {n} runs)"
        if c.status:  # Failed after some samples.
            out[("note",) + k] = c.status
        elif c.failures:
            out[("note",) + k] = (f"{len(c.failures)} failed run(s), retried and left out of the "
                                  f"statistics (see below); the first: {c.failures[0]}")
    return out


def recovery_details(c, cap):
    rs = c.samples
    if not rs:
        return None
    n = len(rs)

    def count(pred):
        return sum(1 for r in rs if pred(r))

    parts = [f"first round formed {statistics.median([r['formed_s'] for r in rs]):.2f} s after "
             f"the agents started (median)"]
    host = sorted({r["host_agent"] for r in rs}, key=str)
    parts.append("coordinator hosted by agent " + "/".join(
        "none (daemon)" if h is None else str(h) for h in host))
    parts.append("killed: the agent of group rank " + "/".join(sorted({r["victim_rank"] for r in rs})))
    got = [r for r in rs if r["recovered_s"] is not None]
    if got:
        parts.append("new round: world sizes " + "/".join(sorted({",".join(r["new_world_sizes"])
                                                                  for r in got}))
                     + ", TORCHELASTIC_RESTART_COUNT " + "/".join(
                         sorted({",".join(r["new_restart_counts"]) for r in got})))
        parts.append(f"first new worker {statistics.median([r['first_new_s'] for r in got]):.3f} s "
                     f"after the kill (median)")
    none = [r for r in rs if r["recovered_s"] is None]
    if none:
        parts.append(f"after {cap:g} s without a new round: survivors' new workers "
                     f"{'/'.join(sorted({str(r['new_workers']) for r in none}))} of 3, their old "
                     f"workers still running {'/'.join(sorted({str(r['old_survivor_workers_alive']) for r in none}))} "
                     f"of 3, survivor agents alive "
                     f"{'/'.join(sorted({str(r['survivor_agents_alive']) for r in none}))} of 3")
    parts.append(f"the killed agent's worker was still running afterwards in "
                 f"{count(lambda r: r['victim_worker_alive'])} of {n} runs")
    return "; ".join(parts)


def table(summary, cases, sizes):
    lines = ["| Benchmark | Launcher | Median | Min | Max | Runs | Target | Meets |",
             "|---|---|---:|---:|---:|---:|---:|:---:|"]

    def row(label, launcher, v, target, digits=3):
        lines.append(target_row(label, launcher, v, target, "s", digits))

    for n in sizes:
        for launcher in LAUNCHERS:
            v = summary.get(("formation", launcher, n))
            if v is None:
                continue
            target = TARGETS_S.get(n) if launcher != TORCHRUN else None
            row(f"1. formation, {n} agents, start → all exited 0", launcher, v, target)
    for launcher in LAUNCHERS:
        v = summary.get(("recovery", launcher, 4))
        if v is not None:
            row("2. recovery: kill -9 of 1 of 4 agents → 3 new workers running", launcher, v,
                TARGET_RECOVERY_S if launcher != TORCHRUN else None)
    for n in sizes:
        v = summary.get(("formation", FLOOR, n))
        if v is not None:
            row(f"0. harness floor: start {n} × /bin/true, wait for all", "—", v, None, 4)
    return lines


def report(a, cases, summary, info, load, elapsed):
    wait = render.prose("rdzv_bench", "wait", vars(a))[0] if a.wait_idle > 0 else ""
    out = report_head("Rendezvous benchmark: elrun gRPC vs torchrun c10d", info,
                      render.prose("rdzv_bench", "how", vars(a), wait=wait, elapsed=elapsed)[0], load)
    out += table(summary, cases, a.sizes)
    out += [""]
    notes = [(k, v) for k, v in summary.items() if k[0] == "note"]
    for k, v in notes:
        out.append(f"- note, {k[1]} / {k[2]} / N={k[3]}: {v}")
    for c in cases:
        if c.key == "recovery":
            d = recovery_details(c, a.recovery_cap)
            if d:
                out.append(f"- recovery, {c.launcher}: {d}.")
    out += render.prose("rdzv_bench", "notes", settle=a.settle, recovery_cap=a.recovery_cap,
                        tag_var=TAG_VAR)
    out += failed_runs(cases, lambda c: f"{c.key} / {c.launcher} / N={c.n}")
    out += render.prose("rdzv_bench", "commands", rdzv=a.rdzv.replace(REPO + "/", ""))
    seen = set()
    for c in cases:
        if c.cmd in seen:
            continue
        seen.add(c.cmd)
        out.append(c.cmd + f"  [{c.key}: {c.launcher}" + (", not run]" if c.missing else "]"))
    out += ["```", ""]
    return "\n".join(out)


def plot(summary, sizes, cap, path):
    plt = pyplot()

    colors = {ELRUN_DAEMON: "#2a7ab0", ELRUN_EMBEDDED: "#6cb4e0", TORCHRUN: "#c0504d",
              FLOOR: "#999999"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [3, 2]})
    for launcher in LAUNCHERS + [FLOOR]:
        xs, ys, lo, hi = [], [], [], []
        for n in sizes:
            v = summary.get(("formation", launcher, n))
            if isinstance(v, tuple):
                xs.append(n)
                ys.append(v[0])
                lo.append(v[0] - v[1])
                hi.append(v[2] - v[0])
        if xs:
            ax1.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, color=colors[launcher],
                         label=launcher, linestyle="--" if launcher == FLOOR else "-")
            above = launcher in (ELRUN_DAEMON, TORCHRUN)
            for x, y in zip(xs, ys):
                ax1.annotate(f"{y:.2f} s" if y >= 0.1 else f"{y * 1000:.0f} ms", (x, y),
                             textcoords="offset points", xytext=(-34, 7) if above else (7, -11),
                             fontsize=8, color=colors[launcher])
    for n, t in TARGETS_S.items():
        if n in sizes:
            ax1.plot([n], [t], marker="_", markersize=22, color="green", mew=2)
            ax1.annotate(f"elrun target ≤ {t:g} s", (n, t), textcoords="offset points",
                         xytext=(12, -3), fontsize=8, color="green")
    notes = []
    for launcher in LAUNCHERS:
        failed = [n for n in sizes if str(summary.get(("formation", launcher, n), "")).startswith(
            "FAILED")]
        if failed:
            notes.append((f"{launcher}: FAILED for N = {', '.join(map(str, failed))}",
                          colors[launcher]))
    skipped = [n for n in sizes if str(summary.get(("formation", TORCHRUN, n), "")).startswith(
        "not run")]
    if skipped:
        notes.append((f"torchrun not run for N = {', '.join(map(str, skipped))} (memory: N × "
                      f"{TORCHRUN_AGENT_MIB} MiB)", colors[TORCHRUN]))
    for i, (text, color) in enumerate(notes):
        ax1.text(0.98, 0.03 + 0.05 * i, text, transform=ax1.transAxes, ha="right", va="bottom",
                 fontsize=8, color=color)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(sizes)
    ax1.set_xticklabels([str(n) for n in sizes])
    ax1.set_xlabel("agents N (1 worker each, /bin/true)")
    ax1.set_ylabel("seconds, start → all agents exited 0")
    ax1.set_title("1. rendezvous formation", fontsize=10)
    ax1.set_xlim(min(sizes) / 1.4, max(sizes) * 2.2)
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax1.grid(True, which="both", alpha=0.3)

    names = {ELRUN_DAEMON: "elrun\n(daemon)", ELRUN_EMBEDDED: "elrun\n(embedded)",
             TORCHRUN: "torchrun c10d"}
    bars = [(l, summary.get(("recovery", l, 4))) for l in LAUNCHERS
            if summary.get(("recovery", l, 4)) is not None]
    for i, (launcher, v) in enumerate(bars):
        if isinstance(v, tuple):
            ax2.bar(i, v[0], color=colors[launcher], yerr=[[v[0] - v[1]], [v[2] - v[0]]], capsize=4)
            ax2.text(i, v[2] * 1.15, f"{v[0]:.3f} s", ha="center", va="bottom", fontsize=9)
        elif v.startswith("no new round"):
            ax2.bar(i, cap, color="white", edgecolor=colors[launcher], hatch="//")
            ax2.text(i, cap * 1.1, f"no new round\nwithin {cap:g} s", ha="center", va="bottom",
                     fontsize=9)
        else:
            ax2.text(i, 0.1, "failed" if v.startswith("FAILED") else "missing", ha="center",
                     fontsize=9, color="gray")
    ax2.axhline(TARGET_RECOVERY_S, color="green", linestyle="--", linewidth=1,
                label=f"elrun target ≤ {TARGET_RECOVERY_S:g} s")
    ax2.set_yscale("log")
    ax2.set_ylim(0.005, cap * 4)
    ax2.set_xticks(range(len(bars)))
    ax2.set_xticklabels([names[l] for l, _ in bars], fontsize=9)
    ax2.set_ylabel("seconds, kill -9 → 3 survivors' new workers running")
    ax2.set_title("2. recovery after kill -9 of 1 of 4 agents", fontsize=10)
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle("elrun gRPC rendezvous vs torchrun 2.11 c10d, 127.0.0.1 (medians; whiskers "
                 "min/max)", fontsize=11)
    save_figure(fig, path)
