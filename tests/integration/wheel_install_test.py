"""elrun's wheel as a user gets it: built from the Bazel binaries (release/wheel.py, auditwheel
repair), installed with pip into a fresh virtual environment that holds no build tree, then
jobs run from the installed programs only: a 2-worker job, a static 2-node job and an elastic
2-node job over the installed elrun-rdzv. The environment sees the project's torch through a
.pth file, as a user's environment holds their own torch; the workers run that environment's
python3 (the one beside the installed elrun) and import the heartbeat helper from the wheel."""
import glob
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import zipfile

import harness
import rdzv_harness
from harness import ElrunTestCase

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.environ.get("ELRUN_WHEEL_TOOLS") or os.path.expanduser("~/.cache/elrun/wheel-tools")
# Building the wheel (auditwheel reads 37 MB of ELF) and pip installing it, on a loaded machine.
BUILD_TIMEOUT_S = 240.0
JOB_TIMEOUT_S = 90.0

# Each worker: one all-reduce over Gloo, one heartbeat through the installed elrun.heartbeat,
# and a JSON line per rank saying what it ran with.
JOB = r'''
import json, os, sys
import torch
import torch.distributed as dist
from elrun import heartbeat

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
heartbeat.beat(1)
print(json.dumps({"rank": rank, "world": world, "sum": total.item(), "prefix": sys.prefix,
                  "heartbeat": heartbeat.__file__, "group_rank": int(os.environ["GROUP_RANK"])}),
      flush=True)
dist.destroy_process_group()
'''


def records(text):
    """The workers' JSON lines, with or without --tee's "[default0]:" prefix."""
    return [json.loads(found.group(1)) for found in re.finditer(r'^(?:\[\w+\]:)?(\{"rank".*\})$', text, re.M)]


