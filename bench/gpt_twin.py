#!/usr/bin/env python3
"""gpt_twin.py: elrun-train --model gpt (or --model mlp) in Python, with PyTorch's own DDP or
FSDP2, for gpt_bench.py's same-machine comparison. Run it under torchrun of the project's torch 2.11
environment (.venv, scripts/setup.sh):

  .venv/bin/python3 tests/support/torchrun_compat.py --standalone --nproc_per_node 2 \\
      bench/gpt_twin.py --strategy fsdp2 --max-steps 20 --step-times-file /tmp/steps

What it mirrors of trainer/app/gpt.cc and train_main.cc:
- Model: the same GPT (token + position embeddings, pre-norm blocks of causal attention through
  F.scaled_dot_product_attention and a tanh-GELU MLP 4x wide, final LayerNorm, untied head without
  bias), the same parameter names, GPT-2's initialisation. For ddp it is built on the CPU after
  torch.manual_seed(--seed) in the C++ constructors' order, so the initial weights are elrun's.
- fsdp2: as PyTorch's FSDP2 documentation does it: the model built on the meta device,
  fully_shard(block) for every block, then fully_shard(model) (embed and head in the root's
  group), to_empty(device="cpu"), then initialised (so its random values differ from elrun's:
  a throughput and memory twin, not a bit-for-bit one). ddp: DistributedDataParallel with its
  defaults (25 MiB buckets). Both on gloo.
- --model mlp: elrun-train's MLP (Linear layers fc0..fcN, ReLU between, 784 inputs, 10 classes,
  --mlp-hidden widths) on a synthetic set of 4096 random examples (elrun-train --dataset synthetic
  has as many; their values differ: a throughput and memory twin), in the sampler's order; fsdp2:
  fully_shard(layer) for every Linear, then the root.
- Data: the *.py files directly in the newest /usr/lib/python3.N (or --data-dir), sorted by name,
  every 10th validation, cut into --gpt-context + 1 byte windows overlapping by one byte
  (trainer/data/text_corpus.cc); the order of trainer/data/sampler.cc (fashion_twin's mt19937_64).
- Step: zero_grad, cross-entropy over every position of the forward, backward, loss.item(), the
  learning rate (constant), AdamW(lr, weight_decay).step(). --compile: torch.compile on the model
  (each block for fsdp2) before training.
- Measurements, as elrun-train writes them: each rank appends "step, step_ms, cpu_ms" lines to
  --step-times-file.<rank>; each rank prints `memory-json {"rank":R,"peak_rss_bytes":..,
  "baseline_rss_bytes":..}` (VmHWM at the end; VmRSS after the process group and the data, before
  the model), and rank 0 appends an end record {"event":"end","samples_per_s":..} to
  --metrics-file.
"""
import argparse
import datetime
import glob
import json
import os
import sys
import time

import numpy as np
from fashion_twin import epoch_order, rank_batches

VALIDATION_EVERY = 10


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def default_text_dir():
    best = None
    for path in glob.glob("/usr/lib/python3.*"):
        minor = path.rsplit(".", 1)[-1]
        if minor.isdigit() and len(glob.glob(os.path.join(path, "*.py"))) >= VALIDATION_EVERY:
            if best is None or int(minor) > best[0]:
                best = (int(minor), path)
    if best is None:
        raise SystemExit("gpt_twin: no /usr/lib/python3.N with *.py files; pass --data-dir")
    return best[1]


def train_windows(data_dir, context):
    files = sorted(f for f in glob.glob(os.path.join(data_dir, "*.py")) if os.path.isfile(f))
    train = [f for i, f in enumerate(files) if (i + 1) % VALIDATION_EVERY != 0]
    text = b"".join(open(f, "rb").read() for f in train)
    data = np.frombuffer(text, dtype=np.uint8)
    n = (len(data) - 1) // context
    return np.lib.stride_tricks.as_strided(data, shape=(n, context + 1), strides=(context, 1))


def build_mlp(args, device):
    import torch.nn as nn
    import torch.nn.functional as F

    widths = [28 * 28] + args.mlp_hidden + [10]

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            for i, (a, b) in enumerate(zip(widths, widths[1:])):
                self.add_module("fc%d" % i, nn.Linear(a, b))
            self.layers = [getattr(self, "fc%d" % i) for i in range(len(widths) - 1)]

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i + 1 < len(self.layers):
                    x = F.relu(x)
            return x

    def init(model):
        for layer in model.layers:
            layer.reset_parameters()

    return wrap(args, device, lambda initialised: Mlp(), lambda model: model.layers, init)


def wrap(args, device, make, units, init):
    """ddp: make(True) on the CPU after torch.manual_seed(--seed), in DistributedDataParallel.
    fsdp2: make(False) on the meta device, fully_shard on each of units(model), then on the root,
    materialised on `device` and init(model). --compile: the model (fsdp2: each unit) compiled."""
    import torch
    import torch.nn as nn

    torch.manual_seed(args.seed)
    if args.strategy == "ddp":
        model = make(True).to(device)
        if args.compile:
            model = torch.compile(model)
        return model, nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),))
    with torch.device("meta"):
        model = make(False)
    for unit in units(model):
        if args.compile:
            unit.compile()
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        init(model)
    return model, model


