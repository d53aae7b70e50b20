"""Worker for multi-node elastic jobs: checks the rank variables, builds a gloo process group from
env://, all-reduces STEPS times checking each sum against the current world, and gathers every
rank's view of the job to check that all ranks agree (unique ranks 0..WORLD_SIZE-1, one restart
count, one master, each node's ranks a contiguous block at the prefix sum of the nodes' nproc by
group rank). Any mismatch raises (non-zero exit, traceback on stderr).
Then writes <OUT_DIR>/torch_w<WORLD_SIZE>_r<RANK>.json and one ready line on $READY, key=value
pairs as rdzv_harness.WORKER writes them. When WORLD_SIZE is listed in HOLD_WORLDS ("8 10"), it
starts a grandchild first (child=<pid> in the ready line) and holds until elrun stops it.
"""
import datetime
import json
import os
import subprocess
import sys
import time

STEPS = 5
HOLD_LIMIT_S = 120  # A held worker that elrun never stops fails the job after this.
INTS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")


def check(condition, message):
    if not condition:
        raise AssertionError("rank %s: %s" % (os.environ.get("RANK"), message))


def check_views(views, world):
    """views: every rank's (rank, group_rank, local_rank, nproc, restarts, master, run_id)."""
    check(sorted(v[0] for v in views) == list(range(world)),
          "expected ranks 0..%d once each, got %r" % (world - 1, sorted(v[0] for v in views)))
    check(len({v[4:] for v in views}) == 1,
          "expected one restart count, master and run id across ranks, got %r"
          % sorted({v[4:] for v in views}))
    nodes = {}
    for rank, group, local, nproc, *_ in views:
        nodes.setdefault(group, {"nproc": nproc, "ranks": []})["ranks"].append((local, rank))
    check(sorted(nodes) == list(range(len(nodes))),
          "expected group ranks 0..%d, got %r" % (len(nodes) - 1, sorted(nodes)))
    offset = 0
    for group in sorted(nodes):
        node = nodes[group]
        want = [(local, offset + local) for local in range(node["nproc"])]
        check(sorted(node["ranks"]) == want,
              "expected group rank %d's (local_rank, rank) to be %r, got %r"
              % (group, want, sorted(node["ranks"])))
        offset += node["nproc"]
    check(offset == world, "expected WORLD_SIZE %d to be the sum of nproc %d" % (world, offset))


def main():
    env = os.environ
    for key in INTS:
        check(env.get(key, "").isdigit(), "expected %s to be an integer, got %r"
              % (key, env.get(key)))
    n = {key: int(env[key]) for key in INTS}
    check(0 <= n["LOCAL_RANK"] < n["LOCAL_WORLD_SIZE"],
          "expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE")
    check(0 <= n["GROUP_RANK"] < n["GROUP_WORLD_SIZE"],
          "expected 0 <= GROUP_RANK < GROUP_WORLD_SIZE")
    check(n["LOCAL_RANK"] <= n["RANK"] < n["WORLD_SIZE"],
          "expected LOCAL_RANK <= RANK < WORLD_SIZE")

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    check(rank == n["RANK"], "expected dist.get_rank() %d == RANK" % rank)
    check(world == n["WORLD_SIZE"], "expected dist.get_world_size() %d == WORLD_SIZE" % world)
    sums = []
    for step in range(STEPS):
        t = torch.tensor([float(rank + 1 + step)])
        dist.all_reduce(t)
        want = world * (world + 1) / 2 + world * step
        check(t.item() == want,
              "step %d: expected all_reduce sum %s, got %s" % (step, want, t.item()))
        sums.append(t.item())
    views = [None] * world
    dist.all_gather_object(views, (rank, n["GROUP_RANK"], n["LOCAL_RANK"], n["LOCAL_WORLD_SIZE"],
                                   n["TORCHELASTIC_RESTART_COUNT"],
                                   "%s:%s" % (env["MASTER_ADDR"], env["MASTER_PORT"]),
                                   env["TORCHELASTIC_RUN_ID"]))
    check_views(views, world)
    dist.barrier()
    dist.destroy_process_group()

    record = {key.lower(): n[key] for key in INTS}
    record.update({"master_addr": env["MASTER_ADDR"], "run_id": env["TORCHELASTIC_RUN_ID"],
                   "node": int(env["NODE"]), "sums": sums, "pid": os.getpid()})
    out = os.path.join(env["OUT_DIR"], "torch_w%d_r%d.json" % (world, rank))
    with open(out + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(out + ".tmp", out)

    hold = str(world) in env.get("HOLD_WORLDS", "").split()
    line = ("node=%s run=%s group=%d groups=%d rank=%d local=%d nproc=%d world=%d restarts=%d "
            "master_addr=%s master_port=%s pid=%d"
            % (env["NODE"], env["TORCHELASTIC_RUN_ID"], n["GROUP_RANK"], n["GROUP_WORLD_SIZE"],
               rank, n["LOCAL_RANK"], n["LOCAL_WORLD_SIZE"], world,
               n["TORCHELASTIC_RESTART_COUNT"], env["MASTER_ADDR"], env["MASTER_PORT"],
               os.getpid()))
    if hold:
        child = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        line += " child=%d" % child.pid
    with open(env["READY"], "w") as f:
        f.write(line + "\n")
    if hold:
        time.sleep(HOLD_LIMIT_S)  # Not a synchronisation: elrun stops this worker long before.
        print("torch_elastic: held %d s and was never stopped" % HOLD_LIMIT_S, file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
