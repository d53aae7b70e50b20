"""The regroup benchmark's report, from its result (docs/results/regroup_bench.json): per fault and
launcher, the median (min-max) time from the fault to rank 0 stepping again and to passing the
step reached, the final test accuracy, against issue 30's targets, and the bar chart."""
from bench import render
from bench.render import fmt, pyplot, report_head, save_figure, verdict
from bench.render import median_cell as cell
from bench.render import median_range as summary

TITLE = "Regroup: one fault in an elrun-train job, group restart vs --keep-survivors vs torchrun"
# Issue 30: a worker's kill -9 costs <= 0.3 s; a SIGSTOP <= --worker-timeout + 0.5 s.
TARGET_S = {"kill-1": 0.3, "kill-0": 0.3, "stop-1": 2.5}
FAULT_WORDS = {"kill-1": "kill -9 of rank 1", "kill-0": "kill -9 of rank 0 (store host)",
               "stop-1": "SIGSTOP of rank 1 (--worker-timeout 2)"}


def markdown(result):
    o = result["options"]
    strategy = o.get("strategy", "ddp")
    recorded = any("step_ms" in run for case in result["cases"] for run in case["runs"])
    parallel = ("DDP through shared memory" if strategy == "ddp" else
                f"--strategy {strategy}, under --keep-survivors a copy of the neighbour's shards every "
                f"{o['shard_copy_every']} steps")
    step_time = render.prose("regroup_bench", "step_time")[0] if recorded else ""
    how = render.prose("regroup_bench", "how", o, parallel=parallel, step_time=step_time)[0]
    lines = report_head(TITLE, list(result["machine"].items()), how, "see the command")
    lines += render.prose("regroup_bench", "table")
    for case in result["cases"]:
        recovery = summary(case, "recovery_s")
        target = ""
        if case["launcher"] == "elrun --keep-survivors" and case["fault"] in TARGET_S:
            t = TARGET_S[case["fault"]]
            target = f"<= {t} s: {verdict(recovery[0], t) if recovery else 'NO'}"
        failed = f" ({len(case['errors'])} failed)" if case["errors"] else ""
        # Results from before step_ms was recorded have none.
        step_ms = cell(summary(case, "step_ms"), 1) if recorded else "not recorded"
        lines.append(f"| {FAULT_WORDS.get(case['fault'], case['fault'])} | {case['launcher']} | "
                     f"{len(case['runs'])}{failed} | {cell(summary(case, 'resume_s'))} | {cell(recovery)} | "
                     f"{step_ms} | {cell(summary(case, 'accuracy'), 4)} | {target} |")
    for case in result["cases"]:
        for error in case["errors"][:2]:
            lines.append(f"- failed run, {case['launcher']}, {case['fault']}: `{error[-200:]}`")
    redone = ("nothing is redone in place" if strategy == "ddp" else
              "in place, the steps since the last copy are redone")
    lines += render.prose("regroup_bench", "notes", redone=redone) + ["", f"Elapsed: {fmt(result['elapsed_s'], 0)} s."]
    return "\n".join(lines)


COLORS = {"elrun (group restart)": "#55a868", "elrun --keep-survivors": "#4c72b0",
          "elrun --keep-survivors, no spare (--tee 3)": "#8172b2", "torchrun --monitor_interval 0.1": "#dd8452"}


def plot_result(result, path):
    plt = pyplot()
    cases = result["cases"]
    faults = list(dict.fromkeys(c["fault"] for c in cases))
    names = list(dict.fromkeys(c["launcher"] for c in cases))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, fault in enumerate(faults):
            case = next((c for c in cases if c["fault"] == fault and c["launcher"] == name), None)
            s = summary(case, "recovery_s") if case else None
            if s is None:
                continue
            xs.append(i + (j - (len(names) - 1) / 2) * width)
            ys.append(s[0])
        bars = ax.bar(xs, ys, width, label=name, color=COLORS.get(name))
        render.bar_labels(ax, bars, [f"{y:.2f}" for y in ys], fontsize=7)
    ax.set_xticks(range(len(faults)))
    ax.set_xticklabels([FAULT_WORDS.get(f, f) for f in faults], fontsize=8)
    ax.set_ylabel("fault to past the step reached, s (median)")
    strategy = result["options"].get("strategy", "ddp")
    ax.set_title(f"One fault in a {result['options']['nproc']}-worker elrun-train job, {strategy} (2-core CPU)")
    ax.legend(fontsize=7)
    save_figure(fig, path)
