"""A real multi-worker PyTorch job for elrun (the README's quick start): DDP over Gloo from env://.

Each rank fits the same linear model y = X w* + noise on its own shard of a synthetic data set
with torch.nn.parallel.DistributedDataParallel; rank 0 prints the loss as it falls and, at the
end, how far the learned weights are from w*. Runs unchanged under torchrun.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--features", type=int, default=32)
    args = parser.parse_args()

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    true_w = torch.randn(args.features, 1)
    gen = torch.Generator().manual_seed(1000 + rank)  # A different shard per rank.

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(args.features, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = time.time()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch_size, args.features, generator=gen)
        y = x @ true_w + 0.01 * torch.randn(args.batch_size, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 50 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)

    error = (model.module.weight.detach().t() - true_w).abs().max()
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    if rank == 0:
        samples = args.steps * args.batch_size * world
        print(f"world {world}: {samples} samples in {time.time() - start:.2f}s, "
              f"max |w - w*| = {error.item():.4f} (restart {os.environ['TORCHELASTIC_RESTART_COUNT']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
