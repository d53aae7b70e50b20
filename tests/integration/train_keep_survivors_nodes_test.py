"""elrun --keep-survivors across nodes, with elrun-train: two agents (nodes 127.0.0.1 and
127.0.0.2, one worker each, node 1 hosting the rendezvous) run train_keep_survivors_test's job.

- A SIGKILLed worker on node 2: the rendezvous forms a new round, node 1 keeps its worker, which
  regroups in place, and node 2's new worker takes the survivor's live state. The job ends with
  the same steps, parameters, BatchNorm statistics and momentum buffers (within 1e-6) as an
  uninterrupted run of the same two nodes, with no step redone, none skipped, nothing read back
  from disk.
- A worker on node 2 stopped (SIGSTOP): node 2's watchdog kills it; node 1's worker, which waits
  for it in a collective and beats no more either, gets a second --worker-timeout, regroups and
  survives.
- Node 2's agent SIGKILLed (its worker dies with it): node 1's worker goes on alone at world size
  1 (--nnodes 1:2), in the same process, and the job ends there.
- The same with fsdp: node 2's shards are rebuilt from node 1's in-memory copy of them, and node
  1's worker goes back to that copy's step and on alone at world size 1.
"""
import os
import signal

import harness
from train_harness import REGROUPED_LINE, RESUMED_LINE, SHARDED_REGROUP_LINE, RegroupTestCase

HOSTING = "hosting the rendezvous coordinator on 127.0.0.1:%d"
MAX_STEPS = RegroupTestCase.MAX_STEPS  # 80


