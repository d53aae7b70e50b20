#!/usr/bin/env python3
"""fashion_twin.py: a Python PyTorch DDP twin of elrun-train, for a fair same-machine comparison.

Run it under torchrun of the project's torch 2.11 environment (.venv, scripts/setup.sh):

  .venv/bin/python3 tests/support/torchrun_compat.py --standalone --nproc_per_node 2 \\
      bench/fashion_twin.py --max-steps 300 --lr-schedule constant --metrics-file m.jsonl

--device cuda (one GPU per rank, cuda:LOCAL_RANK) trains on the GPU with nccl, as elrun-train's
--device cuda does: each batch is gathered into pinned host memory and copied without blocking.

It does what trainer/app/train_main.cc does, step for step, with Python's own tools:
- Model: FashionNet (trainer/app/models.cc: conv1 1->32 3x3 pad 1, bn1, ReLU, maxpool 2, conv2 32->64
  3x3 pad 1, bn2, ReLU, maxpool 2, flatten, fc1 3136->128, ReLU, fc2 128->10) or the MLP
  (Linear 784->256->128->10, ReLU between), built after torch.manual_seed(--seed) with the
  modules constructed in the same order as in C++. LibTorch here is the torch 2.11 wheel's, the
  same library as this interpreter's torch, so the initial weights come out identical.
- Data: Fashion-MNIST read from the gzip IDX files in --data-dir, whole into memory, normalized
  exactly like trainer/data/fashion_mnist.cc: float32((v / 255.0 - 0.2860) / 0.3530), computed in
  double, per pixel value v.
- Data order: trainer/data/sampler.cc replicated exactly: per epoch a std::mt19937_64 seeded with
  seed + epoch (implemented below with numpy, checked against the C++ standard library), a
  Fisher-Yates shuffle from the back drawing j = Below(gen, i + 1) by rejection, rank r takes
  positions r, r + W, ... of the order, drop_last, batches of --batch-size per rank (the last one
  of an epoch may be smaller). This order is computed inside the timed loop, as in elrun-train.
- Step: index_select of the batch from the in-memory tensors, optimizer.zero_grad() (2.x
  default: gradients set to None, as LibTorch 2.11's), cross_entropy on the DDP forward, backward,
  loss.item(), then the learning rate of this step is set (--lr-schedule: constant, or cosine
  lr = base * 0.5 * (1 + cos(pi * t)), t = (epoch * N + p) / (epochs * N), p = samples of this
  epoch all ranks consumed before this step), then SGD(lr, momentum, weight_decay).step().
- DDP: torch.nn.parallel.DistributedDataParallel on gloo with its defaults (25 MiB buckets,
  broadcast_buffers=True: BatchNorm buffers are broadcast from rank 0 before every forward) and
  plain BatchNorm2d (PyTorch's SyncBatchNorm refuses CPU tensors).
- Throughput, as elrun-train measures it: samples_per_s = steps done x batch x world size over
  the time from just before the first training step (after data loading, process-group and DDP
  set-up) to the end of the last step. Test accuracy afterwards over rank-strided shards of the
  test set in chunks of 1000, summed with an all-reduce, as in elrun-train.
- --memory-format channels-last: the model's weights in NHWC, as elrun-train's default on CPU
  (contiguous, PyTorch's default, unless asked). --profile-steps FIRST:END --profile-trace PATH:
  torch.profiler over those steps, each marked "ProfilerStep#N" as elrun-train marks its own, so
  that tests/support/trace_summary.py reads both traces alike (PATH.<rank>).
- Metrics: rank 0 appends JSON lines to --metrics-file: {"event":"step",...} every --log-every
  steps and at the end {"event":"end","test_accuracy":..,"samples_per_s":..,"steps":..,
  "epochs":..,"seconds":..,"world_size":..}, the same records as elrun-train.

Not mirrored: checkpoints, --accum-steps, --sync-bn, the synthetic dataset. Allocator: this
script keeps Python's and glibc's defaults, as a user would; elrun-train raises glibc's mmap
threshold to 256 MiB and its trim threshold to 1 GiB at start (mallopt in train_main.cc), because
with glibc's adaptive mmap threshold the per-step tensors were mmap/munmap-ed every step. Gloo's
device is Python's default (GLOO_SOCKET_IFNAME or the host name's interface); elrun-train makes
its gloo device for MASTER_ADDR. `--check-rng` prints the self-check of the mt19937_64 and exits.
"""
import argparse
import datetime
import gzip
import json
import math
import os
import struct
import sys
import time

