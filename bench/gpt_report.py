"""The report of gpt_bench.py, from its result (docs/results/gpt_bench.json, or with --workload mlp
gpt_bench_mlp.json): tokens/s (the MLP: samples/s), step time and peak RSS per rank of
elrun-train's ddp and fsdp against PyTorch's DDP and FSDP2 on the same model, the targets, the
commands, and the plot.
"""
import shlex
import statistics

from bench import render
from bench.render import pyplot, report_head, save_figure

TITLE = "GPT: elrun-train against PyTorch DDP and FSDP2"
MLP_TITLE = "The 32 x 2048 MLP: elrun-train against PyTorch DDP and FSDP2"
TARGET_SPEEDUP = 1.2  # elrun fsdp vs FSDP2 and elrun ddp vs DDP, tokens/s.
LABELS = {
    "elrun-ddp": "elrun-train --strategy ddp (C++ DDP)",
    "torch-ddp": "gpt_twin.py, torch DDP",
    "elrun-fsdp": "elrun-train --strategy fsdp (C++ FULL_SHARD)",
    "torch-fsdp2": "gpt_twin.py, torch FSDP2 (fully_shard per block + root)",
    "torch-ddp-compile": "gpt_twin.py, torch DDP + torch.compile",
    "torch-fsdp2-compile": "gpt_twin.py, torch FSDP2 + torch.compile per block",
}
MIB = 2.0 ** 20


def is_mlp(result):
    return result["options"].get("workload") == "mlp"


def rate_key(result):
    """The per-run rate the report ranks by: tokens/s for the GPT, samples/s for the MLP."""
    return "samples_per_s" if is_mlp(result) else "tokens_per_s"


def summary(result):
    """Per case with runs: medians over runs of the rate (tokens/s, or samples/s for the MLP),
    step ms, the larger rank's peak RSS, baseline and peak above baseline (MiB)."""
    out = {}
    key = rate_key(result)
    for case, c in result["cases"].items():
        runs = c["runs"]
        if not runs:
            continue
        med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
        out[case] = {
            "tokens_per_s": med(lambda r: r[key]),
            "tokens_min": min(r[key] for r in runs),
            "tokens_max": max(r[key] for r in runs),
            "step_ms": med(lambda r: r["step_ms"]),
            "peak": med(lambda r: max(r["peak_rss"])) / MIB,
            "baseline": med(lambda r: max(r["baseline_rss"])) / MIB,
            "above": med(lambda r: max(p - b for p, b in zip(r["peak_rss"], r["baseline_rss"]))) / MIB,
            "foreign": max((r["foreign_cpu"] or 0) for r in runs),
        }
    return out


def targets(s, unit="tokens/s"):
    rows = []
    for ours, theirs, what in (("elrun-fsdp", "torch-fsdp2", f"fsdp {unit} vs FSDP2"),
                               ("elrun-ddp", "torch-ddp", f"ddp {unit} vs PyTorch DDP")):
        if ours in s and theirs in s:
            ratio = s[ours]["tokens_per_s"] / s[theirs]["tokens_per_s"]
            rows.append((what, f">= {TARGET_SPEEDUP}x", f"{ratio:.2f}x", "yes" if ratio >= TARGET_SPEEDUP else "NO"))
    if "elrun-fsdp" in s and "torch-fsdp2" in s:
        a, b = s["elrun-fsdp"]["above"], s["torch-fsdp2"]["above"]
        rows.append(("fsdp peak RSS above baseline vs FSDP2", "<= 1.00x", f"{a:.0f} / {b:.0f} MiB = {a / b:.2f}x",
                     "yes" if a <= b else "NO"))
    return rows


def prose(section, /, *maps, **values):
    return render.prose("gpt_bench", section, *maps, **values)


def markdown(result):
    o = result["options"]
    s = summary(result)
    unit = "samples/s" if is_mlp(result) else "tokens/s"
    if is_mlp(result):
        hidden = o["mlp_hidden"]
        model = (f"MLP 784-{hidden[0]}x{len(hidden)}-10" if len(set(hidden)) == 1
                 else "MLP 784-" + "-".join(map(str, hidden)) + "-10")
        plan = prose("mlp_plan", o, model=model)[0]
    else:
        plan = prose("gpt_plan", o)[0]
    how = prose("how", o, plan=plan, elapsed=result["elapsed_s"])[0]
    out = report_head(MLP_TITLE if is_mlp(result) else TITLE, list(result["machine"].items()), how,
                      result["load"])
    out += prose("table", unit=unit)
    for case, c in result["cases"].items():
        label = LABELS.get(case, case)
        if case not in s:
            out.append(f"| {label} | FAILED: {c.get('error') or 'no runs'} | | | | | |")
            continue
        r = s[case]
        flag = " (noisy)" if r["foreign"] > 0.10 else ""
        digits = 1 if is_mlp(result) else 0
        tokens = f"{r['tokens_per_s']:.{digits}f} ({r['tokens_min']:.{digits}f}–{r['tokens_max']:.{digits}f})"
        out.append(f"| {label} | {tokens} | "
                   f"{r['step_ms']:.1f} | {r['peak']:.0f} | {r['baseline']:.0f} | {r['above']:.0f} | "
                   f"{100 * r['foreign']:.0f}%{flag} |")
    rows = targets(s, unit)
    if rows:
        out += prose("targets")
        out += [f"| {w} | {t} | {m} | {ok} |" for w, t, m, ok in rows]
    out += prose("notes", unit=unit, context="" if is_mlp(result) else " x context")
    out += [shlex.join(argv) for argv in result["commands"].values()]
    out += ["```"]
    return "\n".join(out)


def plot_result(result, path):
    s = summary(result)
    cases = [c for c in result["cases"] if c in s]
    if not cases:
        return
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:blue" if c.startswith("elrun") else "tab:orange" for c in cases]
    left.barh(cases, [s[c]["tokens_per_s"] for c in cases], color=colors)
    left.set_xlabel(("samples/s" if is_mlp(result) else "tokens/s") + " (2 ranks, median)")
    left.invert_yaxis()
    right.barh(cases, [s[c]["baseline"] for c in cases], color="lightgray", label="baseline")
    right.barh(cases, [s[c]["above"] for c in cases], left=[s[c]["baseline"] for c in cases], color=colors,
               label="peak above baseline")
    right.set_xlabel("peak RSS per rank (MiB)")
    right.invert_yaxis()
    right.legend(loc="lower right", fontsize=8)
    o = result["options"]
    if is_mlp(result):
        fig.suptitle(f"MLP 784-{o['mlp_hidden'][0]}x{len(o['mlp_hidden'])}-10, batch {o['batch_size']}/rank, "
                     "2 ranks, CPU + Gloo")
    else:
        fig.suptitle(f"GPT {o['layers']}x{o['width']}, context {o['context']}, batch {o['batch_size']}/rank, "
                     "2 ranks, CPU + Gloo")
    save_figure(fig, path)
