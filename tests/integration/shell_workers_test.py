"""Entrypoints and exit codes with cheap workers: sh (--no-python), ELF binaries, .py scripts,
python -m modules; ${local_rank} substitution; options from PET_* variables and both spellings."""
import os
import shlex

import harness
from harness import ElrunTestCase, sh, worker

DUMP_ENV = worker("dump_env.py")

# Records its arguments in $OUT_DIR/calls, then runs the real interpreter: shows how elrun
# invoked $PYTHON_EXEC.
PYTHON_WRAPPER = """#!/bin/sh
for a in "$@"; do printf '%s\\t' "$a"; done >> "$OUT_DIR/calls.$LOCAL_RANK"
echo >> "$OUT_DIR/calls.$LOCAL_RANK"
exec PYTHON "$@"
""".replace("PYTHON", shlex.quote(harness.PYTHON))


class ExitCodesTest(ElrunTestCase):

    def test_all_workers_succeed_exit_0(self):
        result = self.elrun(["--nproc_per_node", "2"] + sh('echo ok > "$OUT_DIR/ok.$LOCAL_RANK"'))
        self.assertExit(result, 0)
        for rank in (0, 1):
            self.assertEqual(self.read_text(self.path("ok.%d" % rank)), "ok\n",
                             "expected worker %d to have run" % rank)

    def test_one_worker_fails_exit_1_and_others_are_stopped(self):
        # Rank 0 would run for 5 minutes; rank 1 fails once rank 0 is running (it waits on the
        # "go" FIFO). elrun must stop rank 0 and exit 1.
        self.mkfifo("go")
        script = ('if [ "$LOCAL_RANK" = 1 ]; then read x < "$OUT_DIR/go"; exit 3; fi; '
                  'echo "$$" > "$OUT_DIR/pid.0"; echo go > "$OUT_DIR/go"; exec sleep 300')
        result = self.elrun(["--nproc_per_node", "2"] + self.sh_file(script), timeout=20)
        self.assertExit(result, 1)
        pid = int(self.read_text(self.path("pid.0")))
        self.assertAllDead([pid], what="the surviving worker (rank 0)")

    @harness.elrun_only("elrun removes the shared memory a killed worker named after its pid")
    def test_a_killed_worker_leaves_no_elrun_shared_memory(self):
        # Named as elrun-train's shared-memory all-reduce names its segment; killed before it
        # could unlink it. Another process's segment (not a worker's pid) is left alone.
        other = "/dev/shm/elrun-test-1-%d" % os.getpid()
        with open(other, "w"):
            pass
        self.addCleanup(lambda: os.path.exists(other) and os.unlink(other))
        script = 'touch "/dev/shm/elrun-test-$$-$LOCAL_RANK"; echo "$$" > "$OUT_DIR/pid.$LOCAL_RANK"; kill -9 $$\n'
        # One worker: with two, the first one's death could stop the other before it wrote.
        result = self.elrun(["--nproc_per_node", "1"] + self.sh_file(script))
        self.assertExit(result, 1)
        pid = self.read_text(self.path("pid.0")).strip()
        self.assertFalse(os.path.exists("/dev/shm/elrun-test-%s-0" % pid), result)
        self.assertTrue(os.path.exists(other), "expected a segment of no worker's pid to stay")

    def test_all_workers_fail_exit_1(self):
        result = self.elrun(["--nproc_per_node", "2"] + sh("exit 1"))
        self.assertExit(result, 1)

    def test_worker_exit_code_is_not_passed_through(self):
        result = self.elrun(["--nproc_per_node", "1"] + sh("exit 42"))
        self.assertExit(result, 1)