import numpy as np

MASK64 = (1 << 64) - 1
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530  # trainer/data/fashion_mnist.h


# --- std::mt19937_64 and the sampler ------------------------------------------------------------

class MT19937_64:
    """std::mt19937_64, vectorized with numpy: the same 64-bit outputs as the C++ engine."""
    N, M = 312, 156
    A = np.uint64(0xB5026F5AA96619E9)
    UPPER = np.uint64(0xFFFFFFFF80000000)
    LOWER = np.uint64(0x7FFFFFFF)
    ONE = np.uint64(1)

    def __init__(self, seed=5489):
        mt = [seed & MASK64]
        for i in range(1, self.N):
            prev = mt[-1]
            mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & MASK64)
        self.mt = np.array(mt, dtype=np.uint64)
        self.buf = np.empty(0, dtype=np.uint64)  # Outputs generated but not consumed yet.

    def _twist(self):
        mt, n, m = self.mt, self.N, self.M

        def mix(upper, lower):
            x = (upper & self.UPPER) | (lower & self.LOWER)
            return (x >> self.ONE) ^ ((x & self.ONE) * self.A)

        # Split where the recurrence mt[i] = mt[(i + m) % n] ^ f(mt[i], mt[i + 1]) starts reading
        # words it has already replaced in this twist.
        mt[0:n - m] = mt[m:n] ^ mix(mt[0:n - m], mt[1:n - m + 1])
        mt[n - m:n - 1] = mt[0:m - 1] ^ mix(mt[n - m:n - 1], mt[n - m + 1:n])
        mt[n - 1] = mt[m - 1] ^ mix(mt[n - 1:n], mt[0:1])[0]

    def _block(self):
        self._twist()
        y = self.mt.copy()
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        return y

    def peek(self, k):
        """The next k outputs, without consuming them."""
        if len(self.buf) < k:
            blocks = [self.buf] + [self._block() for _ in range(-(-(k - len(self.buf)) // self.N))]
            self.buf = np.concatenate(blocks)
        return self.buf[:k]

    def advance(self, k):
        self.peek(k)
        self.buf = self.buf[k:]

    def __call__(self):
        r = int(self.peek(1)[0])
        self.advance(1)
        return r


def epoch_order(n, seed, epoch):
    """DistributedSampler::Order: the permutation of 0..n-1 of `epoch` (trainer/data/sampler.cc)."""
    order = list(range(n))
    if n <= 1:
        return order
    gen = MT19937_64((seed + epoch) & MASK64)
    bounds = np.arange(n, 1, -1, dtype=np.uint64)  # i + 1 for i = n-1 .. 1
    thresholds = (np.uint64(0) - bounds) % bounds   # 2^64 mod bound: Below's rejection limit
    js = np.empty(n - 1, dtype=np.uint64)
    k = 0
    while k < n - 1:  # Below(gen, i + 1) for all i at once; redo from a rejected draw, if any.
        r = gen.peek(n - 1 - k)
        bad = r < thresholds[k:]
        if not bad.any():
            js[k:] = r % bounds[k:]
            gen.advance(n - 1 - k)
            break
        first = int(np.argmax(bad))
        js[k:k + first] = r[:first] % bounds[k:k + first]
        gen.advance(first + 1)  # The accepted draws and the rejected one.
        k += first
    for i, j in zip(range(n - 1, 0, -1), js.tolist()):
        order[i], order[j] = order[j], order[i]
    return order


def rank_batches(order, world, rank, batch_size):
    """DistributedSampler::Batches(epoch, 0) with drop_last: rank-strided shard, cut in batches."""
    num_samples = len(order) // world
    local = np.asarray(order[:num_samples * world], dtype=np.int64)[rank::world]
    return [local[b:b + batch_size] for b in range(0, num_samples, batch_size)]


def position(n, world, batch_size, steps):
    """DistributedSampler::Position(0, steps) with drop_last."""
    num_samples = n // world
    num_batches = -(-num_samples // batch_size)
    steps = min(max(steps, 0), num_batches)
    return min(n, min(steps * batch_size, num_samples) * world)


def check_rng():
    """The self-check of MT19937_64 and epoch_order against values printed by std::mt19937_64
    (g++ 12, libstdc++) and by the Fisher-Yates loop of trainer/data/sampler.cc compiled alone."""
    gen = MT19937_64()
    gen.advance(9999)
    checks = [("default seed, 10000th output", gen(), 9981545732273789042)]
    g0 = MT19937_64(0)
    checks.append(("seed 0, first 5", [g0() for _ in range(5)],
                   [2947667278772165694, 18301848765998365067, 729919693006235833,
                    11021831128136023278, 10003392056472839596]))
    checks.append(("seed 2^64-1, first output", MT19937_64(MASK64)(), 478026398904862820))

    def fnv(order):
        h = 1469598103934665603
        for v in order:
            h = ((h ^ v) * 1099511628211) & MASK64
        return h

    o = epoch_order(60000, 0, 0)
    checks.append(("order(60000, seed 0): first 2, last, FNV-1a", [o[0], o[1], o[-1], fnv(o)],
                   [50855, 30713, 5694, 8723608568991828903]))
    o = epoch_order(60000, MASK64, 0)
    checks.append(("order(60000, seed 2^64-1)", [o[0], o[1], o[-1], fnv(o)],
                   [28136, 8642, 22820, 7788773447198594075]))
    o = epoch_order(10, 7, 0)
    checks.append(("order(10, seed 7)", [o[0], o[1], o[-1], fnv(o)], [0, 7, 5, 7964084532125237194]))
    ok = True
    for name, got, want in checks:
        good = got == want
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {name}: {got}" + ("" if good else f" (want {want})"))
    t0 = time.perf_counter()
    epoch_order(60000, 0, 1)
    print(f"epoch_order(60000): {1000 * (time.perf_counter() - t0):.1f} ms")
    return ok


# --- data ------------------------------------------------------------------------------------

def read_idx(path, magic, dims):
    with gzip.open(path, "rb") as f:
        data = f.read()
    header = 4 + 4 * dims
    got, *shape = struct.unpack(f">{1 + dims}I", data[:header])
    if got != magic:
        raise SystemExit(f"fashion_twin: {path}: bad magic 0x{got:08x}")
    body = np.frombuffer(data, dtype=np.uint8, offset=header)
    if body.size != int(np.prod(shape)):
        raise SystemExit(f"fashion_twin: {path}: {body.size} bytes after the header, expected "
                         f"{int(np.prod(shape))}")
    return body.reshape(shape)


def load_fashion_mnist(data_dir, split):
    import torch
    prefix = "train" if split == "train" else "t10k"
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), 0x801, 1)
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), 0x803, 3)
    if images.shape[1:] != (28, 28) or images.shape[0] != labels.shape[0] or labels.max() >= 10:
        raise SystemExit(f"fashion_twin: {data_dir}: unexpected {split} shapes or labels")
    table = ((np.arange(256, dtype=np.float64) / 255.0 - MEAN) / STD).astype(np.float32)
    x = torch.from_numpy(table[images].reshape(-1, 1, 28, 28).copy())
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


