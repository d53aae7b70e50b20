"""The recovery benchmark's report, from its result (docs/results/recovery_bench.json): per
launcher and worker count, the median (min-max) time from a worker's kill -9 to the job stepping
again and to passing the step it had reached, against the issue's targets, and the bar chart."""
from bench import render
from bench.render import fmt, pyplot, report_head, save_figure, verdict
from bench.render import median_cell as cell
from bench.render import median_range as summary

TITLE = "Recovery: kill -9 of a worker in a Python DDP job, elrun (exec, forkserver) vs torchrun"
TARGET_RESUME_S = {2: 0.5, 8: 1.0}  # issue 30: kill to stepping again, forkserver.


def markdown(result):
    o = result["options"]
    how = render.prose("recovery_bench", "how", o, pause_ms=int(o["pause"] * 1000))[0]
    lines = report_head(TITLE, list(result["machine"].items()), how, "see the command")
    lines += render.prose("recovery_bench", "table")
    for case in result["cases"]:
        resume = summary(case, "resume_s")
        target = ""
        if "forkserver" in case["launcher"] and case["nproc"] in TARGET_RESUME_S:
            t = TARGET_RESUME_S[case["nproc"]]
            target = f"<= {t} s: {verdict(resume[0], t) if resume else 'NO'}"
        failed = f" ({len(case['errors'])} failed)" if case["errors"] else ""
        lines.append(f"| {case['nproc']} | {case['launcher']} | {len(case['runs'])}{failed} | {cell(resume)} | "
                     f"{cell(summary(case, 'recovery_s'))} | {target} |")
    for case in result["cases"]:
        if case["errors"]:
            kinds = {}
            for error in case["errors"]:
                kind = ("no recovery within the run's timeout" if "no recovery within" in error
                        else "the job failed before it recovered")
                kinds[kind] = kinds.get(kind, 0) + 1
            lines.append(f"- failed runs, {case['launcher']} x{case['nproc']}: " +
                         ", ".join(f"{n} x {kind}" for kind, n in kinds.items()))
    lines += render.prose("recovery_bench", "notes") + ["", f"Elapsed: {fmt(result['elapsed_s'], 0)} s."]
    return "\n".join(lines)


SHORT = {"elrun": "elrun\n(exec)", "elrun --start-method forkserver": "elrun\nforkserver",
         "torchrun --monitor_interval 0.1": "torchrun\n(monitor 0.1 s)"}


def plot_result(result, path):
    plt = pyplot()
    cases = result["cases"]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{SHORT.get(c['launcher'], c['launcher'])}\n{c['nproc']} workers" for c in cases]
    values = [summary(c, "resume_s")[0] if c["runs"] else 0.0 for c in cases]
    bars = ax.bar(range(len(cases)), values, color=["#4c72b0" if "forkserver" in c["launcher"] else
                                                     "#dd8452" if "torchrun" in c["launcher"] else "#55a868"
                                                     for c in cases])
    for bar, value, case in zip(bars, values, cases):
        text = f"{value:.2f}" if case["runs"] else f"never recovered\n(0 of {len(case['errors'])})"
        if case["runs"] and case["errors"]:
            text += f"\n{len(case['errors'])} of {len(case['runs']) + len(case['errors'])} failed"
        ax.text(bar.get_x() + bar.get_width() / 2, value, text, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("kill -9 to stepping again, s (median)")
    ax.set_title("One worker killed in a Python DDP job (2-core CPU, Gloo)")
    save_figure(fig, path)
