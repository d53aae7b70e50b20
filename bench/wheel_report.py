"""The wheel benchmark's report, from its result (docs/results/wheel_bench.json): the wheel, pip
install, and start-up of the installed elrun beside the build tree's and torchrun, as a table
and a bar chart."""
from bench.render import fmt, pyplot, report_head, save_figure

TITLE = "The wheel: what pip installs, and how fast the installed elrun starts"


def markdown(result):
    o, w = result["options"], result["wheel"]
    how = (f"- **how**: release/wheel.py on the Bazel binaries, `pip install --no-index` into "
           f"{o['installs']} fresh environments; start-up cases round robin, {o['runs']} runs each")
    lines = report_head(TITLE, result["machine"], how, result.get("load", "not recorded"))
    seconds = [i["seconds"] for i in result["installs"]]
    lines += [f"- **wheel**: `{w['name']}`, {fmt(w['bytes'] / 2**20)} MiB; tag {w['tag']}, "
              f"glibc {w['glibc_floor']} or newer",
              f"- **pip install**: median {fmt(sorted(seconds)[len(seconds) // 2], 2)} s "
              f"(min {fmt(min(seconds), 2)}, max {fmt(max(seconds), 2)}); adds "
              f"{fmt(result['installs'][0]['added_bytes'] / 2**20)} MiB to the environment", "",
              "| case | median, ms | min | max |", "|---|---|---|---|"]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {fmt(s['median_ms'])} | {fmt(s['min_ms'])} | {fmt(s['max_ms'])} |")
    lines += ["", "Commands:", ""]
    lines += [f"- {name}: `{' '.join(argv)}`" for name, argv in result["commands"].items()]
    return "\n".join(lines)


def plot_result(result, path):
    plt = pyplot()
    names = list(result["summary"])
    medians = [result["summary"][n]["median_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = ax.barh(names[::-1], medians[::-1], color="#4c72b0")
    for bar, value in zip(bars, medians[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.1f}", va="center", fontsize=8)
    ax.set_xlabel("median wall time, ms")
    ax.set_title("Installed from the wheel: start-up and a trivial 2-worker job")
    save_figure(fig, path)