# --- models ----------------------------------------------------------------------------------

def make_model(name):
    import torch.nn as nn
    import torch.nn.functional as F

    class FashionNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(32)
            self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(64)
            self.fc1 = nn.Linear(64 * 7 * 7, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, images):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(images))), 2)
            x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
            x = F.relu(self.fc1(x.flatten(1)))
            return self.fc2(x)

    class Mlp(nn.Module):
        def __init__(self, inputs=28 * 28, hidden=(256, 128), classes=10):
            super().__init__()
            layers, width = [], inputs
            for h in hidden:
                layers += [nn.Linear(width, h), nn.ReLU()]
                width = h
            layers.append(nn.Linear(width, classes))
            self.layers = nn.Sequential(*layers)

        def forward(self, images):
            return self.layers(images.flatten(1))

    if name == "fashionnet":
        return FashionNet()
    if name == "mlp":
        return Mlp()
    raise SystemExit(f"fashion_twin: unknown model '{name}': expected fashionnet or mlp")


# --- training --------------------------------------------------------------------------------

def scheduled_lr(args, t):
    if args.lr_schedule == "constant":
        return args.lr
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * min(max(t, 0.0), 1.0)))


def rows(data, idx, device):
    """Rows idx of data on device: on CUDA through pinned memory and a non-blocking copy."""
    import torch
    if device.type == "cpu":
        return data.index_select(0, idx)
    pinned = torch.empty((idx.numel(),) + tuple(data.shape[1:]), dtype=data.dtype, pin_memory=True)
    torch.index_select(data, 0, idx, out=pinned)
    return pinned.to(device, non_blocking=True)


