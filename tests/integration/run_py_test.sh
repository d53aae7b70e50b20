#!/bin/sh
# Runs one integration test file with Debian's Python (the one with torch), unbuffered.
# Usage (Bazel sh_test args): run_py_test.sh path/to/some_test.py [unittest args...]
exec /usr/bin/python3 -u -B "$@"
