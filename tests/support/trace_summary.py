#!/usr/bin/env python3
"""Where a training step's time goes, from PyTorch profiler traces (Chrome JSON, as Kineto writes).

Reads traces that mark each step with a "ProfilerStep#N" annotation: elrun-train's
--profile-steps/--profile-trace, or a Python loop under torch.profiler (fashion_twin.py
--profile-steps, or prof.step() with a schedule). For each trace, per step:

- wall: the mean length of the step annotations;
- host: the operators' self time on all threads (an operator's time minus the operators and
  CUDA runtime calls inside it), and the CUDA runtime's own time (kernel launches, copies, syncs);
- GPU: the union of kernel, copy and memset intervals (time the GPU was doing something), the
  kernel count and the launch count;

then the operators and the kernels that cost most. Several traces print side by side:

    trace_summary.py elrun.json.0 twin.json --labels elrun-train twin [--top 12] [--json F]
"""
import argparse
import collections
import json
import sys

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver")


class TraceError(Exception):
    pass


def load_events(path):
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError("%s: not a readable Chrome trace (%s)" % (path, e))
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise TraceError("%s: no traceEvents list" % path)
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def union_length(intervals):
    """Total length covered by [start, end) intervals."""
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def self_times(events):
    """Self time (us) per (category, name) of nested host events, per thread: each event's
    duration minus the durations of the events directly inside it."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    totals = collections.defaultdict(float)
    counts = collections.Counter()
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [end, name, children's time]
        for e in thread_events:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                done = stack.pop()
                totals[done[1]] += done[3] - done[2]
            if stack:
                stack[-1][2] += min(end, stack[-1][0]) - start
            key = (e.get("cat"), e["name"])
            stack.append([end, key, 0.0, e["dur"]])
            counts[key] += 1
        for done in stack:
            totals[done[1]] += done[3] - done[2]
    return totals, counts


def summarize(path, top):
    events = load_events(path)
    steps = [e for e in events
             if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise TraceError("%s: no ProfilerStep#N annotations; profile with elrun-train --profile-steps "
                         "or torch.profiler with prof.step()" % path)
    start = min(e["ts"] for e in steps)
    end = max(e["ts"] + e["dur"] for e in steps)
    n = len(steps)

    def inside(e):
        return start <= e["ts"] < end

    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and inside(e)]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and inside(e)]
    host_self, host_counts = self_times(host)
    runtime_us = sum(v for (cat, _), v in host_self.items() if cat != "cpu_op")
    launches = sum(1 for e in host if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in e["name"])
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    gpu_time = collections.defaultdict(float)
    gpu_count = collections.Counter()
    for e in gpu:
        gpu_time[e["name"]] += e["dur"]
        gpu_count[e["name"]] += 1
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    wall_us = sum(e["dur"] for e in steps)

    def ms(us):
        return us / 1000.0 / n

    return {
        "trace": path,
        "steps": n,
        "wall_ms": ms(wall_us),
        "host_op_self_ms": ms(sum(host_self.values()) - runtime_us),
        "cuda_runtime_ms": ms(runtime_us),
        "gpu_busy_ms": ms(busy),
        "gpu_busy_fraction": busy / wall_us if wall_us else 0.0,
        "kernels": len(kernels) / n,
        "launches": launches / n,
        "copies": sum(1 for e in gpu if e.get("cat") == "gpu_memcpy") / n,
        "top_host": [(k[1], ms(v), host_counts[k] / n) for k, v in
                     sorted(host_self.items(), key=lambda kv: -kv[1])[:top]],
        "top_gpu": [(k, ms(v), gpu_count[k] / n) for k, v in sorted(gpu_time.items(), key=lambda kv: -kv[1])[:top]],
    }


def shorten(name, width=70):
    return name if len(name) <= width else name[:width - 3] + "..."


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--labels", nargs="*", default=None)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", help="also write the summaries here")
    args = parser.parse_args(argv)
    labels = args.labels or args.traces
    if len(labels) != len(args.traces):
        parser.error("--labels: %d labels for %d traces" % (len(labels), len(args.traces)))
    try:
        summaries = [summarize(t, args.top) for t in args.traces]
    except TraceError as e:
        print("trace_summary: %s" % e, file=sys.stderr)
        return 1
    rows = [("steps profiled", "steps", "%d"),
            ("wall, ms/step", "wall_ms", "%.3f"),
            ("host operators' self time, ms/step", "host_op_self_ms", "%.3f"),
            ("CUDA runtime calls, ms/step", "cuda_runtime_ms", "%.3f"),
            ("GPU busy, ms/step", "gpu_busy_ms", "%.3f"),
            ("GPU busy, fraction of wall", "gpu_busy_fraction", "%.2f"),
            ("kernels/step", "kernels", "%.1f"),
            ("launch calls/step", "launches", "%.1f"),
            ("copies/step", "copies", "%.1f")]
    print("| | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for title, key, fmt in rows:
        print("| %s | %s |" % (title, " | ".join(fmt % s[key] for s in summaries)))
    for label, s in zip(labels, summaries):
        print("\n%s: host operators by self time (ms/step, calls/step)" % label)
        for name, t, c in s["top_host"]:
            print("  %8.3f  %6.1f  %s" % (t, c, shorten(name)))
        if s["top_gpu"]:
            print("%s: GPU work by time (ms/step, count/step)" % label)
            for name, t, c in s["top_gpu"]:
                print("  %8.3f  %6.1f  %s" % (t, c, shorten(name)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(zip(labels, summaries)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
