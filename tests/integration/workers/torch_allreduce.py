"""Worker: checks the whole worker environment contract, then proves it by building a gloo process
group from env:// and all-reducing across every rank.

Expected exact values come from the JSON in ELRUN_TEST_EXPECT ({"VAR": "value" or null for
"must be unset"}); the relations between variables are checked here for every job. Any mismatch
raises (non-zero exit, traceback on stderr). On success writes <OUT_DIR>/torch_<RANK>.json with the
contract variables, the all_reduce result and the pid.
With FAIL_RANK=<rank>, that rank exits 1 right after the all_reduce while
TORCHELASTIC_RESTART_COUNT is 0 (a failure in the middle of a live process group).
"""
import json
import os
import sys

CONTRACT = [
    "LOCAL_RANK", "RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE",
]


def check(condition, message):
    if not condition:
        raise AssertionError("rank %s: %s" % (os.environ.get("RANK"), message))


def check_contract(env, expect, relax):
    for key, want in expect.items():
        if key in relax:
            continue
        check(env.get(key) == want, "expected %s=%r, got %r" % (key, want, env.get(key)))
    for key in ("LOCAL_RANK", "RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        check(env.get(key, "").isdigit(), "expected %s to be a non-negative integer, got %r"
              % (key, env.get(key)))
    n = {k: int(env[k]) for k in ("LOCAL_RANK", "RANK", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                  "ROLE_RANK", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                  "WORLD_SIZE", "MASTER_PORT")}
    check(0 <= n["LOCAL_RANK"] < n["LOCAL_WORLD_SIZE"], "expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE")
    check(0 <= n["GROUP_RANK"] < n["GROUP_WORLD_SIZE"], "expected 0 <= GROUP_RANK < GROUP_WORLD_SIZE")
    check(n["WORLD_SIZE"] == n["GROUP_WORLD_SIZE"] * n["LOCAL_WORLD_SIZE"],
          "expected WORLD_SIZE = GROUP_WORLD_SIZE * LOCAL_WORLD_SIZE (same nproc on every node)")
    check(n["RANK"] == n["GROUP_RANK"] * n["LOCAL_WORLD_SIZE"] + n["LOCAL_RANK"],
          "expected RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK")
    check(n["ROLE_RANK"] == n["RANK"] and n["ROLE_WORLD_SIZE"] == n["WORLD_SIZE"],
          "expected ROLE_RANK/ROLE_WORLD_SIZE = RANK/WORLD_SIZE with one role")
    check(1 <= n["MASTER_PORT"] <= 65535, "expected MASTER_PORT in 1..65535")
    check(env.get("TORCHELASTIC_RUN_ID"), "expected a non-empty TORCHELASTIC_RUN_ID")
    check(env.get("TORCHELASTIC_USE_AGENT_STORE") == "False" or
          "TORCHELASTIC_USE_AGENT_STORE" in relax,
          "expected TORCHELASTIC_USE_AGENT_STORE=False, got %r"
          % env.get("TORCHELASTIC_USE_AGENT_STORE"))
    if "TORCHELASTIC_ERROR_FILE" not in relax:
        suffix = "/%s/attempt_%s/%s/error.json" % (env["TORCHELASTIC_RUN_ID"],
                                                   env["TORCHELASTIC_RESTART_COUNT"],
                                                   env["LOCAL_RANK"])
        check(env.get("TORCHELASTIC_ERROR_FILE", "").endswith(suffix),
              "expected TORCHELASTIC_ERROR_FILE to end with %r, got %r"
              % (suffix, env.get("TORCHELASTIC_ERROR_FILE")))


def main():
    env = dict(os.environ)
    expect = json.loads(env.get("ELRUN_TEST_EXPECT", "{}"))
    relax = set(json.loads(env.get("ELRUN_TEST_RELAX", "[]")))
    unset = [k for k, v in expect.items() if v is None]
    for key in unset:
        check(key not in env, "expected %s to be unset, got %r" % (key, env.get(key)))
    check_contract(env, {k: v for k, v in expect.items() if v is not None}, relax)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    check(rank == int(env["RANK"]), "expected dist.get_rank() == RANK")
    check(world == int(env["WORLD_SIZE"]), "expected dist.get_world_size() == WORLD_SIZE")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    check(t.item() == world * (world + 1) / 2,
          "expected all_reduce sum %s, got %s" % (world * (world + 1) / 2, t.item()))
    if env.get("FAIL_RANK") == env["RANK"] and env["TORCHELASTIC_RESTART_COUNT"] == "0":
        print("torch_allreduce: rank %s failing on purpose" % rank, file=sys.stderr)
        sys.exit(1)
    ports = [None] * world
    dist.all_gather_object(ports, env["MASTER_PORT"])
    check(len(set(ports)) == 1, "expected one MASTER_PORT across ranks, got %r" % ports)
    dist.barrier()
    dist.destroy_process_group()

    out_dir = env["OUT_DIR"]
    record = {k: env.get(k) for k in CONTRACT}
    record.update({"all_reduce": t.item(), "pid": os.getpid(), "argv": sys.argv,
                   "inherited": env.get("ELRUN_TEST_INHERITED")})
    tmp = os.path.join(out_dir, "torch_%d.json.tmp" % rank)
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.rename(tmp, os.path.join(out_dir, "torch_%d.json" % rank))


if __name__ == "__main__":
    main()
