#!/bin/sh
# //bench:smoke_test: every benchmark's --smoke run (bench/smoke_test.py) on Debian's python3
# (matplotlib), with the runfiles root (Bazel runs the test there) on PYTHONPATH.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec /usr/bin/python3 -u -B bench/smoke_test.py "$@"
