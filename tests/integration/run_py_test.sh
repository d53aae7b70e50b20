#!/bin/sh
# Runs one integration test file with the torch 2.11 environment's Python ($PYTHON_EXEC), unbuffered,
# with the runfiles root (Bazel runs the test there) on PYTHONPATH, so that the test imports its
# support library as tests.support (//tests/support).
# Usage (Bazel sh_test args): run_py_test.sh path/to/some_test.py [unittest args...]
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON_EXEC:-/usr/bin/python3}" -u -B "$@"
