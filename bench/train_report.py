"""The training benchmark's report, from its result (docs/results/train_bench.json): throughput
and scaling efficiency against the Python twin and the machine's ceilings, wall times, every run,
commands, and the chart. report_header and commands_block serve scaling_report.py too.
"""
import shlex
from types import SimpleNamespace

from bench import render
from bench.render import fmt, pyplot, report_head, save_figure, stats
from bench.train_jobs import ELRUN, GLOO, LABELS, NCHW, PAIR, PY, SYNC, Config, shown  # noqa: F401
from tests.support.paths import REPO

TITLE = "Training: elrun-train vs a Python PyTorch DDP twin"
TARGET_RATIO = 1.15    # elrun-train samples/s at 2 ranks >= 1.15 x the Python twin's
TARGET_SCALING = 0.95  # elrun-train rate(2 ranks) / (2 x rate(1 rank)) >= 0.95


def configs_of(result):
    """The result's configurations as Config objects, and their commands by key."""
    configs, commands = [], {}
    for c in result["configs"]:
        config = Config(c["kind"], c["nproc"])
        config.runs = c["runs"]
        configs.append(config)
        if c.get("command"):
            commands[config.key] = c["command"]
    return configs, commands


def markdown(result):
    """The report of one result, as train_bench.py prints it."""
    args = SimpleNamespace(**result["options"])
    configs, commands = configs_of(result)
    return report(args, configs, commands, summary(configs), list(result["machine"].items()),
                  result["load"], result["elapsed_s"])


def plot_result(result, path):
    configs, _ = configs_of(result)
    plot(configs, summary(configs), path)


def get(configs, kind, nproc):
    return next((c for c in configs if c.kind == kind and c.nproc == nproc), None)


def med(c):
    return stats(c.rates())[0] if c and c.runs else None


def meets(value, target):
    return "yes" if value >= target else "NO"


def rate_cell(c):
    if c is None or not c.runs:
        return "—"
    m, lo, hi = stats(c.rates())
    return f"{fmt(m)} ({fmt(lo)}–{fmt(hi)})"


def summary(configs):
    e1, e2 = med(get(configs, ELRUN, 1)), med(get(configs, ELRUN, 2))
    p1, p2 = med(get(configs, PY, 1)), med(get(configs, PY, 2))
    s2, pair = med(get(configs, SYNC, 2)), med(get(configs, PAIR, 2))
    a1, a2, g2 = med(get(configs, NCHW, 1)), med(get(configs, NCHW, 2)), med(get(configs, GLOO, 2))
    sync = stats([r["end"]["sync_rate"] for r in get(configs, PAIR, 2).runs])[0]
    return {"e1": e1, "e2": e2, "p1": p1, "p2": p2, "s2": s2, "pair": pair,
            "a1": a1, "a2": a2, "g2": g2, "a_scaling": a2 / (2 * a1), "a_ratio": a2 / p2,
            "g_scaling": g2 / (2 * e1), "g_ratio": g2 / p2,
            "e_scaling": e2 / (2 * e1), "p_scaling": p2 / (2 * p1), "s_scaling": s2 / (2 * e1),
            "ceiling": pair / (2 * e1), "e_of_ceiling": e2 / pair,
            "lockstep": stats([r["end"]["lockstep"] for r in get(configs, PAIR, 2).runs])[0],
            "sync_ceiling": sync / (2 * e1), "e_of_sync": e2 / sync,
            "ratio": e2 / p2, "s_ratio": s2 / p2, "ratio1": e1 / p1}


def prose(section, /, *maps, **values):
    return render.prose("train_bench", section, *maps, **values)


