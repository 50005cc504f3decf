"""prime_ac's step time and memory on CUDA, against no AC and plain checkpointing.

One training step (forward + backward) of the built-in dense and MoE models (4 layers, batch 4,
dim = seq, heads of 128, bf16) under:

- ``none``: no activation checkpointing
- ``plain``: ``torch.utils.checkpoint`` (non-reentrant) around each block
- ``full`` / ``selective``: ``prime_ac.checkpoint_blocks(mode=...)``

Step time is CUDA-event time from before the forward to after the backward, so the host's
launch gaps count as they do in training; the median of interleaved steps after warm-up. Memory
from the caching allocator, relative to before the step: ``held`` at backward start (what the
forward left for the backward) and ``peak`` over the step; ``audit`` is ``prime_ac.audit``'s
held bytes for the same policy, which ``held`` should match up to the allocator's rounding.

    python benchmarks/cuda_ac.py [--json] [--sizes 256 1024] [--models dense moe] [--compile]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import prime_ac
from prime_ac.models import build_model

VARIANTS = ("none", "plain", "full", "selective")
SIZES = {"dense": (256, 1024, 2048), "moe": (256, 1024)}


class _Plain(nn.Module):
    """A block under plain ``torch.utils.checkpoint``: everything replays."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


def _variant(base: nn.Module, name: str, compile_blocks: bool) -> nn.Module:
    model = copy.deepcopy(base)
    if name == "plain":
        model.layers = nn.ModuleList(_Plain(block) for block in model.layers)
    elif name in ("full", "selective"):
        prime_ac.checkpoint_blocks(model, mode=name)
    if compile_blocks:  # after AC, as docs/checkpointing.md recommends
        for layer in model.layers:
            layer.compile()
    return model


def _step_ms(model: nn.Module, tokens: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    model.loss(tokens).backward()
    end.record()
    end.synchronize()
    for p in model.parameters():
        p.grad = None
    return start.elapsed_time(end)


def _memory(model: nn.Module, tokens: torch.Tensor) -> tuple[int, int]:
    """(bytes allocated at backward start, peak bytes over the step), relative to before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = model.loss(tokens)
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - before
    del loss
    for p in model.parameters():
        p.grad = None
    return held, peak


def measure(kind: str, size: int, steps: int, warmup: int, compile_blocks: bool) -> dict:
    hidden = 2 * size if kind == "dense" else size
    heads = max(1, size // 128)  # heads of 128, as large models use
    base = build_model(
        kind,
        dim=size,
        hidden_dim=hidden,
        n_heads=heads,
        n_kv_heads=max(1, heads // 2),
        max_seq_len=size,
    )
    base = base.to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, base.cfg.vocab_size, (4, size + 1), device="cuda", generator=gen)
    models = {name: _variant(base, name, compile_blocks) for name in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_ in range(warmup + steps):
        for name in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
            elapsed = _step_ms(models[name], tokens)
            if round_ >= warmup:
                times[name].append(elapsed)
    memory = {name: _memory(models[name], tokens) for name in VARIANTS}
    device = f"cuda:{torch.cuda.current_device()}"
    audit = {}
    for mode in () if compile_blocks else ("full", "selective"):  # the audit runs eager modes
        report = prime_ac.audit(models[mode], lambda m: m.loss(tokens))
        audit[mode] = report.held_bytes_by_device.get(device, 0)
        audit["none"] = report.held_bytes_no_ac_by_device.get(device, 0)
    ms = {name: statistics.median(t) for name, t in times.items()}
    mib = 2**20
    return {
        "model": kind,
        "size": size,
        "compiled": compile_blocks,
        "steps": steps,
        "ms": ms,
        "vs_none": {name: ms[name] / ms["none"] for name in VARIANTS},
        "held_MiB": {name: memory[name][0] / mib for name in VARIANTS},
        "peak_MiB": {name: memory[name][1] / mib for name in VARIANTS},
        "audit_held_MiB": {name: audit[name] / mib for name in audit},
    }


def _table(rows: list[dict]) -> str:
    head = (
        f"{'model':<6} {'size':>5} | step ms: "
        + " ".join(f"{v:>9}" for v in VARIANTS)
        + " | peak MiB: "
        + " ".join(f"{v:>9}" for v in VARIANTS)
        + " | held MiB (audit): "
        + " ".join(f"{v:>17}" for v in ("none", "full", "selective"))
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        held = " ".join(
            f"{r['held_MiB'][v]:>8.1f} ({r['audit_held_MiB'].get(v, float('nan')):>6.1f})"
            for v in ("none", "full", "selective")
        )
        lines.append(
            f"{r['model']:<6} {r['size']:>5} |          "
            + " ".join(f"{r['ms'][v]:>9.2f}" for v in VARIANTS)
            + " |           "
            + " ".join(f"{r['peak_MiB'][v]:>9.1f}" for v in VARIANTS)
            + " |                   "
            + held
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", help="dim = seq values for every model")
    parser.add_argument("--models", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="compile each block (inductor)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rows = [
        measure(kind, size, args.steps, args.warmup, args.compile)
        for kind in args.models
        for size in args.sizes or SIZES[kind]
    ]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['device']}, torch {report['torch']}, medians of {args.steps} steps, bf16")
    print(_table(rows))


if __name__ == "__main__":
    main()