def build(args, device):
    if args.model == "mlp":
        return build_mlp(args, device)
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    std = 0.02

    class Embedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(256, args.gpt_width)
            self.positions = nn.Embedding(args.gpt_context, args.gpt_width)

        def init(self):
            nn.init.normal_(self.tokens.weight, 0.0, std)
            nn.init.normal_(self.positions.weight, 0.0, std)

        def forward(self, tokens):
            return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            w = args.gpt_width
            self.ln1 = nn.LayerNorm(w)
            self.qkv = nn.Linear(w, 3 * w)
            self.proj = nn.Linear(w, w)
            self.ln2 = nn.LayerNorm(w)
            self.fc1 = nn.Linear(w, 4 * w)
            self.fc2 = nn.Linear(4 * w, w)

        def init(self):
            residual = std / math.sqrt(2.0 * args.gpt_layers)
            for linear, s in ((self.qkv, std), (self.proj, residual), (self.fc1, std), (self.fc2, residual)):
                nn.init.normal_(linear.weight, 0.0, s)
                nn.init.zeros_(linear.bias)
            for norm in (self.ln1, self.ln2):
                nn.init.ones_(norm.weight)
                nn.init.zeros_(norm.bias)

        def forward(self, x):
            b, t, w = x.shape
            qkv = self.qkv(self.ln1(x)).view(b, t, 3, args.gpt_heads, w // args.gpt_heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + self.proj(attended.transpose(1, 2).reshape(b, t, w))
            return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(args.gpt_width)
            self.out = nn.Linear(args.gpt_width, 256, bias=False)

        def init(self):
            nn.init.ones_(self.norm.weight)
            nn.init.zeros_(self.norm.bias)
            nn.init.normal_(self.out.weight, 0.0, std)

    class Gpt(nn.Module):
        def __init__(self, init):
            super().__init__()
            # Constructed and initialised child by child, as the C++ constructor does.
            self.embed = Embedding()
            if init:
                self.embed.init()
            self.blocks = nn.ModuleList()
            for _ in range(args.gpt_layers):
                self.blocks.append(Block())
                if init:
                    self.blocks[-1].init()
            self.head = Head()
            if init:
                self.head.init()

        def init_weights(self):
            self.embed.init()
            for block in self.blocks:
                block.init()
            self.head.init()

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head.out(self.head.norm(x))

    return wrap(args, device, lambda initialised: Gpt(init=initialised), lambda model: model.blocks,
                lambda model: model.init_weights())


def train(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    if args.model == "mlp":
        generator = torch.Generator().manual_seed(args.seed)
        images = torch.randn(4096, 28 * 28, generator=generator)
        labels = torch.randint(10, (4096,), generator=generator)
        windows = images
    else:
        windows = train_windows(args.data_dir or default_text_dir(), args.gpt_context)
    baseline = status_bytes("VmRSS:")
    model, wrapped = build(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    times = open("%s.%d" % (args.step_times_file, rank), "a") if args.step_times_file else None
    if times:
        times.write("step\tstep_ms\tcpu_ms\n")
    batches = rank_batches(epoch_order(len(windows), args.seed, 0), world, rank, args.batch_size)
    start = time.perf_counter()
    steps = 0
    for batch in batches[:args.max_steps]:
        t0, c0 = time.perf_counter(), time.thread_time()
        if args.model == "mlp":
            index = torch.as_tensor(batch, dtype=torch.long)
            inputs, targets = images[index], labels[index]
        else:
            rows = torch.from_numpy(np.ascontiguousarray(windows[batch])).long()
            inputs, targets = rows[:, :-1], rows[:, 1:]
        optimizer.zero_grad()
        logits = wrapped(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        loss.backward()
        last_loss = loss.item()
        optimizer.step()
        if times:
            times.write("%d\t%.3f\t%.3f\n" % (steps, (time.perf_counter() - t0) * 1e3,
                                              (time.thread_time() - c0) * 1e3))
            times.flush()
        steps += 1
    elapsed = time.perf_counter() - start
    rate = steps * args.batch_size * world / max(elapsed, 1e-9)
    print("memory-json " + json.dumps({"rank": rank, "strategy": args.strategy,
                                       "peak_rss_bytes": status_bytes("VmHWM:"),
                                       "baseline_rss_bytes": baseline},
                                      separators=(",", ":")), flush=True)
    if rank == 0:
        tokens = "" if args.model == "mlp" else f"{rate * args.gpt_context:.0f} tokens/s, "
        print(f"done: {steps} steps, {elapsed:.1f} s, {rate:.0f} samples/s, {tokens}last loss {last_loss:.4f}",
              flush=True)
        if args.metrics_file:
            with open(args.metrics_file, "a") as f:
                f.write(json.dumps({"event": "end", "samples_per_s": round(rate, 1), "steps": steps,
                                    "seconds": round(elapsed, 2), "world_size": world,
                                    "loss": round(last_loss, 6)}) + "\n")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # As fashion_twin: no destructors that could deadlock at interpreter exit.


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (fsdp2: each block)")
    ap.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    ap.add_argument("--mlp-hidden", type=lambda text: [int(w) for w in text.split(",")], default=[256, 128],
                    help="--model mlp: comma-separated hidden widths")
    ap.add_argument("--gpt-layers", type=int, default=4)
    ap.add_argument("--gpt-width", type=int, default=128)
    ap.add_argument("--gpt-heads", type=int, default=4)
    ap.add_argument("--gpt-context", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir")
    ap.add_argument("--step-times-file")
    ap.add_argument("--metrics-file")
    train(ap.parse_args())


if __name__ == "__main__":
    main()
