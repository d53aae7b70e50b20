"""FSDP2 (torch.distributed.fsdp.fully_shard) with torch.distributed.checkpoint, on CPU (Gloo).

Usage: fsdp2_dcp.py CKPT_DIR TOTAL_STEPS [--stop-at N] [--save-every N] [--kill-at N]
(under elrun or torchrun, --nproc-per-node 2). A small MLP is sharded across the ranks with
fully_shard and trained with AdamW on batches drawn from a generator seeded by (step, rank), so a
step's data does not depend on how the job got there. Checkpoints are DCP directories
CKPT_DIR/step_<N> (model and optimizer state dicts through get_state_dict, and the step); DCP
writes .metadata last, so a directory that has one is complete. At start the job resumes from the
newest complete one; it saves every --save-every steps, after --stop-at steps (and then exits 0)
and at the end. --kill-at N: on the first attempt only (TORCHELASTIC_RESTART_COUNT 0), rank 1
SIGKILLs itself before step N, for the launcher to restart the group.
Rank 0 prints one line, `RESULT {json}`: the attempt, the step it started from, the loss
(averaged over the ranks) at each step it ran, and a checksum of the full final weights.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import job_common


def batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 12, generator=gen)
    return x, torch.tanh(x[:, :4] * 2.0).sum(dim=1, keepdim=True)


def save(ckpt_dir, model, optimizer, step):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)},
             checkpoint_id=os.path.join(ckpt_dir, "step_%d" % step))


def newest_checkpoint(ckpt_dir):
    """The newest complete CKPT_DIR/step_<N>, or None."""
    steps = [int(name[5:]) for name in os.listdir(ckpt_dir) if name.startswith("step_")
             and os.path.exists(os.path.join(ckpt_dir, name, ".metadata"))] if os.path.isdir(ckpt_dir) else []
    return os.path.join(ckpt_dir, "step_%d" % max(steps)) if steps else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("total_steps", type=int)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.GELU(), torch.nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    start, resumed = 0, newest_checkpoint(args.ckpt_dir)
    if resumed:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=resumed)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    end = args.stop_at if args.stop_at is not None else args.total_steps
    losses = []
    for step in range(start, end):
        if args.kill_at == step and attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if args.save_every and (step + 1) % args.save_every == 0:
            save(args.ckpt_dir, model, optimizer, step + 1)
    if end > start and (not args.save_every or end % args.save_every):
        save(args.ckpt_dir, model, optimizer, end)

    full = [p.full_tensor().flatten() for p in model.parameters()]  # A collective: every rank calls it.
    if rank == 0:
        weights = torch.cat(full)
        job_common.report({
            "attempt": attempt, "world_size": dist.get_world_size(), "start_step": start, "end_step": end,
            "resumed_from": resumed and os.path.basename(resumed),
            "losses": losses, "weights_sum": weights.sum().item(), "weights_norm": weights.norm().item()})
    job_common.leave()


if __name__ == "__main__":
    main()
