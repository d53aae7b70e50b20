"""Usage errors: exit 2, exactly one stderr line starting with "elrun: ", and no worker started
(every worker here would create a "started.<local_rank>" marker first)."""
import os
import stat

import harness
from harness import ElrunTestCase, sh

MARK = 'touch "$OUT_DIR/started.$LOCAL_RANK"'


@harness.elrun_only("torchrun 1.13 reports usage errors differently")
class BadInputTest(ElrunTestCase):

    def check_rejected(self, args, mentions=None, env=None):
        result = self.elrun(args, env=env, timeout=10)
        self.assertExit(result, 2)
        err_lines = result.err.splitlines()
        self.assertEqual(len(err_lines), 1, "expected exactly one line on stderr\n%s" % result)
        self.assertTrue(err_lines[0].startswith("elrun: "),
                        "expected the line to start with 'elrun: '\n%s" % result)
        if mentions:
            self.assertIn(mentions, err_lines[0],
                          "expected the message to name the input %r\n%s" % (mentions, result))
        started = [n for n in os.listdir(self.tmp) if n.startswith("started.")]
        self.assertEqual(started, [], "expected no worker to start\n%s" % result)
        return err_lines[0]

    def test_unknown_option(self):
        self.check_rejected(["--no-such-option", "1"] + sh(MARK), mentions="--no-such-option")

    def test_nproc_per_node_zero(self):
        self.check_rejected(["--nproc-per-node", "0"] + sh(MARK), mentions="nproc")

    def test_nproc_per_node_zero_underscore_equals(self):
        self.check_rejected(["--nproc_per_node=0"] + sh(MARK), mentions="nproc")

    def test_nproc_per_node_garbage(self):
        self.check_rejected(["--nproc-per-node", "two"] + sh(MARK), mentions="two")

    def test_nproc_per_node_zero_from_env(self):
        self.check_rejected(sh(MARK), env=self.env(PET_NPROC_PER_NODE="0"),
                            mentions="PET_NPROC_PER_NODE")

    def test_nnodes_min_above_max(self):
        self.check_rejected(["--nnodes", "3:2", "--rdzv-backend", "grpc"] + sh(MARK),
                            mentions="nnodes")

    def test_nnodes_range_with_static_backend(self):
        self.check_rejected(["--nnodes", "1:2"] + sh(MARK), mentions="nnodes")

    def test_missing_script(self):
        self.check_rejected(["--nproc-per-node", "2"])

    def test_nonexistent_script_file(self):
        self.check_rejected(["--nproc-per-node", "2", self.path("no_such_script.py")],
                            mentions="no_such_script.py")

    def test_nonexistent_binary_with_no_python(self):
        self.check_rejected(["--no-python", self.path("no_such_binary")],
                            mentions="no_such_binary")

    def test_no_python_with_non_executable_file(self):
        path = self.path("not_executable.sh")
        with open(path, "w") as f:
            f.write("#!/bin/sh\n%s\n" % MARK)
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
        self.check_rejected(["--no-python", path], mentions="not_executable.sh")

    def test_module_with_no_python(self):
        self.check_rejected(["-m", "--no-python", "json.tool"])
        self.check_rejected(["--no-python", "--module", "json.tool"])

    def test_malformed_rdzv_conf(self):
        self.check_rejected(["--rdzv-conf", "join_timeout"] + sh(MARK), mentions="join_timeout")

    def test_malformed_rdzv_conf_from_env(self):
        self.check_rejected(sh(MARK), env=self.env(PET_RDZV_CONF="join_timeout"),
                            mentions="PET_RDZV_CONF")


if __name__ == "__main__":
    harness.main()
