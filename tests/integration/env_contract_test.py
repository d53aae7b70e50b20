"""The worker environment contract (docs/architecture.md), pinned line by line.

Real PyTorch workers (gloo, init_method=env://, all_reduce) check the contract from inside and
write what they saw; the test checks the files again across ranks. Cheap Python workers
(dump_env.py) cover the variants that need no process group.
"""
import json
import os

import harness
from harness import ElrunTestCase, worker

TORCH_WORKER = worker("torch_allreduce.py")
DUMP_ENV = worker("dump_env.py")

class TorchWorkersTest(ElrunTestCase):

    def run_torch_job(self, args, expect, extra_env=None, nproc=None):
        env = self.env(ELRUN_TEST_EXPECT=json.dumps(expect), ELRUN_TEST_INHERITED="inherited-value",
                       **(extra_env or {}))
        result = self.elrun(args + [TORCH_WORKER, "arg-${local_rank}"], env=env, timeout=60)
        self.assertExit(result, 0)
        records = {}
        for rank in range(nproc):
            path = self.path("torch_%d.json" % rank)
            self.assertTrue(os.path.exists(path), "expected worker of rank %d to write %s\n%s"
                            % (rank, path, result))
            records[rank] = self.read_json("torch_%d.json" % rank)
        self.assertEqual(sorted(n for n in os.listdir(self.tmp) if n.startswith("torch_")),
                         sorted("torch_%d.json" % r for r in range(nproc)),
                         "expected exactly %d worker records (one per rank)" % nproc)
        return records

    def test_standalone_four_workers_all_reduce_and_full_contract(self):
        logs = self.path("logs")
        expect = {
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "1", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        }
        records = self.run_torch_job(
            ["--standalone", "--nproc_per_node", "4", "--monitor_interval", "0.1",
             "--log_dir", logs], expect, nproc=4)
        self.assertEqual(sorted(int(r["RANK"]) for r in records.values()), [0, 1, 2, 3],
                         "expected unique RANKs 0..3")
        for rank, r in records.items():
            self.assertEqual(r["LOCAL_RANK"], str(rank), "expected LOCAL_RANK == RANK on one node")
            self.assertEqual(r["ROLE_RANK"], str(rank), "expected ROLE_RANK == RANK with one role")
            self.assertEqual(r["all_reduce"], 10.0, "expected all_reduce of 1+2+3+4")
            self.assertEqual(r["inherited"], "inherited-value",
                             "expected the launcher's other variables to be inherited")
            self.assertEqual(r["argv"][1:], ["arg-%d" % rank],
                             "expected ${local_rank} in script args to be substituted")
        self.assertEqual(len({r["MASTER_PORT"] for r in records.values()}), 1,
                         "expected one MASTER_PORT for all workers")
        self.assertEqual(len({r["pid"] for r in records.values()}), 4,
                         "expected 4 distinct worker processes")
        run_ids = {r["TORCHELASTIC_RUN_ID"] for r in records.values()}
        self.assertEqual(len(run_ids), 1, "expected one TORCHELASTIC_RUN_ID for all workers")
        run_id = run_ids.pop()
        self.assertNotIn(run_id, ("", "none"),
                         "expected --standalone without --rdzv-id to generate a run id")
        if not harness.TORCHRUN_REFERENCE:
            for rank, r in records.items():
                self.assertEqual(r["TORCHELASTIC_ERROR_FILE"],
                                 os.path.join(logs, run_id, "attempt_0", str(rank), "error.json"),
                                 "expected TORCHELASTIC_ERROR_FILE = "
                                 "<log_dir>/<run_id>/attempt_<n>/<local_rank>/error.json")

    def test_static_with_master_port_role_run_id_and_inherited_settings(self):
        port = self.reserve_port()
        logs = self.path("logs")
        expect = {
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "trainer",
            "ROLE_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_RUN_ID": "job-42", "TORCHELASTIC_USE_AGENT_STORE": "False",
            # Set in the launcher's environment: kept as they are.
            "NCCL_ASYNC_ERROR_HANDLING": "0", "OMP_NUM_THREADS": "3",
            # Unset there: the default.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        }
        records = self.run_torch_job(
            ["--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", str(port), "--rdzv_id", "job-42", "--role", "trainer",
             "--max_restarts", "3", "--monitor_interval", "0.1", "--log_dir", logs],
            expect, extra_env={"OMP_NUM_THREADS": "3", "NCCL_ASYNC_ERROR_HANDLING": "0"},
            nproc=2)
        self.assertEqual(sorted(int(r["RANK"]) for r in records.values()), [0, 1],
                         "expected unique RANKs 0..1")
        for rank, r in records.items():
            self.assertEqual(r["all_reduce"], 3.0, "expected all_reduce of 1+2")
            if not harness.TORCHRUN_REFERENCE:
                self.assertEqual(r["TORCHELASTIC_ERROR_FILE"],
                                 os.path.join(logs, "job-42", "attempt_0", str(rank),
                                              "error.json"),
                                 "expected the error file under <log_dir>/job-42/attempt_0/")


class DumpEnvTest(ElrunTestCase):
    """Contract variants checked with a worker that only records its environment."""

    def records(self, result, count):
        self.assertExit(result, 0)
        names = sorted(n for n in os.listdir(self.tmp) if n.startswith("env_"))
        self.assertEqual(len(names), count, "expected %d worker records, got %r\n%s"
                         % (count, names, result))
        return [self.read_json(n) for n in names]

    def test_defaults_with_one_worker(self):
        result = self.elrun([DUMP_ENV, self.tmp],
                            env=self.env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"))
        (rec,) = self.records(result, 1)
        env = rec["env"]
        expect = {"LOCAL_RANK": "0", "RANK": "0", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                  "ROLE_NAME": "default", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1",
                  "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                  "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                  "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
                  "NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
        if harness.TORCHRUN_REFERENCE:
            expect.pop("TORCHELASTIC_USE_AGENT_STORE")
        for key, value in expect.items():
            self.assertEqual(env.get(key), value, "expected %s=%s (defaults, nproc 1)"
                             % (key, value))
        self.assertNotIn("OMP_NUM_THREADS", env,
                         "expected OMP_NUM_THREADS to stay unset with one worker per node")
        self.assertTrue(env.get("MASTER_PORT", "").isdigit(), "expected a numeric MASTER_PORT")
        if not harness.TORCHRUN_REFERENCE:
            self.assertRegex(env.get("TORCHELASTIC_ERROR_FILE", ""),
                             r"/none/attempt_0/0/error\.json$",
                             "expected the error file under <default log dir>/none/attempt_0/0/")

    def test_two_static_nodes_rank_layout(self):
        port = self.reserve_port()
        self.check_two_static_nodes(["--master_addr", "127.0.0.1", "--master_port", str(port)], port)

    def test_two_static_nodes_through_rdzv_endpoint(self):
        # torchrun's default backend is static: --rdzv-endpoint HOST:PORT is node 0's store, so
        # the workers' MASTER_ADDR:MASTER_PORT, and no other port is opened.
        port = self.reserve_port()
        self.check_two_static_nodes(["--rdzv_endpoint", "127.0.0.1:%d" % port], port)

    def check_two_static_nodes(self, address_args, port):
        procs = []
        for node in (0, 1):
            procs.append(self.start(
                ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2"] + address_args +
                ["--rdzv_id", "two-nodes", "--monitor_interval", "0.1", DUMP_ENV, self.tmp]))
        results = [self.finish(p) for p in procs]
        for result in results:
            self.assertExit(result, 0)
        recs = self.records(results[1], 4)
        by_rank = {int(r["env"]["RANK"]): r["env"] for r in recs}
        self.assertEqual(sorted(by_rank), [0, 1, 2, 3], "expected RANKs 0..3 across two nodes")
        for rank, env in by_rank.items():
            node, local = divmod(rank, 2)
            want = {"LOCAL_RANK": str(local), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": "2",
                    "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                    "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "TORCHELASTIC_RUN_ID": "two-nodes"}
            for key, value in want.items():
                self.assertEqual(env.get(key), value, "expected %s=%s for RANK %d "
                                 "(--nnodes 2, node_rank*nproc + local_rank)" % (key, value, rank))

    def test_omp_num_threads_warning_printed_once(self):
        result = self.elrun(["--nproc_per_node", "3", DUMP_ENV, self.tmp])
        recs = self.records(result, 3)
        for rec in recs:
            self.assertEqual(rec["env"].get("OMP_NUM_THREADS"), "1",
                             "expected OMP_NUM_THREADS=1 with nproc 3 when unset")
        warnings = [l for l in result.err.splitlines() if "OMP_NUM_THREADS" in l]
        self.assertEqual(len(warnings), 1, "expected one OMP_NUM_THREADS warning line on "
                         "stderr, not one per worker\n%s" % result)

    def test_no_omp_warning_when_set(self):
        result = self.elrun(["--nproc_per_node", "2", DUMP_ENV, self.tmp],
                            env=self.env(OMP_NUM_THREADS="2"))
        for rec in self.records(result, 2):
            self.assertEqual(rec["env"].get("OMP_NUM_THREADS"), "2",
                             "expected a set OMP_NUM_THREADS to be inherited")
        self.assertNotIn("OMP_NUM_THREADS", result.err,
                         "expected no OMP_NUM_THREADS warning when it is set\n%s" % result)

    @harness.elrun_only("--local-addr and generated ids per run are elrun's")
    def test_standalone_local_addr_and_generated_run_ids(self):
        run_ids = []
        for attempt in range(2):
            out = self.path("run%d" % attempt)
            os.mkdir(out)
            result = self.elrun(["--standalone", "--local-addr", "localhost", DUMP_ENV, out])
            self.assertExit(result, 0)
            rec = self.read_json(os.path.join(out, "env_r0_a0.json"))
            self.assertEqual(rec["env"].get("MASTER_ADDR"), "localhost",
                             "expected --standalone to use --local-addr as MASTER_ADDR")
            run_ids.append(rec["env"].get("TORCHELASTIC_RUN_ID"))
        self.assertNotIn(run_ids[0], (None, "", "none"), "expected a generated run id")
        self.assertNotEqual(run_ids[0], run_ids[1], "expected a fresh run id per standalone run")
        out = self.path("fixed")
        os.mkdir(out)
        result = self.elrun(["--standalone", "--rdzv-id", "given-id", DUMP_ENV, out])
        self.assertExit(result, 0)
        rec = self.read_json(os.path.join(out, "env_r0_a0.json"))
        self.assertEqual(rec["env"].get("TORCHELASTIC_RUN_ID"), "given-id",
                         "expected --standalone to keep an explicit --rdzv-id")
        self.assertEqual(rec["env"].get("MASTER_ADDR"), "127.0.0.1",
                         "expected --standalone without --local-addr to use 127.0.0.1")


if __name__ == "__main__":
    harness.main()
