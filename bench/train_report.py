"""The training benchmark's report, from its result (docs/results/train_bench.json): throughput
and scaling efficiency against the Python twin and the machine's ceilings, wall times, every run,
commands, and the chart. report_header and commands_block serve scaling_report.py too.
"""
import shlex
from types import SimpleNamespace

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


def table(configs, s):
    lines = ["| Configuration | samples/s, 1 rank | samples/s, 2 ranks | scaling efficiency "
             "rate(2) / (2 × rate(1)) | ÷ Python at 2 ranks |",
             "|---|---:|---:|---:|---:|"]
    lines.append(f"| {LABELS[ELRUN]} | {rate_cell(get(configs, ELRUN, 1))} | "
                 f"{rate_cell(get(configs, ELRUN, 2))} | {s['e_scaling']:.3f} "
                 f"(target ≥ {TARGET_SCALING:g}: **{meets(s['e_scaling'], TARGET_SCALING)}**) | "
                 f"{s['ratio']:.2f}× (target ≥ {TARGET_RATIO:g}×: "
                 f"**{meets(s['ratio'], TARGET_RATIO)}**) |")
    lines.append(f"| {LABELS[PY]} | {rate_cell(get(configs, PY, 1))} | "
                 f"{rate_cell(get(configs, PY, 2))} | {s['p_scaling']:.3f} | 1.00× |")
    lines.append(f"| {LABELS[SYNC]} | — | {rate_cell(get(configs, SYNC, 2))} | "
                 f"{s['s_scaling']:.3f} [a] | {s['s_ratio']:.2f}× [b] |")
    lines.append(f"| {LABELS[PAIR]} | — | {rate_cell(get(configs, PAIR, 2))} | "
                 f"{s['ceiling']:.3f} [a] | — |")
    lines.append(f"| the synchronous ceiling: the pair's steps in lock step [e] | — | "
                 f"{fmt(s['sync_ceiling'] * 2 * s['e1'])} | {s['sync_ceiling']:.3f} [a] | — |")
    lines.append(f"| {LABELS[NCHW]} | {rate_cell(get(configs, NCHW, 1))} | "
                 f"{rate_cell(get(configs, NCHW, 2))} | {s['a_scaling']:.3f} | {s['a_ratio']:.2f}× |")
    lines.append(f"| {LABELS[GLOO]} | — | {rate_cell(get(configs, GLOO, 2))} | "
                 f"{s['g_scaling']:.3f} [a] | {s['g_ratio']:.2f}× |")
    return lines