class EntrypointTest(ElrunTestCase):

    def test_local_rank_substitution_in_arguments(self):
        script = 'printf "%s\\n" "$@" > "$OUT_DIR/args.$LOCAL_RANK"'
        result = self.elrun(["--nproc_per_node", "3"] + sh(script) +
                            ["sh", "${local_rank}", "--out=dir${local_rank}/x", "plain",
                             "${other}"])
        self.assertExit(result, 0)
        for rank in range(3):
            self.assertEqual(self.read_text(self.path("args.%d" % rank)).splitlines(),
                             [str(rank), "--out=dir%d/x" % rank, "plain", "${other}"],
                             "expected ${local_rank} replaced by %d and nothing else changed"
                             % rank)

    def test_py_script_runs_with_python_exec_unbuffered(self):
        wrapper = self.path("python-wrapper")
        with open(wrapper, "w") as f:
            f.write(PYTHON_WRAPPER)
        os.chmod(wrapper, 0o755)
        result = self.elrun(["--nproc_per_node", "2", DUMP_ENV, self.tmp, "a${local_rank}"],
                            env=self.env(PYTHON_EXEC=wrapper))
        self.assertExit(result, 0)
        for rank in (0, 1):
            calls = self.read_text(self.path("calls.%d" % rank)).splitlines()
            self.assertEqual(calls, ["-u\t%s\t%s\ta%d\t" % (DUMP_ENV, self.tmp, rank)],
                             "expected one call `$PYTHON_EXEC -u script args` for rank %d" % rank)
            rec = self.read_json("env_r%d_a0.json" % rank)
            self.assertEqual(rec["executable"], harness.PYTHON)
            self.assertTrue(rec["stdout_write_through"],
                            "expected python -u (unbuffered stdout) in the worker")

    @harness.elrun_only("torchrun runs every script without --no-python through python")
    def test_non_elf_script_without_py_suffix_runs_with_python(self):
        script = self.path("trainer_script")  # No .py suffix, not executable.
        with open(DUMP_ENV) as src, open(script, "w") as dst:
            dst.write(src.read())
        wrapper = self.path("python-wrapper")
        with open(wrapper, "w") as f:
            f.write(PYTHON_WRAPPER)
        os.chmod(wrapper, 0o755)
        result = self.elrun([script, self.tmp], env=self.env(PYTHON_EXEC=wrapper))
        self.assertExit(result, 0)
        self.assertEqual(self.read_text(self.path("calls.0")).splitlines(),
                         ["-u\t%s\t%s\t" % (script, self.tmp)],
                         "expected a non-ELF script to run as `$PYTHON_EXEC -u script args`")

    @harness.elrun_only("torchrun runs every script without --no-python through python")
    def test_elf_binary_without_no_python_is_executed_directly(self):
        wrapper = self.path("python-wrapper")
        with open(wrapper, "w") as f:
            f.write(PYTHON_WRAPPER)
        os.chmod(wrapper, 0o755)
        sh_path = os.path.realpath("/bin/sh")  # dash: an ELF binary.
        result = self.elrun(["--nproc_per_node", "2", sh_path, "-c",
                             'echo "$LOCAL_RANK" > "$OUT_DIR/elf.$LOCAL_RANK"'],
                            env=self.env(PYTHON_EXEC=wrapper))
        self.assertExit(result, 0)
        for rank in (0, 1):
            self.assertEqual(self.read_text(self.path("elf.%d" % rank)), "%d\n" % rank,
                             "expected the ELF binary to run as worker %d" % rank)
        self.assertFalse([n for n in os.listdir(self.tmp) if n.startswith("calls.")],
                         "expected PYTHON_EXEC not to be used for an ELF binary")

    def test_no_python_looks_the_binary_up_in_path(self):
        bindir = self.path("bin")
        os.mkdir(bindir)
        tool = os.path.join(bindir, "elrun-test-tool")
        with open(tool, "w") as f:
            f.write('#!/bin/sh\necho "$LOCAL_RANK $*" > "$OUT_DIR/tool.$LOCAL_RANK"\n')
        os.chmod(tool, 0o755)
        env = self.env(PATH=bindir + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"))
        result = self.elrun(["--nproc_per_node", "2", "--no_python", "elrun-test-tool", "x"],
                            env=env)
        self.assertExit(result, 0)
        for rank in (0, 1):
            self.assertEqual(self.read_text(self.path("tool.%d" % rank)), "%d x\n" % rank,
                             "expected --no-python to find elrun-test-tool on PATH")

    def test_module_runs_with_python_dash_m(self):
        moddir = self.path("mods")
        os.mkdir(moddir)
        with open(os.path.join(moddir, "elrun_probe_mod.py"), "w") as f:
            f.write("import json, os, sys\n"
                    "rank = os.environ['LOCAL_RANK']\n"
                    "with open(os.path.join(os.environ['OUT_DIR'], 'mod.' + rank), 'w') as f:\n"
                    "    json.dump({'argv': sys.argv, 'name': __name__, 'exe': sys.executable,\n"
                    "               'unbuffered': sys.stdout.write_through}, f)\n")
        result = self.elrun(["--nproc_per_node", "2", "-m", "elrun_probe_mod", "r${local_rank}"],
                            env=self.env(PYTHONPATH=moddir))
        self.assertExit(result, 0)
        for rank in (0, 1):
            rec = self.read_json("mod.%d" % rank)
            self.assertEqual(rec["name"], "__main__", "expected the module to run as __main__")
            self.assertEqual(rec["argv"][1:], ["r%d" % rank], "expected the module's arguments")
            self.assertTrue(rec["argv"][0].endswith("elrun_probe_mod.py"),
                            "expected python -m to set argv[0] to the module file")
            self.assertEqual(rec["exe"], harness.PYTHON, "expected $PYTHON_EXEC to run -m")
            self.assertTrue(rec["unbuffered"], "expected python -u -m")

    @harness.elrun_only("torchrun 1.13 has no --module long-name spelling with dashes")
    def test_module_long_spelling(self):
        moddir = self.path("mods")
        os.mkdir(moddir)
        with open(os.path.join(moddir, "elrun_probe_mod2.py"), "w") as f:
            f.write("import os\nopen(os.path.join(os.environ['OUT_DIR'], 'mod2'), 'w').close()\n")
        result = self.elrun(["--module", "elrun_probe_mod2"], env=self.env(PYTHONPATH=moddir))
        self.assertExit(result, 0)
        self.assertTrue(os.path.exists(self.path("mod2")), "expected --module to run the module")


@harness.elrun_only("dashed spellings and PET_ precedence are checked on elrun")
class OptionSourcesTest(ElrunTestCase):
    """CLI > PET_* env > default, for both spellings."""

    def world_sizes(self, result):
        self.assertExit(result, 0)
        sizes = set()
        count = 0
        for name in os.listdir(self.tmp):
            if name.startswith("ws."):
                count += 1
                sizes.add(self.read_text(self.path(name)).strip())
        return count, sizes

    SCRIPT = 'echo "$WORLD_SIZE" > "$OUT_DIR/ws.$LOCAL_RANK"'

    def test_pet_env_sets_option(self):
        result = self.elrun(sh(self.SCRIPT), env=self.env(PET_NPROC_PER_NODE="3"))
        self.assertEqual(self.world_sizes(result), (3, {"3"}),
                         "expected PET_NPROC_PER_NODE=3 to start 3 workers\n%s" % result)

    def test_cli_beats_pet_env(self):
        result = self.elrun(["--nproc_per_node", "2"] + sh(self.SCRIPT),
                            env=self.env(PET_NPROC_PER_NODE="3"))
        self.assertEqual(self.world_sizes(result), (2, {"2"}),
                         "expected --nproc-per-node 2 to win over PET_NPROC_PER_NODE=3\n%s"
                         % result)

    def test_underscore_and_equals_spellings(self):
        for args in (["--nproc-per-node", "2"], ["--nproc_per_node", "2"], ["--nproc-per-node=2"],
                     ["--nproc_per_node=2"]):
            with self.subTest(args=args):
                for name in os.listdir(self.tmp):
                    os.unlink(self.path(name))
                result = self.elrun(args + sh(self.SCRIPT))
                self.assertEqual(self.world_sizes(result), (2, {"2"}),
                                 "expected %s to start 2 workers\n%s" % (args, result))

    def test_pet_env_for_other_options(self):
        script = ('echo "$TORCHELASTIC_MAX_RESTARTS $ROLE_NAME $TORCHELASTIC_RUN_ID $MASTER_PORT"'
                  ' > "$OUT_DIR/opts.$LOCAL_RANK"')
        port = self.reserve_port()
        result = self.elrun(sh(script), env=self.env(
            PET_MAX_RESTARTS="2", PET_ROLE="worker", PET_RDZV_ID="from-env",
            PET_MASTER_PORT=str(port)))
        self.assertExit(result, 0)
        self.assertEqual(self.read_text(self.path("opts.0")).split(),
                         ["2", "worker", "from-env", str(port)],
                         "expected PET_MAX_RESTARTS, PET_ROLE, PET_RDZV_ID and PET_MASTER_PORT "
                         "to reach the worker environment")

    def test_nproc_per_node_cpu_and_auto(self):
        cores = {len(os.sched_getaffinity(0)), os.cpu_count()}
        for value in ("cpu", "auto"):
            with self.subTest(value=value):
                for name in os.listdir(self.tmp):
                    os.unlink(self.path(name))
                count, sizes = self.world_sizes(
                    self.elrun(["--nproc-per-node", value] + sh(self.SCRIPT),
                               env=self.env(CUDA_VISIBLE_DEVICES="")))
                self.assertIn(count, cores, "expected --nproc-per-node %s to start one worker "
                              "per core (%s) on a machine without GPUs" % (value, cores))
                self.assertEqual(sizes, {str(count)})

    def test_torchrun_compat_options_accepted(self):
        # elrun sees worker exits at once: --monitor-interval 5 must not add seconds.
        result = self.elrun(["--nproc-per-node", "2", "--start-method", "fork",
                             "--monitor-interval", "5", "--local-addr", "127.0.0.1"] +
                            sh(self.SCRIPT))
        self.assertEqual(self.world_sizes(result), (2, {"2"}),
                         "expected the job to run with torchrun's extra options\n%s" % result)
        self.assertLess(result.elapsed, 4.0, "expected exits to be seen without polling "
                        "(--monitor-interval 5 accepted, not waited on)\n%s" % result)

    def test_run_path_runs_script_per_worker(self):
        result = self.elrun(["--nproc-per-node", "2", "--run-path", DUMP_ENV, self.tmp])
        self.assertExit(result, 0)
        for rank in (0, 1):
            rec = self.read_json("env_r%d_a0.json" % rank)
            self.assertEqual(rec["env"].get("LOCAL_RANK"), str(rank),
                             "expected --run-path to run the script once per worker")

    def test_pet_no_python_flag(self):
        result = self.elrun(["sh", "-c", self.SCRIPT], env=self.env(PET_NO_PYTHON="1"))
        self.assertEqual(self.world_sizes(result), (1, {"1"}),
                         "expected PET_NO_PYTHON=1 to run sh directly\n%s" % result)


if __name__ == "__main__":
    harness.main()
