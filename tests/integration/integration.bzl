"""A multi-process integration test: one Python test file run by /usr/bin/python3."""

def py_integration_test(name, size = "small", rdzv = False, extra_data = [], tags = [], timeout = None,
                        shard_count = None):
    """sh_test running <name>.py with the elrun binary (and, for rdzv, the daemon).

    extra_data: more runfiles (helper modules, other binaries such as //trainer/app:elrun-train).
    tags: added to the default ones (cpu:2 for medium rdzv tests). timeout: Bazel's, over size's.
    shard_count: Bazel's; harness.main runs each shard's share of the test cases.
    """
    # harness.py imports //tests/support (process helpers shared with the benchmarks).
    data = ["%s.py" % name, "harness.py", "//launcher:elrun", "//tests/support"] + native.glob(["workers/*.py"])
    if rdzv:
        data += ["rdzv_harness.py", "//agent/daemon:elrun-rdzv"]
    native.sh_test(
        name = name,
        size = size,
        timeout = timeout,
        shard_count = shard_count,
        srcs = ["run_py_test.sh"],
        args = ["$(location %s.py)" % name],
        data = data + extra_data,
        # Multi-node PyTorch jobs start 8 to 14 interpreters on 2 cores: run them alone.
        tags = (["cpu:2"] if rdzv and size == "medium" else []) + tags,
    )
