"""The benchmarks and the library they share (bench/README.md says which module holds what)."""
