"""Failure handling: restarts with TORCHELASTIC_RESTART_COUNT, attempt_<n> log dirs, the exit code
when restarts run out, and the root-cause report (exit code or signal name, pid, host, time,
error-file message, log paths)."""
import json
import os
import re

import harness
from harness import ElrunTestCase, worker

# Every start appends "<restart count> <max restarts> <error file>" to starts.<local_rank>.
# Attempt 0: rank 1 fails with exit 7 once rank 0 is running (the "go" FIFO); rank 0 would run
# for 5 minutes. Later attempts: both succeed.
FAIL_FIRST = r'''
echo "$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $TORCHELASTIC_ERROR_FILE" >> "$OUT_DIR/starts.$LOCAL_RANK"
echo "$$" > "$OUT_DIR/pid.$LOCAL_RANK.$TORCHELASTIC_RESTART_COUNT"
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
  if [ "$LOCAL_RANK" = 1 ]; then read x < "$OUT_DIR/go"; echo "failing on purpose" >&2; exit 7; fi
  echo go > "$OUT_DIR/go"; exec sleep 300
fi
echo "attempt $TORCHELASTIC_RESTART_COUNT ok"
'''


class RestartTest(ElrunTestCase):

    def log(self, attempt, rank, name, run_id="job"):
        return os.path.join(self.tmp, "logs", run_id, "attempt_%d" % attempt, str(rank), name)

    def starts(self, rank):
        path = self.path("starts.%d" % rank)
        if not os.path.exists(path):
            return []
        return [line.split(" ") for line in self.read_text(path).splitlines()]

    def base_args(self, max_restarts, nproc=2):
        return ["--nproc_per_node", str(nproc), "--max_restarts", str(max_restarts),
                "--rdzv_id", "job", "--log_dir", self.path("logs"), "--redirects", "3",
                "--monitor_interval", "0.1"]

    def root_cause(self, result):
        """The root-cause block of the failure report on stderr: from its heading to the first
        rule line (----, ====), blank line or "other failures" heading."""
        err = result.err.splitlines()
        starts = [i for i, line in enumerate(err) if re.search(r"root.?cause", line, re.I)]
        self.assertTrue(starts, "expected a root-cause block on stderr\n%s" % result)
        block = [err[starts[0]]]
        for line in err[starts[0] + 1:]:
            if (not line.strip() or re.match(r"^\s*([-=])\1{4,}\s*$", line)
                    or re.search(r"other failures", line, re.I)):
                break
            block.append(line)
        return "\n".join(block)

    def test_failure_then_restart_succeeds(self):
        self.mkfifo("go")
        result = self.elrun(self.base_args(1) + self.sh_file(FAIL_FIRST))
        self.assertExit(result, 0)
        for rank in (0, 1):
            seen = self.starts(rank)
            self.assertEqual([s[:2] for s in seen], [["0", "1"], ["1", "1"]],
                             "expected rank %d to start twice, with TORCHELASTIC_RESTART_COUNT 0 "
                             "then 1 and TORCHELASTIC_MAX_RESTARTS 1" % rank)
            if not harness.TORCHRUN_REFERENCE:
                self.assertEqual([s[2] for s in seen],
                                 [self.log(0, rank, "error.json"), self.log(1, rank, "error.json")],
                                 "expected TORCHELASTIC_ERROR_FILE under attempt_0 then attempt_1")
        self.assertAllDead([int(self.read_text(self.path("pid.0.0")))],
                           what="attempt 0's surviving worker")
        if harness.TORCHRUN_REFERENCE:
            return
        self.assertIn("failing on purpose", self.read_text(self.log(0, 1, "stderr.log")),
                      "expected attempt 0's stderr in attempt_0/1/stderr.log")
        for rank in (0, 1):
            self.assertEqual(self.read_text(self.log(1, rank, "stdout.log")), "attempt 1 ok\n",
                             "expected attempt 1's stdout in attempt_1/%d/stdout.log" % rank)
        self.assertEqual(sorted(os.listdir(self.path("logs", "job"))),
                         ["attempt_0", "attempt_1"], "expected exactly two attempt directories")

    def test_no_restarts_left_exit_1_with_root_cause(self):
        self.mkfifo("go")
        result = self.elrun(self.base_args(0) + self.sh_file(FAIL_FIRST))
        self.assertExit(result, 1)
        self.assertEqual(len(self.starts(1)), 1, "expected no restart with --max-restarts 0")
        pid = int(self.read_text(self.path("pid.1.0")))
        report = self.root_cause(result)
        for pattern, what in ((r"exitcode\W+7\b", "exitcode 7"),
                              (r"\brank\W+1\b", "rank 1"),
                              (r"local_rank\W+1\b", "local_rank 1"),
                              (r"\bpid\W+%d\b" % pid, "pid %d" % pid),
                              (r"\bhost\b", "host"),
                              (r"\btime\b", "time")):
            self.assertRegex(report, pattern, "expected the root cause to name %s (the failed "
                             "worker, not the one stopped after it)\n%s" % (what, result))
        self.assertNotIn("SIGTERM", report, "expected the root cause to be rank 1's exit 7, not "
                         "the SIGTERM that stopped rank 0\n%s" % result)
        if not harness.TORCHRUN_REFERENCE:
            paths = [self.log(0, 1, "stderr.log"), self.log(0, 1, "stdout.log"),
                     os.path.dirname(self.log(0, 1, "stderr.log"))]
            self.assertTrue(any(p in report for p in paths),
                            "expected the report to point at rank 1's logs (one of %s)\n%s"
                            % (paths, result))
        self.assertAllDead([int(self.read_text(self.path("pid.0.0")))],
                           what="the surviving worker")

    def test_restarts_exhausted_after_max_restarts(self):
        script = ('echo "$TORCHELASTIC_RESTART_COUNT x x" >> "$OUT_DIR/starts.$LOCAL_RANK"; '
                  'exit 1')
        result = self.elrun(self.base_args(2, nproc=1) + self.sh_file(script))
        self.assertExit(result, 1)
        self.assertEqual([s[0] for s in self.starts(0)], ["0", "1", "2"],
                         "expected 3 attempts (1 + --max-restarts 2) with counts 0, 1, 2")
        if not harness.TORCHRUN_REFERENCE:
            self.assertEqual(sorted(os.listdir(self.path("logs", "job"))),
                             ["attempt_0", "attempt_1", "attempt_2"],
                             "expected one attempt directory per attempt")

    def test_error_file_message_in_report(self):
        env = self.env(FAIL_RANKS="1", FAIL_UNTIL_RESTART="1")
        result = self.elrun(self.base_args(0) + [worker("error_file_worker.py")], env=env)
        self.assertExit(result, 1)
        self.assertIn("ValueError: boom", self.root_cause(result),
                      "expected the worker's error-file message in the root cause\n%s" % result)
        if not harness.TORCHRUN_REFERENCE:
            self.assertTrue(os.path.isfile(self.log(0, 1, "error.json")),
                            "expected the worker to have written the error file at "
                            "TORCHELASTIC_ERROR_FILE=<log_dir>/job/attempt_0/1/error.json")

    def test_error_file_then_restart_succeeds(self):
        env = self.env(FAIL_RANKS="0", FAIL_UNTIL_RESTART="1")
        result = self.elrun(self.base_args(1, nproc=1) + [worker("error_file_worker.py")],
                            env=env)
        self.assertExit(result, 0)

    def test_torch_record_decorator_error_file(self):
        result = self.elrun(self.base_args(0, nproc=1) + [worker("record_worker.py")],
                            timeout=60)
        self.assertExit(result, 1)
        self.assertIn("ValueError: boom", self.root_cause(result),
                      "expected the message that torch's @record wrote to the error file\n%s"
                      % result)

    def test_launcher_error_file_holds_the_worker_root_cause(self):
        # Schedulers and outer launchers set TORCHELASTIC_ERROR_FILE for the launcher itself;
        # torchrun's @record copies the root-cause worker's error file there, errorCode set to
        # its exit code. The same holds under the reference torchrun.
        result = self.elrun(self.base_args(0, nproc=1) + [worker("record_worker.py")],
                            env=self.env(TORCHELASTIC_ERROR_FILE=self.path("launcher_error.json")),
                            timeout=60)
        self.assertExit(result, 1)
        message = self.read_json("launcher_error.json")["message"]
        self.assertEqual(message["message"], "ValueError: boom")
        self.assertEqual(message["errorCode"], 1)
        self.assertIn('raise ValueError("boom")', message["extraInfo"]["py_callstack"])
        self.assertTrue(message["extraInfo"]["timestamp"].isdigit())

    @harness.elrun_only("torchrun writes no launcher error file when the worker wrote none")
    def test_launcher_error_file_without_a_worker_error_file(self):
        result = self.elrun(self.base_args(0, nproc=1) + self.sh_file("kill -KILL $$"),
                            env=self.env(TORCHELASTIC_ERROR_FILE=self.path("launcher_error.json")))
        self.assertExit(result, 1)
        message = self.read_json("launcher_error.json")["message"]
        self.assertEqual(message["message"],
                         "ChildFailedError: local_rank 0 (rank 0) was killed by SIGKILL")
        self.assertEqual(message["errorCode"], -9)
        self.assertIn("Root Cause", message["extraInfo"]["py_callstack"],
                      "expected the failure report as the details")

    def test_torch_job_restarts_after_rank_failure(self):
        # Rank 1 exits in the middle of a live gloo group; the restarted attempt must be able to
        # build a new group (new store, port usable again) and finish.
        env = self.env(FAIL_RANK="1", ELRUN_TEST_EXPECT=json.dumps(
            {"TORCHELASTIC_MAX_RESTARTS": "1", "WORLD_SIZE": "2"}))
        result = self.elrun(["--standalone", "--nproc_per_node", "2", "--max_restarts", "1",
                             "--monitor_interval", "0.1", worker("torch_allreduce.py")],
                            env=env, timeout=60)
        self.assertExit(result, 0)
        for rank in (0, 1):
            rec = self.read_json("torch_%d.json" % rank)
            self.assertEqual(rec["TORCHELASTIC_RESTART_COUNT"], "1",
                             "expected rank %d to finish in the restarted attempt" % rank)
            self.assertEqual(rec["all_reduce"], 3.0, "expected all_reduce of 1+2 after restart")

    def test_signal_death_named_in_report(self):
        result = self.elrun(self.base_args(0, nproc=1) + self.sh_file("kill -KILL $$"))
        self.assertExit(result, 1)
        self.assertIn("SIGKILL", self.root_cause(result),
                      "expected the root cause to name the signal (SIGKILL)\n%s" % result)


if __name__ == "__main__":
    harness.main()
