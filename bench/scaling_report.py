"""The report of scaling_bench.py, from its result (docs/results/scaling_bench.json): pooled and
per-triple scaling efficiency against the pair's ceilings, every triple, commands, and the plot.
"""
import statistics
from types import SimpleNamespace

from bench import render
from bench.render import fmt, pyplot, save_figure
from bench.train_jobs import PAIR
from bench.train_report import TARGET_SCALING, commands_block, report_header

TITLE = "Scaling efficiency of elrun-train's DDP, from adjacent runs"


def markdown(result):
    """The report of one result, as scaling_bench.py prints it."""
    rows = result["rows"]
    return report(SimpleNamespace(**result["options"]), rows, summary(rows), result["commands"],
                  list(result["machine"].items()), result["load"], result["elapsed_s"])


def plot_result(result, path):
    plot(result["rows"], summary(result["rows"]), path)


def quartiles(xs):
    """(q1, median, q3) of xs, by the inclusive method (the median of one value is itself)."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def pooled(rows, key):
    """All triples as one: the sum of a rate over the sum of 2 x its references. Unlike the
    median of per-triple ratios, a triple's share counts by its rates, and a slow 1-rank pair
    cannot skew the figure by dividing by a small number."""
    return sum(r[key] for r in rows) / sum(r["one_before"] + r["one_after"] for r in rows)


def summary(rows):
    s = {"pooled": pooled(rows, "two"), "pooled_ceiling": pooled(rows, "pair"),
         "pooled_sync": pooled(rows, "sync")}
    for key in ("scaling", "ceiling", "sync_ceiling", "of_sync", "lockstep"):
        s[key] = quartiles([r[key] for r in rows])
    s["met"] = sum(r["scaling"] >= TARGET_SCALING for r in rows)
    s["sync_met"] = sum(r["sync_ceiling"] >= TARGET_SCALING for r in rows)
    return s


def q_cell(q, digits=3):
    return f"{q[1]:.{digits}f} ({q[0]:.{digits}f}–{q[2]:.{digits}f})"


def report(args, rows, s, commands, info, load, elapsed):
    n = len(rows)
    out = report_header(
        "Scaling efficiency of elrun-train's DDP, from adjacent runs", args, info,
        f"{n} triples (1 rank, 2 ranks, the pair) and a closing 1-rank run", "triple", load, elapsed)

    def verdict(x):
        return f"(target ≥ {TARGET_SCALING:g}: **{'yes' if x >= TARGET_SCALING else 'NO'}**)"

    cells = {k + "_q": q_cell(s[k]) for k in ("scaling", "ceiling", "sync_ceiling", "of_sync", "lockstep")}
    out += render.prose("scaling_bench", "table", n=n, pooled_verdict=verdict(s["pooled"]),
                        scaling_verdict=verdict(s["scaling"][1]), pooled_of_sync=s["pooled"] / s["pooled_sync"],
                        **s, **cells)
    for i, r in enumerate(rows):
        off = " / ".join(f"{100 * x:.1f}%" for x in r["off_cpu"])
        out.append(f"| {i + 1} | {fmt(r['one_before'])} / {fmt(r['one_after'])} | {fmt(r['two'])} | "
                   f"{off} | {fmt(r['pair'])} | {r['lockstep']:.3f}× | {fmt(r['sync'])} | "
                   f"{r['scaling']:.3f} | {r['ceiling']:.3f} | {r['sync_ceiling']:.3f} | "
                   f"{r['of_sync']:.3f} |")
    out += commands_block(args, [(key, argv, key.startswith(PAIR))
                                             for key, argv in commands.items()])
    return "\n".join(out)


def plot(rows, s, path):
    plt = pyplot()

    x = range(1, len(rows) + 1)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(x, [r["ceiling"] for r in rows], "s--", color="#999999", label="ceiling: the pair")
    ax.plot(x, [r["sync_ceiling"] for r in rows], "^-", color="#666666",
            label="synchronous ceiling: the pair in lock step")
    ax.plot(x, [r["scaling"] for r in rows], "o-", color="#2a7ab0", linewidth=2,
            label=f"elrun-train DDP (pooled {s['pooled']:.3f}, median {s['scaling'][1]:.3f})")
    ax.axhline(TARGET_SCALING, color="green", linestyle=":", label=f"target ≥ {TARGET_SCALING:g}")
    ax.set_xticks(list(x))
    ax.set_xlabel("triple (1 rank, 2 ranks, pair; against the 1-rank runs around it)")
    ax.set_ylabel("rate(2) / (2 × rate(1))")
    ax.set_title("Scaling efficiency from adjacent runs: FashionNet, batch 64/rank, 1 thread/rank",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)
