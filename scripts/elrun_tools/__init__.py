"""Helpers shared by elrun's benchmarks (scripts/bench), scripts (chaos_soak.py) and integration
tests (tests/integration): one package, so that no test imports a benchmark and no benchmark
imports a test.

  paths          the checkout, the torch environment, the Bazel-built binaries (one table)
  procs          /proc reads, pidfd waits, process-group and tagged kills, a launcher-clean env
  machine        machine description, binary ids, memory, CPU taken by other processes
  bench          a benchmark's options, retried runs, case state, private binary copies, formats
  results        result JSON stamped with commit, date and machine; read back by the reports
  plots          matplotlib on Agg and the figure epilogue
  etcd_cluster   a real etcd v3 cluster on loopback (etcd_member: its members; etcd_tls: certs)
  torchrun_compat  the reference torchrun (torch.distributed.run of the .venv)
  trace_summary  summaries of torch.profiler Chrome traces

Import it with scripts/ on sys.path: sys.path.insert(0, <repo>/scripts); import elrun_tools.procs.
"""
