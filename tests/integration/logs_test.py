"""Worker output: --redirects (files only), --tee (files and "[<role><local_rank>]:" prefixed
console lines), --local-ranks-filter, and the <log_dir>/<run_id>/attempt_<n>/<local_rank>/ layout."""
import os

import harness
from harness import ElrunTestCase, lines, sh

# Two lines on stdout, one on stderr, each naming the rank.
TALK = 'echo "out$LOCAL_RANK"; echo "more$LOCAL_RANK"; echo "err$LOCAL_RANK" >&2'


@harness.elrun_only("torchrun 1.13's log layout differs (random run dir suffix)")
class LogsTest(ElrunTestCase):

    def log(self, rank, stream, attempt=0, run_id="job1"):
        return os.path.join(self.tmp, "logs", run_id, "attempt_%d" % attempt, str(rank),
                            "%s.log" % stream)

    def run_talk(self, *options, nproc=2, script=TALK):
        result = self.elrun(["--nproc-per-node", str(nproc), "--rdzv-id", "job1",
                             "--log-dir", self.path("logs")] + list(options) + sh(script))
        self.assertExit(result, 0)
        return result

    def assertLog(self, rank, stream, text, result):
        path = self.log(rank, stream)
        self.assertTrue(os.path.isfile(path), "expected log file %s\n%s" % (path, result))
        self.assertEqual(self.read_text(path), text, "expected %s to hold exactly %r"
                         % (path, text))

    def assertNoLogText(self, rank, stream, text):
        path = self.log(rank, stream)
        if os.path.exists(path):
            self.assertNotIn(text, self.read_text(path),
                             "expected %r not to be redirected into %s" % (text, path))

    def test_redirects_both_streams_to_files_only(self):
        result = self.run_talk("--redirects", "3")
        for rank in (0, 1):
            self.assertLog(rank, "stdout", "out%d\nmore%d\n" % (rank, rank), result)
            self.assertLog(rank, "stderr", "err%d\n" % rank, result)
            for text in ("out%d" % rank, "more%d" % rank, "err%d" % rank):
                self.assertNotIn(text, result.out + result.err,
                                 "expected %r only in the log files with --redirects 3\n%s"
                                 % (text, result))

    def test_redirects_stdout_only(self):
        result = self.run_talk("-r", "1")
        for rank in (0, 1):
            self.assertLog(rank, "stdout", "out%d\nmore%d\n" % (rank, rank), result)
            self.assertNoLogText(rank, "stderr", "err%d" % rank)
            self.assertIn("err%d" % rank, lines(result.err),
                          "expected stderr on the console, unprefixed, with -r 1\n%s" % result)
            self.assertNotIn("out%d" % rank, result.out, "expected stdout in the file only")

    def test_redirects_per_rank_map(self):
        result = self.run_talk("--redirects", "0:1,1:2")
        self.assertLog(0, "stdout", "out0\nmore0\n", result)
        self.assertNoLogText(0, "stderr", "err0")
        self.assertIn("err0", lines(result.err), "expected rank 0's stderr on the console")
        self.assertLog(1, "stderr", "err1\n", result)
        self.assertNoLogText(1, "stdout", "out1")
        self.assertIn("out1", lines(result.out), "expected rank 1's stdout on the console")

    def test_tee_writes_files_and_prefixed_console_lines(self):
        result = self.run_talk("--tee", "3")
        out, err = lines(result.out), lines(result.err)
        for rank in (0, 1):
            self.assertLog(rank, "stdout", "out%d\nmore%d\n" % (rank, rank), result)
            self.assertLog(rank, "stderr", "err%d\n" % rank, result)
            for text in ("out%d" % rank, "more%d" % rank):
                self.assertIn("[default%d]:%s" % (rank, text), out,
                              "expected tee'd stdout line '[default%d]:%s'\n%s"
                              % (rank, text, result))
                self.assertNotIn(text, out, "expected only the prefixed copy on the console")
            self.assertIn("[default%d]:err%d" % (rank, rank), err,
                          "expected tee'd stderr line '[default%d]:err%d' on stderr\n%s"
                          % (rank, rank, result))

    def test_tee_prefix_uses_role(self):
        result = self.run_talk("-t", "1", "--role", "trainer", nproc=1)
        self.assertIn("[trainer0]:out0", lines(result.out),
                      "expected the tee prefix [<role><local_rank>]:\n%s" % result)
        self.assertLog(0, "stdout", "out0\nmore0\n", result)

    def test_local_ranks_filter_limits_console_not_files(self):
        result = self.run_talk("--tee", "3", "--local-ranks-filter", "0")
        self.assertIn("[default0]:out0", lines(result.out),
                      "expected rank 0 on the console\n%s" % result)
        self.assertIn("[default0]:err0", lines(result.err),
                      "expected rank 0's stderr on the console\n%s" % result)
        for text in ("out1", "more1", "err1"):
            self.assertNotIn(text, result.out + result.err,
                             "expected --local-ranks-filter 0 to hide rank 1 (%r) from the "
                             "console\n%s" % (text, result))
        self.assertLog(1, "stdout", "out1\nmore1\n", result)
        self.assertLog(1, "stderr", "err1\n", result)

    def test_without_redirects_workers_write_straight_to_console(self):
        result = self.run_talk()
        for rank in (0, 1):
            self.assertIn("out%d" % rank, lines(result.out),
                          "expected unprefixed worker stdout on elrun's stdout\n%s" % result)
            self.assertIn("more%d" % rank, lines(result.out))
            self.assertIn("err%d" % rank, lines(result.err),
                          "expected unprefixed worker stderr on elrun's stderr\n%s" % result)
            self.assertFalse(os.path.exists(self.log(rank, "stdout")),
                             "expected no stdout.log without --redirects/--tee")

    def test_tee_large_output_stays_whole_and_ordered(self):
        count = 20000
        script = 'seq 1 %d; printf "tail$LOCAL_RANK"' % count
        result = self.run_talk("--tee", "1", script=script)
        want = "".join("%d\n" % i for i in range(1, count + 1))
        out = lines(result.out)
        for rank in (0, 1):
            self.assertLog(rank, "stdout", want + "tail%d" % rank, result)
            prefix = "[default%d]:" % rank
            mine = [line[len(prefix):] for line in out if line.startswith(prefix)]
            self.assertEqual(mine[:count], [str(i) for i in range(1, count + 1)],
                             "expected rank %d's %d lines on the console, whole and in order"
                             % (rank, count))
            self.assertEqual(mine[count:], ["tail%d" % rank],
                             "expected the last line without a newline on the console too")
        self.assertEqual(len(out), 2 * (count + 1),
                         "expected only prefixed worker lines on stdout (no torn or mixed lines)")

    def test_tee_relays_python_print_lines_whole(self):
        # python -u writes each print's text and its newline with two write()s; four workers
        # printing at once. Inherited, such lines can merge on the console; relayed, never.
        count = 3000
        script = self.path("talk.py")
        with open(script, "w") as f:
            f.write("import os\nrank = os.environ['LOCAL_RANK']\n"
                    "for i in range(%d):\n    print('rank', rank, 'line', i)\n" % count)
        result = self.elrun(["--nproc-per-node", "4", "--rdzv-id", "job1", "--log-dir", self.path("logs"),
                             "--tee", "1", script])
        self.assertExit(result, 0)
        out = lines(result.out)
        for rank in range(4):
            prefix = "[default%d]:" % rank
            mine = [line[len(prefix):] for line in out if line.startswith(prefix)]
            self.assertEqual(mine, ["rank %d line %d" % (rank, i) for i in range(count)],
                             "expected rank %d's lines whole and in order" % rank)
        self.assertEqual(len(out), 4 * count, "expected no torn or merged line on stdout")

    def test_default_log_dir_is_where_error_file_points(self):
        script = 'echo "out$LOCAL_RANK"; dirname "$TORCHELASTIC_ERROR_FILE" > "$OUT_DIR/dir"'
        result = self.elrun(["-r", "1"] + sh(script))
        self.assertExit(result, 0)
        log_dir = self.read_text(self.path("dir")).strip()
        self.assertTrue(log_dir.endswith("/none/attempt_0/0"),
                        "expected the default log layout <dir>/none/attempt_0/0, got %s" % log_dir)
        path = os.path.join(log_dir, "stdout.log")
        self.assertTrue(os.path.isfile(path), "expected %s with -r 1 and no --log-dir" % path)
        self.assertEqual(self.read_text(path), "out0\n")
        # The default directory is elrun's own fresh temp dir; the test removes it.
        self.addCleanup(lambda: __import__("shutil").rmtree(
            os.path.dirname(os.path.dirname(os.path.dirname(log_dir))), ignore_errors=True))


if __name__ == "__main__":
    harness.main()
