"""The tests' support library (//tests/support), shared by the integration tests, the benchmarks
and the chaos soak (bench/, whose own library - options, results, machine, reports - lives there):
one package that the tests and the benchmarks depend on through Bazel deps.

  paths          the checkout, the torch environment, the Bazel-built binaries (one table)
  procs          /proc reads, pidfd waits, process-group and tagged kills, a launcher-clean env
  etcd_cluster   a real etcd v3 cluster on loopback (etcd_member: its members; etcd_tls: certs)
  torchrun_compat  the reference torchrun (torch.distributed.run of the .venv)
  trace_summary  summaries of torch.profiler Chrome traces

Import it with the repository root on PYTHONPATH: from tests.support import procs.
"""
