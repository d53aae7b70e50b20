"""The benchmarks (README.md) and the library they share, imported as `from bench import runner`
with the repository root on the path (`python3 -m bench.<name>` from the root, or Bazel's stubs):

  runner    the common options (--json, --png, --wait-idle, --smoke, --allow-dirty), the refusal to
            measure a dirty tree, retried runs, round-robin cases, private copies of the binaries
  results   result JSON stamped with commit, date and machine, paths relative to the repository
  machine   machine description, binary ids, memory, CPU taken by other processes
  render    report heads, tables, medians against targets, matplotlib on Agg
  report    docs/benchmarks.md from docs/results/*.json, through each <bench>_report.py
"""