def runs_table(configs):
    lines = ["| Configuration | Ranks | Round | samples/s | train s | step ms p10 / p50 / p90 | "
             "off CPU, per rank | rank 0: run queue / blocked s | lock step | "
             "wall s (launch to exit) | test accuracy | others' CPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
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
    lines = ["| Configuration | Ranks | wall s, median (min–max) | train s, median | "
             "wall − train, median |", "|---|---:|---:|---:|---:|"]
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
    return ("; ".join(parts) + " (NHWC convolutions sum in another order, so the default's accuracy may differ "
            "in the last digits; at 2 ranks all may differ slightly: Python's DDP broadcasts "
            "rank 0's BatchNorm running stats before every forward, elrun-train only at start, so "
            "rank 1 evaluates its shard with other running stats)")


def report_header(title, args, info, plan, unit, load, elapsed):
    """A report's title and its machine, workload (`plan`: how the runs were ordered) and load."""
    return report_head(
        title, info,
        f"- **workload**: FashionNet on Fashion-MNIST, batch {args.batch_size} per rank, "
        f"--threads 1, --max-steps {args.max_steps}, --lr-schedule constant, seed 0; {plan}"
        + (f", waited up to {args.wait_idle:g} s for an idle machine before each {unit}"
           if args.wait_idle > 0 else "") + f"; benchmark took {elapsed:.0f} s", load)


def report(args, configs, commands, s, info, load, elapsed):
    out = report_header("Training benchmark: elrun-train vs a Python PyTorch DDP twin", args, info,
                        f"{args.runs} runs per configuration, interleaved round-robin", "round",
                        load, elapsed)
    out += table(configs, s)
    out += [
        "",
        f"samples/s: median (min–max) over {args.runs} runs of the `samples_per_s` in each run's "
        "`--metrics-file` end record (rank 0), which both trainers compute alike: steps × batch × "
        "world size over the time from just before the first training step to the end of the last "
        "(data loading, process-group and DDP set-up, evaluation and launcher start-up excluded). "
        "Ratios and efficiencies are of medians.",
        f"[a] against the plain-BatchNorm elrun-train at 1 rank ({fmt(s['e1'])} samples/s). "
        f"[b] against the plain-BatchNorm Python twin at 2 ranks: not the same work (SyncBatchNorm "
        "all-reduces batch statistics in every forward and backward).",
        f"[c] The machine's ceiling: two independent 1-rank elrun-train jobs started at the same "
        "moment, the rate their two end records report, summed. They do not communicate, so "
        "their shortfall from 2 × rate(1 rank) is what two ranks lose on this machine to sharing "
        "its cores, caches and memory bandwidth alone. elrun-train's DDP at 2 ranks reached "
        f"{s['e_of_ceiling']:.3f} of this ceiling (scaling {s['e_scaling']:.3f} against a ceiling "
        f"of {s['ceiling']:.3f}).",
        "[e] The pair's two jobs also wrote every step's time (`--step-times-file`). Had they run in "
        "lock step, as the ranks of a data-parallel job do, each step would have taken as long as "
        "the slower job's: sum over k of max(a_k, b_k) against the mean of the two sums is the "
        f"lock-step factor (median {s['lockstep']:.3f}×), and the pair's rate over it the best a "
        "synchronous 2-rank job could have reached in that round (median over rounds). On a host "
        "whose CPUs slow down and recover independently, this is below the pair's ceiling [c] by "
        "what waiting for the slower CPU costs; no implementation of synchronous data parallelism "
        f"gets past it. elrun-train's DDP at 2 ranks reached {s['e_of_sync']:.3f} of it.",
        "[d] Ablations of elrun-train's two defaults that the twin does not share. --memory-format "
        "contiguous: the convolutions' weights and activations in NCHW, as the twin's (the default "
        "on CPU is channels-last, NHWC, where oneDNN's convolutions and ATen's pooling and batch "
        "norm are vectorised over channels: same parameters, same results up to float rounding). "
        "--allreduce gloo: DDP's buckets over "
        "Gloo's TCP loopback, as the twin's DDP (the default sums them in a shared-memory segment "
        "when all ranks are on one host). Scaling of the gloo row is against the default 1-rank "
        "rate [a], as one rank communicates nothing.",
        "",
        "Wall time of a run, launch to exit (includes launcher start-up, rendezvous, interpreter "
        "and library loading, dataset loading, training and the test-set evaluation):",
        "",
    ]
    out += wall_table(configs)
    out += [
        "",
        "wall − train is mostly start-up (torchrun and each Python worker import torch: seconds "
        "each), dataset loading and the test-set evaluation (10,000 images in chunks of 1,000 per "
        "rank, in both trainers). The Python twin keeps glibc's default malloc settings, under "
        "which the ~100 MB activations of a 1,000-image chunk are above the largest dynamic mmap "
        "threshold (32 MiB) and are mmap-ed and page-faulted afresh for every operator; "
        "elrun-train raises the threshold to 256 MiB at start (mallopt), so its evaluation reuses "
        "heap memory. The training steps (batch 64, ~6 MB activations) are under the threshold in "
        "both.",
        "",
        "Same computation: at 1 rank both trainers start from identical weights (same seed, same "
        "torch 2.11, modules built in the same order) and read the same batches, so with the "
        "same Linear kernel their test accuracies after the run should be equal: " + accuracy_check(configs) + ".",
    ]
    out += ["", "Every run:", ""]
    out += runs_table(configs)
    out += ["", "step ms: elrun-train's end record, percentiles over the run's steps of rank 0's "
            "training step (data to optimizer step, communication included; for the pair, the first "
            "job's). A data-parallel step ends when the slower rank's does, so its spread shows the "
            "ranks' step-to-step jitter. The twin does not report it. off CPU: the share of each "
            "rank's step time its training thread was not on a CPU (`--step-times-file`: wall minus "
            "thread CPU time); for DDP mostly waiting for the slower rank's gradients. run queue / "
            "blocked: rank 0's whole training loop, from the end record (`loop_runqueue_s`: runnable "
            "but waiting for a CPU; `loop_blocked_s`: sleeping). lock step: the pair's factor [e]."]
    out += commands_block(args, [(c.key, commands.get(c.key), c.kind == PAIR) for c in configs])
    return "\n".join(out)


def commands_block(args, runs):
    """The report's commands, one per (key, argv, is the pair) with an argv: repository paths
    relative, the per-run files named METRICS and METRICS.steps."""
    out = ["", "Commands (run from the repository root; METRICS is a fresh file per run):", "", "```"]
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
