"""Worker: a PyTorch DDP job over Gloo that checkpoints and resumes, as restart-on-failure
experiments run. `torch_ddp_resume.py CKPT STEPS EVERY PAUSE [beat|auto]`: an MLP trained with
AdamW on a fixed batch for STEPS steps, each followed by PAUSE seconds; rank 0 saves model and
optimizer to CKPT every EVERY steps (atomically); every rank starts from it. `beat` (the default)
calls elrun_heartbeat.beat(step) after each step; `auto` never does (for --auto-heartbeat).
Prints "rank R starts at step S pid P torch_preloaded T" first."""
import os
import sys
import time

preloaded = "torch" in sys.modules  # True when forked from elrun's forkserver.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "launcher",
                                "python"))
import elrun_heartbeat  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    ckpt, steps, every, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    beat = (sys.argv[5] if len(sys.argv) > 5 else "beat") == "beat"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    print("rank %d starts at step %d pid %d torch_preloaded %s" % (rank, start, os.getpid(), preloaded), flush=True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    for step in range(start, steps):
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()
        if beat:
            elrun_heartbeat.beat(step)
        if rank == 0 and (step + 1) % every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        time.sleep(pause)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
