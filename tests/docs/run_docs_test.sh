#!/bin/sh
# Runs the docs test with the system's Python (it needs the standard library only), unbuffered,
# from the runfiles root, where Bazel puts the README, docs/ and the programs.
# Usage (Bazel sh_test args): run_docs_test.sh path/to/docs_drift_test.py [unittest args...]
exec /usr/bin/python3 -u -B "$@"