def table(configs, s):
    kinds = {"elrun": ELRUN, "python": PY, "sync": SYNC, "pair": PAIR, "nchw": NCHW, "gloo": GLOO}
    return prose("table", label={name: LABELS[kind] for name, kind in kinds.items()},
                 cell={f"{name}{n}": rate_cell(get(configs, kind, n)) for name, kind in kinds.items() for n in (1, 2)},
                 target_scaling=TARGET_SCALING, meets_scaling=meets(s["e_scaling"], TARGET_SCALING),
                 target_ratio=TARGET_RATIO, meets_ratio=meets(s["ratio"], TARGET_RATIO),
                 sync_rate=fmt(s["sync_ceiling"] * 2 * s["e1"]), **s)


def runs_table(configs):
    lines = []
    for c in configs:
        for r in c.runs:
            e = r["end"]
            share = f"{100 * r['foreign']:.0f}%" if r["foreign"] is not None else "?"
            steps = (f"{e['step_ms_p10']:.1f} / {e['step_ms_p50']:.1f} / {e['step_ms_p90']:.1f}"
                     if "step_ms_p50" in e else "—")
            off = " / ".join(f"{100 * x:.1f}%" for x in e["off_cpu"]) if "off_cpu" in e else "—"
            loop = (f"{e['loop_runqueue_s']:.2f} / {e['loop_blocked_s']:.2f}"
                    if "loop_blocked_s" in e and c.kind != PAIR else "—")
            lock = f"{e['lockstep']:.3f}×" if "lockstep" in e else "—"
            lines.append(f"| {c.kind} | {c.nproc} | {r['round']} | {e['samples_per_s']:.1f} | "
                         f"{e['seconds']:.2f} | {steps} | {off} | {loop} | {lock} | {r['wall_s']:.1f} | "
                         f"{e['test_accuracy']:.4f} | {share} |")
    return lines


def wall_table(configs):
    lines = []
    for c in configs:
        walls = [r["wall_s"] for r in c.runs]
        trains = [r["end"]["seconds"] for r in c.runs]
        over = [w - t for w, t in zip(walls, trains)]
        m, lo, hi = stats(walls)
        lines.append(f"| {c.kind} | {c.nproc} | {m:.1f} ({lo:.1f}–{hi:.1f}) | "
                     f"{stats(trains)[0]:.1f} | {stats(over)[0]:.1f} |")
    return lines


def accuracy_check(configs):
    parts = []
    for nproc in (1, 2):
        accs = {kind: sorted({r["end"]["test_accuracy"] for r in get(configs, kind, nproc).runs})
                for kind in (NCHW, ELRUN, PY)}
        same = accs[NCHW] == accs[PY]
        parts.append(f"{nproc} rank(s): elrun-train --memory-format contiguous "
                     f"{', '.join(f'{a:.4f}' for a in accs[NCHW])}, Python "
                     f"{', '.join(f'{a:.4f}' for a in accs[PY])} ({'equal' if same else 'differ'}),"
                     f" elrun-train in channels-last {', '.join(f'{a:.4f}' for a in accs[ELRUN])}")
    return "; ".join(parts) + prose("accuracy")[0]


def report_header(title, args, info, plan, unit, load, elapsed):
    """A report's title and its machine, workload (`plan`: how the runs were ordered) and load."""
    wait = prose("wait", wait_idle=args.wait_idle, unit=unit)[0] if args.wait_idle > 0 else ""
    return report_head(title, info, prose("how", batch_size=args.batch_size, max_steps=args.max_steps,
                                          plan=plan, wait=wait, elapsed=elapsed)[0], load)


def report(args, configs, commands, s, info, load, elapsed):
    out = report_header("Training benchmark: elrun-train vs a Python PyTorch DDP twin", args, info,
                        f"{args.runs} runs per configuration, interleaved round-robin", "round",
                        load, elapsed)
    out += table(configs, s)
    out += prose("notes", runs=args.runs, e1_text=fmt(s["e1"]), **s)
    out += wall_table(configs)
    out += prose("wall_notes", accuracy=accuracy_check(configs))
    out += runs_table(configs)
    out += prose("runs_notes")
    out += commands_block(args, [(c.key, commands.get(c.key), c.kind == PAIR) for c in configs])
    return "\n".join(out)


