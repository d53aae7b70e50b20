"""The sharding benchmark's workload and what it is held to: elrun-train's --strategy values, the
MLP's size, the ZeRO paper's model-state formulas and the targets. Shared by fsdp_bench.py and
fsdp_report.py.
"""

STRATEGIES = ["ddp", "zero1", "zero2", "fsdp", "no_shard"]
LABELS = {
    "ddp": "ddp (bucketed DDP, trainer/parallel/ddp.cc)",
    "zero1": "zero1 (FSDP SHARD_OPTIMIZER)",
    "zero2": "zero2 (FSDP SHARD_GRAD_OP)",
    "fsdp": "fsdp (FSDP FULL_SHARD, ZeRO-3)",
    "no_shard": "no_shard (FSDP code path, no sharding)",
}
TARGET_STATE_RATIO = 0.55  # fsdp per-rank model state <= 0.55 x ddp's
TARGET_STEP_RATIO = 1.3    # fsdp step time <= 1.3 x ddp's
TARGET_RSS_RATIO = 0.6     # fsdp peak RSS <= 0.6 x ddp's peak RSS
TARGET_ZERO2_RSS_RATIO = 0.8  # zero2 peak RSS <= 0.8 x ddp's peak RSS
TARGET_RSS_OVERHEAD = 1.3  # fsdp peak RSS <= 1.3 x (fsdp's peak (accounting) + its baseline RSS)
DEFAULT_HIDDEN = [2048] * 32  # 32 layers of 16 MiB: small units against the sharded state.

MIB = 1024.0 * 1024.0


def mlp_parameters(hidden, inputs=28 * 28, classes=10):
    """Parameters of elrun-train's --model mlp (Linear layers with bias)."""
    widths = [inputs] + list(hidden) + [classes]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def mlp_text(hidden, inputs=28 * 28, classes=10):
    """784-2048×32-10: the MLP's widths, runs of equal widths as width×count."""
    parts = []
    for h in hidden:
        if parts and parts[-1][0] == h:
            parts[-1][1] += 1
        else:
            parts.append([h, 1])
    return "-".join([str(inputs)] + [f"{h}×{k}" if k > 1 else str(h) for h, k in parts]
                    + [str(classes)])


def zero_formula_bytes(strategy, p, n):
    """The ZeRO paper's fp32 Adam model state per rank (no_shard and ddp: 16P)."""
    return {"zero1": 8 * p + 8 * p / n, "zero2": 4 * p + 12 * p / n,
            "fsdp": 16 * p / n}.get(strategy, 16 * p)


def formula_text(strategy):
    return {"zero1": "8P + 8P/N", "zero2": "4P + 12P/N", "fsdp": "16P/N"}.get(strategy, "16P")