@harness.elrun_only("torchrun restarts every worker after a failure")
class KeepSurvivorsNodesTest(RegroupTestCase):

    def start_nodes(self, name, nnodes, extra=(), node2_extra=(), **job_options):
        """Node 1 (hosting the rendezvous on a reserved port, group rank 0: rank 0 prints the
        steps), then node 2 (with node2_extra too), each an elrun agent of one worker running job
        `name` (job_args with job_options)."""
        port = self.reserve_port()
        runs = []
        for node in (1, 2):
            args = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "127.0.0.1:%d" % port, "--rdzv-id", name, "--local-addr",
                    "127.0.0.%d" % node, "--node-rank", str(node - 1),
                    "--rdzv-conf", "join_timeout=60,last_call_timeout=1"] + list(extra)
            if node == 2:
                args += list(node2_extra)
            runs.append(self.launch(args, self.job_args(name, **job_options),
                                    env=self.env(GLOO_SOCKET_IFNAME="lo", LOGLEVEL="info")))
            if node == 1:  # Node 1, not node 2, hosts the coordinator: node 2 may be killed.
                self.wait_for(runs[0], "node 1 to host the rendezvous", lambda: HOSTING % port in runs[0].stderr)
        return runs

    def test_a_killed_worker_on_another_node_rejoins_from_the_survivor_to_the_uninterrupted_result(self):
        for name in ("reference", "killed"):
            os.makedirs(self.path(name))
        reference = self.start_nodes("reference", "2", ["--max-restarts", "2"])
        for run in reference:
            self.assertExit(self.wait_exit(run), 0)

        node1, node2 = self.start_nodes("killed", "2", ["--max-restarts", "2", "--keep-survivors"])
        self.wait_for(node1, "rank 0 to report step 20", lambda: self.latest_step(node1) >= 20)
        survivor = self.workers(node1).get(0)
        self.assertIsNotNone(survivor, node1.result())
        killed = self.kill_worker(node2, 1)
        self.wait_for(node1, "a regroup after rank 1 was killed on node 2", lambda: REGROUPED_LINE.search(node1.stdout),
                      node2)
        self.assertEqual(self.workers(node1).get(0), survivor, "expected node 1's worker (pid %d) to survive the kill "
                         "of node 2's and regroup in place\n%s" % (survivor, node1.result()))
        results = [self.wait_exit(run) for run in (node1, node2)]
        for result in results:
            self.assertExit(result, 0)
            self.assertEqual(RESUMED_LINE.findall(result.out), [], "expected no resume from disk\n%s" % result)
        generation, ranks, restarted, source, step, size, ms = (int(x) for x in REGROUPED_LINE.search(
            results[0].out).groups())
        self.assertEqual((ranks, restarted, source), (2, 1, 0), results[0])
        self.assertGreaterEqual(step, 20)
        self.assertRegex(results[1].err, r"local_rank 0 \(rank 1, pid %d\) ended with [^;\n]*SIGKILL" % killed)
        self.assertRegex(results[0].err, r"keeping this node's 1 worker alive to regroup in the next round")
        self.assertRegex(results[0].err, r"round 2: .*; regrouping the workers kept alive")
        for rank in (0, 1):
            self.assertEqual(self.logged_steps("killed", rank), list(range(MAX_STEPS)),
                             "expected rank %d to log every step once" % rank)
        state, worst = self.assertSameCheckpoint(
            self.path("reference", "checkpoints", "checkpoint.pt"), self.path("killed", "checkpoints", "checkpoint.pt"),
            "the final checkpoints of the uninterrupted two-node run and of the one regrouped in place")
        self.assertEqual(state["step"], MAX_STEPS)
        print("regrouped at step %d, %d ms after its collective failed; largest difference %.3g" % (step, ms, worst))

    def test_a_stopped_worker_on_another_node_is_the_only_one_killed(self):
        # Node 1's worker waits in a collective for node 2's stopped one and beats no more either:
        # its watchdog gives it a second --worker-timeout, node 2's kills the stopped worker.
        os.makedirs(self.path("stopped"))
        runs = self.start_nodes("stopped", "2", ["--max-restarts", "1", "--keep-survivors", "--worker-timeout", "1"],
                                ["--inject-faults", "stop-worker:0@step20"], max_steps=40)
        node1, node2 = runs
        self.wait_for(node1, "rank 0 to report step 10", lambda: self.latest_step(node1) >= 10)
        survivor = self.workers(node1).get(0)
        self.wait_for(node1, "a regroup after rank 1 was stopped", lambda: REGROUPED_LINE.search(node1.stdout), node2)
        self.assertEqual(self.workers(node1).get(0), survivor, "expected node 1's worker (pid %d) to survive\n%s"
                         % (survivor, node1.result()))
        results = [self.wait_exit(run) for run in runs]
        for result in results:
            self.assertExit(result, 0)
        self.assertRegex(results[0].err,
                         r"rank 0 \(local_rank 0, [^)]*\): no progress for 1\.\d s \(--worker-timeout 1\)"
                         r".*; it can regroup in place and may wait on a worker of another node: one more "
                         r"--worker-timeout before it is killed")
        self.assertNotRegex(results[0].err, r"rank 0 \(local_rank 0, [^)]*\): no progress.*killing it")
        self.assertRegex(results[1].err,
                         r"rank 1 \(local_rank 0, [^)]*\): no progress for 1\.\d s \(--worker-timeout 1\)"
                         r".*; it is stopped \(SIGSTOP or a tracer\), so no stacks; killing it")
        self.assertEqual(self.logged_steps("stopped", 0), list(range(40)))

    def test_a_lost_node_leaves_the_survivor_training_alone_in_its_process(self):
        os.makedirs(self.path("lost"))
        node1, node2 = self.start_nodes("lost", "1:2", ["--max-restarts", "2", "--keep-survivors"])
        self.wait_for(node1, "rank 0 to report step 20", lambda: self.latest_step(node1) >= 20)
        survivor = self.workers(node1).get(0)
        lost = self.workers(node2).get(1)
        self.assertIsNotNone(lost, node2.result())
        fds = harness.Pidfds([lost])
        try:
            os.kill(node2.proc.pid, signal.SIGKILL)  # The agent; its worker dies with it.
            self.assertEqual(fds.wait_all_dead(harness.DEATH_TIMEOUT_S), [],
                             "expected node 2's worker to die with its agent")
        finally:
            fds.close()
        self.wait_for(node1, "node 1's worker to regroup alone", lambda: REGROUPED_LINE.search(node1.stdout))
        self.assertEqual(self.workers(node1).get(0), survivor, "expected node 1's worker (pid %d) to go on in its "
                         "process\n%s" % (survivor, node1.result()))
        result = self.wait_exit(node1)
        self.assertExit(result, 0)
        regroup = REGROUPED_LINE.search(result.out)
        self.assertEqual(tuple(int(x) for x in regroup.groups()[1:4]), (1, 0, 0), result)
        self.assertEqual(RESUMED_LINE.findall(result.out), [], "expected no resume from disk\n%s" % result)
        self.assertRegex(result.err, r"node \S+ \(group rank 1\) lost")
        self.assertRegex(result.err, r"round 2: group rank 0 of 1, world size 1, .*regrouping the workers kept alive")
        self.assertIn("done: %d steps" % MAX_STEPS, result.out)

    def test_a_lost_node_of_a_sharded_job_is_rebuilt_from_the_survivors_copy(self):
        # fsdp: node 2's shards live on only in node 1's copy of its neighbour (every 10 steps).
        os.makedirs(self.path("sharded"))
        node1, node2 = self.start_nodes("sharded", "1:2", ["--max-restarts", "2", "--keep-survivors"],
                                        strategy="fsdp", sync_bn=None, shard_copy_every=10)
        self.wait_for(node1, "rank 0 to report step 25", lambda: self.latest_step(node1) >= 25)
        survivor = self.workers(node1).get(0)
        os.kill(node2.proc.pid, signal.SIGKILL)  # The agent; its worker dies with it.
        self.wait_for(node1, "node 1's worker to rebuild the job alone",
                      lambda: SHARDED_REGROUP_LINE.search(node1.stdout))
        self.assertEqual(self.workers(node1).get(0), survivor, "expected node 1's worker (pid %d) to go on in its "
                         "process\n%s" % (survivor, node1.result()))
        result = self.wait_exit(node1)
        self.assertExit(result, 0)
        gen, ranks, restarted, count, step, live, copies, size, back, ms = SHARDED_REGROUP_LINE.search(
            result.out).groups()
        # Both shards of the last copy's step, from node 1's own copy and its copy of node 2's.
        self.assertEqual((ranks, restarted, count, live, copies), ("1", "0", "2", "0", "2"), result)
        step, back = int(step), int(back)
        self.assertEqual(step % 10, 0)
        self.assertGreaterEqual(step, 20)
        self.assertGreater(back, step)
        self.assertEqual(RESUMED_LINE.findall(result.out), [], "expected no resume from disk\n%s" % result)
        self.assertEqual(self.logged_steps("sharded", 0), list(range(back)) + list(range(step, MAX_STEPS)),
                         "expected rank 0 to log steps 0-%d, then %d-%d at world size 1" % (back - 1, step,
                                                                                            MAX_STEPS - 1))
        self.assertIn("done: %d steps" % MAX_STEPS, result.out)
        print("node lost at step %d: went back to step %d's copies in %s ms (%s bytes)" % (back, step, ms, size))


if __name__ == "__main__":
    harness.main()
