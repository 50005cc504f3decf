"""What prime_ac's checkpoint contexts cost in eager mode, against plain and torch's own SAC.

For the built-in dense and MoE models (4 layers, batch 2, dim = seq), one training step
(forward + backward) under:

- ``none``: no activation checkpointing
- ``plain``: ``torch.utils.checkpoint`` (non-reentrant) around each block
- ``torch_sac``: torch's ``create_selective_checkpoint_contexts`` with prime_ac's selective policy
- ``full`` / ``selective``: ``prime_ac.checkpoint_blocks(mode=...)``

Steps are interleaved (one of each variant per round) after warm-up, and each variant's median
is printed relative to ``none`` and to ``plain``. Sizes below 256 run more rounds (x2 at 128, x4
at 64): their steps are short and their ratios closest to 1, where noise decides most. Time is the CPU time of the main thread with
torch on one thread (``time.thread_time``): other processes on a shared machine barely move it,
where wall time moves by 2x. ``us/op`` is the extra time over plain
checkpointing divided by the operator calls the blocks' forward dispatches: what a context costs
per operator. Shared machines are noisy: compare ratios from one run, not across runs.

    python benchmarks/eager_overhead.py            # dims 64..512, both models
    python benchmarks/eager_overhead.py --quick    # small sizes, few steps
    python benchmarks/eager_overhead.py --json
    python benchmarks/eager_overhead.py --compile --models dense --sizes 128   # compiled blocks
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode  # noqa: F401  (keeps import cost out of steps)

import prime_ac
from prime_ac.models import build_model

VARIANTS = ("none", "plain", "torch_sac", "full", "selective")


class _Region(nn.Module):
    """A block under ``torch.utils.checkpoint`` with the given context_fn (None: plain)."""

    def __init__(self, block: nn.Module, context_fn=None):
        super().__init__()
        self.block, self.context_fn = block, context_fn

    def forward(self, *args):
        if self.context_fn is None:
            return checkpoint(self.block, *args, use_reentrant=False)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context_fn)


def _variant(base: nn.Module, name: str, compile_blocks: bool = False) -> nn.Module:
    model = copy.deepcopy(base)
    if name in ("plain", "torch_sac"):
        context_fn = None
        if name == "torch_sac":
            policy = prime_ac.make_policy("selective")
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        model.layers = nn.ModuleList(_Region(block, context_fn) for block in model.layers)
    elif name in ("full", "selective"):
        prime_ac.checkpoint_blocks(model, mode=name)
    if compile_blocks:  # after AC, as docs/checkpointing.md recommends
        for layer in model.layers:
            layer.compile()
    return model


def _block_forward_ops(model: nn.Module, tokens: torch.Tensor) -> int:
    """Operator calls dispatched by the blocks' forward (what a forward mode intercepts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    x = model.tok_embeddings(tokens[:, :-1])
    with torch.no_grad(), Count():
        for layer in model.layers:
            x = layer(x, model.rope_cos, model.rope_sin)
    return Count.calls


def _step(model: nn.Module, tokens: torch.Tensor) -> float:
    start = time.thread_time()
    model.loss(tokens).backward()
    elapsed = time.thread_time() - start
    for p in model.parameters():
        p.grad = None
    return elapsed


def measure(kind: str, size: int, steps: int, warmup: int, compile_blocks: bool = False) -> dict:
    overrides = {"dim": size, "hidden_dim": 2 * size if kind == "dense" else size}
    base = build_model(kind, **overrides)
    tokens = torch.randint(0, base.cfg.vocab_size, (2, size + 1))
    models = {name: _variant(base, name, compile_blocks) for name in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    steps *= max(1, 256 // size)
    for round_ in range(warmup + steps):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for name in order:
            elapsed = _step(models[name], tokens)
            if round_ >= warmup:
                times[name].append(elapsed)
    median = {name: statistics.median(t) for name, t in times.items()}
    ops = _block_forward_ops(base, tokens)
    return {
        "model": kind,
        "size": size,
        "compiled": compile_blocks,
        "steps": steps,
        "ops": ops,
        "ms": {name: median[name] * 1e3 for name in VARIANTS},
        "vs_none": {name: median[name] / median["none"] for name in VARIANTS},
        "vs_plain": {name: median[name] / median["plain"] for name in VARIANTS},
        "us_per_op": {
            name: (median[name] - median["plain"]) / ops * 1e6
            for name in ("torch_sac", "full", "selective")
        },
    }


def _table(rows: list[dict]) -> str:
    head = (
        f"{'model':<6} {'size':>5} {'ops':>5} {'none ms':>8} | step / none: "
        + " ".join(f"{v:>9}" for v in VARIANTS[1:])
        + " | / plain: "
        + " ".join(f"{v:>9}" for v in VARIANTS[2:])
        + " | us/op: "
        + " ".join(f"{v:>9}" for v in VARIANTS[2:])
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:<6} {r['size']:>5} {r['ops']:>5} {r['ms']['none']:>8.2f} |              "
            + " ".join(f"{r['vs_none'][v]:>8.2f}x" for v in VARIANTS[1:])
            + " |          "
            + " ".join(f"{r['vs_plain'][v]:>8.2f}x" for v in VARIANTS[2:])
            + " |        "
            + " ".join(f"{r['us_per_op'][v]:>9.1f}" for v in VARIANTS[2:])
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="dims 64 and 128, few steps")
    parser.add_argument("--sizes", type=int, nargs="+", help="dim = seq values")
    parser.add_argument("--models", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    parser.add_argument("--steps", type=int, help="measured rounds (default 11, quick 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--compile", action="store_true", help="compile each block (inductor) after wrapping it"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # all work on the timed thread
    sizes = args.sizes or ([64, 128] if args.quick else [64, 128, 256, 512])
    steps = args.steps or (3 if args.quick else 11)
    warmup = 1 if args.quick else 2
    rows = [
        measure(kind, size, steps, warmup, args.compile) for kind in args.models for size in sizes
    ]
    if args.json:
        print(json.dumps({"torch": torch.__version__, "steps": steps, "rows": rows}, indent=1))
    else:
        print(
            f"torch {torch.__version__}, medians of {steps} interleaved steps after warm-up "
            "(more below dim 256)"
        )
        print(_table(rows))


if __name__ == "__main__":
    main()
