#!/bin/sh
# Runs one integration test file with the torch 2.11 environment's Python ($PYTHON_EXEC), unbuffered.
# Usage (Bazel sh_test args): run_py_test.sh path/to/some_test.py [unittest args...]
exec "${PYTHON_EXEC:-/usr/bin/python3}" -u -B "$@"
