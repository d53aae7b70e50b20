"""Where things are in the checkout: the repository, the torch environment, the built binaries.

The one place that names the Bazel outputs the scripts run: when a target moves, change its line in
BINARIES. `python3 -m tests.support.paths NAME` (from the repository root) prints a binary's path (for shell scripts).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# The benchmarks (bench/, their default plots go there too).
BENCH = os.path.join(REPO, "bench")
# The torch 2.11 environment (scripts/setup.sh links it as .venv into the checkout, the workspace
# under `bazel run`; Bazel tests get it as PYTHON_EXEC) runs torchrun, the Python twin and every
# worker; the benchmark scripts themselves run on Debian's python3 (matplotlib).
PYTHON = os.environ.get("PYTHON_EXEC") or os.path.join(
    os.environ.get("BUILD_WORKSPACE_DIRECTORY") or REPO, ".venv", "bin", "python3")
TORCHRUN_COMPAT = os.path.join(HERE, "torchrun_compat.py")

# Bazel-built binaries by name: their path under bazel-bin (= their Bazel label's package/name).
BINARIES = {
    "elrun": "launcher/elrun",
    "elrun-rdzv": "agent/daemon/elrun-rdzv",
    "elrun-train": "trainer/app/elrun-train",
    "rdzv_load": "tests/load/rdzv_load",
    "etcd_load": "tests/load/etcd_load",
}


def binary(name, repo=REPO):
    """The path of the Bazel-built binary `name` (a key of BINARIES) under repo's bazel-bin, or,
    under `bazel run` / `bazel test` (REPO is then the runfiles tree, which has no bazel-bin),
    its runfile when the target is a data dependency."""
    built = os.path.join(repo, "bazel-bin", BINARIES[name])
    runfile = os.path.join(repo, BINARIES[name])
    return runfile if not os.path.exists(built) and os.access(runfile, os.X_OK) else built


def label(name):
    """The Bazel label that builds `name`, for messages: //launcher:elrun."""
    package, _, target = BINARIES[name].rpartition("/")
    return f"//{package}:{target}"


def relative(path):
    """path relative to the repository root when it lies inside it, for printed commands."""
    return path.replace(REPO + "/", "")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in BINARIES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(BINARIES)}}}")
    print(binary(sys.argv[1]))