def commands_block(args, runs):
    """The report's commands, one per (key, argv, is the pair) with an argv: repository paths
    relative, the per-run files named METRICS and METRICS.steps."""
    out = prose("commands")
    for key, argv, pair in runs:
        if not argv:
            continue
        argv = shown(args, argv)
        for option, name in (("--metrics-file", "METRICS"), ("--step-times-file", "METRICS.steps")):
            if option in argv:
                argv[argv.index(option) + 1] = name
        out.append(shlex.join(argv).replace(REPO + "/", "") + f"  # {key}"
                   + (" (two at once, each with its own METRICS)" if pair else ""))
    return out + ["```", ""]


def plot(configs, s, path):
    plt = pyplot()

    colors = {ELRUN: "#2a7ab0", PY: "#c0504d", SYNC: "#7fb3d5"}
    short = {ELRUN: "elrun-train", PY: "Python twin (torchrun)", SYNC: "elrun-train --sync-bn"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 3]})
    width = 0.26
    top = 0
    for i, kind in enumerate([ELRUN, PY, SYNC]):
        for j, nproc in enumerate([1, 2]):
            c = get(configs, kind, nproc)
            if c is None or not c.runs:
                continue
            m, lo, hi = stats(c.rates())
            x = j + (i - 1) * width
            ax1.bar(x, m, width, color=colors[kind], yerr=[[m - lo], [hi - m]], capsize=4,
                    label=short[kind] if j == 1 or kind != SYNC else None)
            ax1.text(x, hi * 1.01, f"{m:.0f}", ha="center", va="bottom", fontsize=8)
            top = max(top, hi)
    handles, labels = ax1.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax1.legend(uniq.values(), uniq.keys(), fontsize=8, loc="upper left")
    # (The ceiling configuration is drawn only in the scaling panel.)
    ax1.set_xticks([0, 1])
    ax1.set_xticklabels(["1 rank", "2 ranks"])
    ax1.set_ylim(0, top * 1.25)
    ax1.set_ylabel("samples/s (median; whiskers min/max)")
    ax1.set_title(f"Throughput (elrun/Python at 2 ranks: {s['ratio']:.2f}×, "
                  f"target ≥ {TARGET_RATIO:g}×)", fontsize=10)

    bars = [("elrun-train", s["e_scaling"], colors[ELRUN]),
            ("Python twin", s["p_scaling"], colors[PY]),
            ("elrun-train\n--sync-bn [a]", s["s_scaling"], colors[SYNC]),
            ("ceiling: 2 × 1-rank\njobs at once [a]", s["ceiling"], "#999999"),
            ("synchronous\nceiling [a]", s["sync_ceiling"], "#bbbbbb"),
            ("--memory-format\ncontiguous", s["a_scaling"], "#a6cee3"),
            ("--allreduce\ngloo [a]", s["g_scaling"], "#b2df8a")]
    for i, (name, v, color) in enumerate(bars):
        ax2.bar(i, v, 0.6, color=color)
        ax2.text(i, v + 0.01, f"{v:.3f}", ha="center", va="bottom", fontsize=9)
    ax2.axhline(TARGET_SCALING, color="green", linestyle="--", linewidth=1,
                label=f"elrun target ≥ {TARGET_SCALING:g}")
    ax2.axhline(1.0, color="gray", linewidth=0.5)
    ax2.set_xticks(range(len(bars)))
    ax2.set_xticklabels([b[0] for b in bars], fontsize=8)
    ax2.set_ylim(0, max(1.1, max(b[1] for b in bars) * 1.15))
    ax2.set_title("Scaling efficiency rate(2) / (2 × rate(1))", fontsize=10)
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle("elrun-train vs Python PyTorch DDP twin: FashionNet, batch 64/rank, 1 thread/rank "
                 "([a] vs plain-BN elrun-train at 1 rank)", fontsize=10)
    save_figure(fig, path)