class WheelInstallTest(ElrunTestCase):
    """One wheel and one environment for the class: building and installing take ~20 s."""

    @classmethod
    def setUpClass(cls):
        auditwheel = os.path.join(TOOLS, "bin", "auditwheel")
        if not os.access(auditwheel, os.X_OK):
            raise AssertionError("auditwheel is not installed at %s: run scripts/setup.sh test" % auditwheel)
        base = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
        cls.root = tempfile.mkdtemp(prefix="wheel.", dir=base)
        with open(os.path.join(ROOT, "VERSION")) as f:
            cls.version = f.read().strip()
        built = subprocess.run(
            [sys.executable, os.path.join(ROOT, "release", "wheel.py"),
             "--elrun", harness.elrun_command()[0], "--elrun-rdzv", rdzv_harness.rdzv_command()[0],
             "--dist", os.path.join(cls.root, "dist"), "--auditwheel", auditwheel],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if built.returncode != 0:
            raise AssertionError("release/wheel.py failed:\n%s%s" % (built.stdout, built.stderr))
        cls.built = json.loads(built.stdout.strip().splitlines()[-1])
        # A fresh environment from the system's Python, which made the torch environment too;
        # torch (and only torch's site-packages) reaches it through a .pth file.
        cls.venv = os.path.join(cls.root, "venv")
        subprocess.run(["/usr/bin/python3", "-m", "venv", cls.venv], check=True, timeout=BUILD_TIMEOUT_S)
        site = subprocess.run([os.path.join(cls.venv, "bin", "python3"), "-c",
                               "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        torch_site = subprocess.run([harness.PYTHON, "-c", "import os, torch; "
                                     "print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                                    capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(site, "users_torch.pth"), "w") as f:
            f.write(torch_site + "\n")
        cls.pip = subprocess.run([os.path.join(cls.venv, "bin", "pip"), "install", "--no-index",
                                  "--disable-pip-version-check", cls.built["wheel"]],
                                 capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if cls.pip.returncode != 0:
            raise AssertionError("pip install failed:\n%s%s" % (cls.pip.stdout, cls.pip.stderr))

    @classmethod
    def tearDownClass(cls):
        if os.environ.get("ELRUN_KEEP_TMP") is None:
            shutil.rmtree(cls.root, ignore_errors=True)

    def bin(self, name):
        return os.path.join(self.venv, "bin", name)

    def user_env(self, activated=True):
        """A user's shell, with the environment activated (its bin/ first on PATH) or not: no
        PYTHON_EXEC, nothing of the build tree on PATH or PYTHONPATH."""
        path = "/usr/bin:/bin"
        if activated:
            path = os.path.join(self.venv, "bin") + ":" + path
        return self.env(PYTHON_EXEC=None, PYTHONPATH=None, ELRUN_BIN=None, ELRUN_RDZV_BIN=None, PATH=path)

    def job_file(self):
        path = self.path("job.py")
        with open(path, "w") as f:
            f.write(JOB)
        return path

    def run_installed(self, args, env=None, timeout=JOB_TIMEOUT_S):
        return self.finish(self.start(args, env=env or self.user_env(), command=[self.bin("elrun")]),
                           timeout=timeout)

    def assertRanks(self, found, world, result):
        self.assertEqual(sorted(r["rank"] for r in found), list(range(world)),
                         "expected one line from each of %d ranks\n%s" % (world, result))
        for record in found:
            self.assertEqual(record["world"], world)
            self.assertEqual(record["sum"], world * (world + 1) / 2, "all-reduce of rank+1")
            self.assertEqual(os.path.realpath(record["prefix"]), os.path.realpath(self.venv),
                             "expected the workers to run the environment's python3 (beside elrun)")
            self.assertTrue(record["heartbeat"].startswith(os.path.realpath(self.venv))
                            or record["heartbeat"].startswith(self.venv),
                            "expected elrun.heartbeat from the installed wheel: %s" % record["heartbeat"])

    # -- the wheel ------------------------------------------------------------------------------

    def test_the_wheel_is_a_manylinux_wheel_with_native_programs_on_path(self):
        name = os.path.basename(self.built["wheel"])
        self.assertRegex(name, r"^elrun-%s-py3-none-manylinux_\d+_\d+_x86_64\.whl$" % re.escape(self.version))
        self.assertEqual(self.built["tag"], name.split("-py3-none-")[1][:-len(".whl")])
        for program in ("elrun", "elrun-rdzv"):
            path = self.bin(program)
            with open(path, "rb") as f:
                self.assertEqual(f.read(4), b"\x7fELF", "expected %s to be the native program, "
                                 "not a Python shim (auditwheel vendored nothing)" % path)
            ldd = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
            self.assertNotIn("not found", ldd)
            for lib in re.findall(r"=> (\S+)", ldd):
                self.assertTrue(lib.startswith(("/lib", "/usr/lib")),
                                "%s loads %s: expected only the platform's libraries" % (program, lib))
        self.assertEqual(glob.glob(os.path.join(self.venv, "lib", "python3*", "site-packages", "elrun.libs")), [],
                         "expected no vendored libraries")

    def test_the_wheel_names_its_licence_and_carries_its_text(self):
        with zipfile.ZipFile(self.built["wheel"]) as wheel:
            dist_info = "elrun-%s.dist-info" % self.version
            metadata = wheel.read(dist_info + "/METADATA").decode()
            licence = wheel.read(dist_info + "/LICENSE").decode()
        headers = metadata.split("\n\n")[0].splitlines()
        self.assertIn("License: BSD-3-Clause", headers)
        self.assertIn("Classifier: License :: OSI Approved :: BSD License", headers)
        with open(os.path.join(ROOT, "LICENSE")) as f:
            self.assertEqual(licence, f.read(), "expected the repository's LICENSE in the wheel's dist-info")
        installed = glob.glob(os.path.join(self.venv, "lib", "python3*", "site-packages", dist_info, "LICENSE"))
        self.assertEqual(len(installed), 1, "expected pip to install dist-info/LICENSE")

    def test_version_names_the_release_and_the_commit(self):
        line = re.compile(r"^%%s %s \(commit ([0-9a-f]{12}(-dirty)?|unknown)\)\n$" % re.escape(self.version))
        for program in ("elrun", "elrun-rdzv"):
            out = subprocess.run([self.bin(program), "--version"], capture_output=True, text=True,
                                 env=self.user_env(), timeout=10)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertRegex(out.stdout, line.pattern % re.escape(program))
        # python -m elrun is the same program; the package knows its version and finds it.
        module = subprocess.run([self.bin("python3"), "-m", "elrun", "--version"], capture_output=True,
                                text=True, env=self.user_env(), timeout=30)
        self.assertRegex(module.stdout, line.pattern % "elrun")
        info = subprocess.run([self.bin("python3"), "-c", "import elrun; print(elrun.__version__, "
                               "elrun.program('elrun-rdzv'))"], capture_output=True, text=True,
                              env=self.user_env(), timeout=30)
        self.assertEqual(info.stdout.split(), [self.version, self.bin("elrun-rdzv")], info.stderr)

    # -- jobs from the installed programs ----------------------------------------------------------

    def test_two_workers(self):
        # Run by its path, the environment not activated: python3 on PATH is the system's, which
        # has no torch; the workers must run the environment's. --tee: both workers' lines reach
        # one console, relayed whole (inherited, they can merge mid-line).
        result = self.run_installed(["--standalone", "--nproc-per-node", "2", "--tee", "3", self.job_file()],
                                    env=self.user_env(activated=False))
        self.assertExit(result, 0)
        self.assertRanks(records(result.out), 2, result)

    def test_static_two_nodes(self):
        job, port = self.job_file(), self.reserve_port()
        nodes = [self.start(["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--nproc-per-node", "1", job],
                            env=self.user_env(), command=[self.bin("elrun")]) for rank in (0, 1)]
        results = [self.finish(node, timeout=JOB_TIMEOUT_S) for node in nodes]
        for result in results:
            self.assertExit(result, 0)
        found = records(results[0].out) + records(results[1].out)
        self.assertRanks(found, 2, results)
        self.assertEqual({r["rank"]: r["group_rank"] for r in found}, {0: 0, 1: 1})

    def test_elastic_two_nodes_over_the_installed_rendezvous_daemon(self):
        port_file = self.path("rdzv.port")
        daemon = self.start(["--listen", "127.0.0.1:0", "--port-file", port_file], env=self.user_env(),
                            command=[self.bin("elrun-rdzv")])
        port, seen, deadline = None, b"", time.monotonic() + rdzv_harness.DAEMON_TIMEOUT_S
        while port is None and time.monotonic() < deadline:
            ready, _, _ = select.select([daemon.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(daemon.stdout.fileno(), 4096) if ready else b""
            if ready and not chunk:
                break  # It exited.
            seen += chunk
            found = rdzv_harness.LISTENING.search(seen.decode(errors="replace"))
            port = int(found.group(1)) if found else None
        self.assertIsNotNone(port, "expected the installed elrun-rdzv to say where it listens: %r" % seen)
        job = self.job_file()
        agents = [self.start(["--nnodes", "2:4", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", "127.0.0.1:%d" % port, "--rdzv-id", "wheel-job",
                              "--local-addr", "127.0.0.%d" % node,
                              "--rdzv-conf", "join_timeout=60,last_call_timeout=2", job],
                             env=self.user_env(), command=[self.bin("elrun")]) for node in (1, 2)]
        results = [self.finish(agent, timeout=JOB_TIMEOUT_S) for agent in agents]
        for result in results:
            self.assertExit(result, 0)
        self.assertRanks(records(results[0].out) + records(results[1].out), 2, results)
        daemon.terminate()
        self.assertEqual(daemon.wait(timeout=10), 0)
        self.assertEqual(self.read_text(port_file).strip(), str(port))


if __name__ == "__main__":
    unittest.main()