def evaluate(model, test_x, test_y, rank, world, device):
    import torch
    import torch.distributed as dist
    model.eval()
    correct = total = 0
    shard = torch.arange(rank, test_x.shape[0], world, dtype=torch.long)
    with torch.no_grad():
        for begin in range(0, shard.numel(), 1000):
            chunk = shard[begin:begin + 1000]
            logits = model(rows(test_x, chunk, device))
            correct += int(logits.argmax(1).eq(rows(test_y, chunk, device)).sum().item())
            total += chunk.numel()
    counts = torch.tensor([correct, total], dtype=torch.long, device=device)
    dist.all_reduce(counts)
    model.train()
    return counts[0].item() / max(1, counts[1].item())


def train(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    train_x, train_y = load_fashion_mnist(args.data_dir, "train")
    test_x, test_y = load_fashion_mnist(args.data_dir, "test")
    n = train_x.shape[0]

    torch.manual_seed(args.seed)
    model = make_model(args.model).to(device)
    if args.memory_format == "channels-last":
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    # gloo, 25 MiB buckets, broadcast_buffers=True unless --no-broadcast-buffers.
    ddp = DistributedDataParallel(model, broadcast_buffers=not args.no_broadcast_buffers,
                                  device_ids=[device.index] if device.type == "cuda" else None)
    metrics = open(args.metrics_file, "a") if rank == 0 and args.metrics_file else None

    def write(record):
        if metrics:
            metrics.write(record + "\n")
            metrics.flush()

    profile_window = [int(v) for v in args.profile_steps.split(":")] if args.profile_steps else None
    profiler = None
    start_time = time.perf_counter()
    samples_done = step = 0
    stop = False
    for epoch in range(args.epochs):
        batches = rank_batches(epoch_order(n, args.seed, epoch), world, rank, args.batch_size)
        for b, batch in enumerate(batches):
            if profile_window and step == profile_window[0]:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                profiler = torch.profiler.profile(activities=activities, acc_events=True)
                profiler.__enter__()
            step_scope = torch.profiler.record_function("ProfilerStep#%d" % step) if profiler else None
            if step_scope:
                step_scope.__enter__()
            idx = torch.from_numpy(batch)
            images = rows(train_x, idx, device)
            labels = rows(train_y, idx, device)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(images), labels)
            loss.backward()
            last_loss = loss.item()
            t = (epoch * n + position(n, world, args.batch_size, b)) / (args.epochs * n)
            lr = scheduled_lr(args, t)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            if step_scope:
                step_scope.__exit__(None, None, None)
                if step + 1 >= profile_window[1]:
                    profiler.__exit__(None, None, None)
                    profiler.export_chrome_trace("%s.%d" % (args.profile_trace, rank))
                    profiler = None
            step += 1
            samples_done += images.shape[0] * world
            if rank == 0 and args.log_every > 0 and step % args.log_every == 0:
                elapsed = time.perf_counter() - start_time
                rate = samples_done / max(elapsed, 1e-9)
                left = (args.epochs - epoch) * n - position(n, world, args.batch_size, b + 1)
                print(f"epoch {epoch}  step {step}  loss {last_loss:.4f}  lr {lr:.4g}  "
                      f"{rate:.0f} samples/s  ETA {left / max(rate, 1e-9):.0f} s", flush=True)
                write(json.dumps({"event": "step", "epoch": epoch, "step": step,
                                  "loss": round(last_loss, 6), "lr": float(f"{lr:.6g}"),
                                  "samples_per_s": round(rate, 1)}, separators=(",", ":")))
            if args.max_steps > 0 and step >= args.max_steps:
                stop = True
                break
        if stop:
            break
    elapsed = time.perf_counter() - start_time
    if profiler:  # The window outlived the run.
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace("%s.%d" % (args.profile_trace, rank))
    accuracy = evaluate(model, test_x, test_y, rank, world, device)
    rate = samples_done / max(elapsed, 1e-9)
    if rank == 0:
        print(f"done: {step} steps, {args.epochs} epochs, {elapsed:.1f} s, {rate:.0f} samples/s, "
              f"test accuracy {accuracy:.4f}", flush=True)
        write(json.dumps({"event": "end", "test_accuracy": round(accuracy, 6),
                          "samples_per_s": round(rate, 1), "steps": step, "epochs": args.epochs,
                          "seconds": round(elapsed, 2), "world_size": world},
                         separators=(",", ":")))
    if metrics:
        metrics.close()
    # Leave without running destructors. torch 1.13 can deadlock at interpreter exit: destroying
    # DDP's Reducer joins a ProcessGroupGloo worker thread that waits for the GIL the exiting
    # main thread holds (seen once in ~20 runs of train_bench: rank 0 spun for minutes after its
    # end record). The barrier makes sure no rank still needs the group or rank 0's store.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="fashionnet", choices=["fashionnet", "mlp"])
    ap.add_argument("--data-dir", default=FASHION_MNIST_DIR)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: none)")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--lr-schedule", default="cosine", choices=["constant", "cosine"])
    ap.add_argument("--seed", type=int, default=0, help="seed of weights and data order")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: rank i on cuda:LOCAL_RANK with nccl (default cpu, gloo)")
    ap.add_argument("--log-every", type=int, default=50, help="progress line every N steps")
    ap.add_argument("--memory-format", default="contiguous", choices=["contiguous", "channels-last"],
                    help="layout of the convolution weights (contiguous: PyTorch's default)")
    ap.add_argument("--profile-steps", help="FIRST:END: torch.profiler over these steps (needs --profile-trace)")
    ap.add_argument("--profile-trace", help="Chrome trace to PATH.<rank>")
    ap.add_argument("--metrics-file", help="JSON lines, rank 0: steps and a final end record")
    ap.add_argument("--no-broadcast-buffers", action="store_true",
                    help="DDP(broadcast_buffers=False): each rank keeps its own BatchNorm running "
                         "stats, as elrun-train does (it broadcasts buffers only at start)")
    ap.add_argument("--check-rng", action="store_true",
                    help="check the mt19937_64 and the sampler order against C++ values, and exit")
    args = ap.parse_args()
    if args.check_rng:
        return 0 if check_rng() else 1
    if args.epochs < 1 or args.batch_size < 1 or args.threads < 1 or args.seed < 0:
        ap.error("--epochs, --batch-size and --threads must be >= 1, --seed >= 0")
    if bool(args.profile_steps) != bool(args.profile_trace):
        ap.error("--profile-steps and --profile-trace go together")
    if args.profile_steps:
        window = args.profile_steps.split(":")
        if len(window) != 2 or not all(v.isdigit() for v in window) or int(window[0]) >= int(window[1]):
            ap.error("--profile-steps %s: expected FIRST:END with 0 <= FIRST < END" % args.profile_steps)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
