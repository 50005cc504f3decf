"""What prime_ac's checkpoint contexts cost in eager mode, against plain and torch's own SAC.

For the built-in dense and MoE models (4 layers, batch 2, dim = seq) and a 4-layer transformers
Llama at hidden 1024 / seq 512 (``--models llama``), one training step (forward + backward)
under:

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
per operator. Shared machines are noisy: compare ratios from one run, not across runs. Each
report starts with the machine (CPU model, usable cores), the date and the load average before
and after the run (``benchmarks/report.py``).

``--per-op`` prints what each dispatch mode costs per operator call, over a bare dispatch mode
that only runs the call: prime_ac's forward and recompute modes against torch's
``_CachingTorchDispatchMode`` / ``_CachedTorchDispatchMode`` with the same policy, for operators
replayed and operators kept.

    python benchmarks/eager_overhead.py            # dims 64..512, built-in models, and llama
    python benchmarks/eager_overhead.py --quick    # small sizes, few steps, no llama
    python benchmarks/eager_overhead.py --per-op
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

    def forward(self, *args, **kwargs):
        if self.context_fn is None:
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return checkpoint(
            self.block, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs
        )


class _Llama(nn.Module):
    """transformers' LlamaForCausalLM, 4 layers, with the built-in models' interface."""

    def __init__(self, hidden: int):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=2048,
            hidden_size=hidden,
            intermediate_size=int(hidden * 8 / 3) // 64 * 64,
            num_hidden_layers=4,
            num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 64,
            max_position_embeddings=4096,
            use_cache=False,
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        self.lm = LlamaForCausalLM(config)
        self.vocab_size = config.vocab_size

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, labels=tokens).loss


def _variant(base: nn.Module, name: str, compile_blocks: bool = False) -> nn.Module:
    model = copy.deepcopy(base)
    if name in ("plain", "torch_sac"):
        context_fn = None
        if name == "torch_sac":
            policy = prime_ac.make_policy("selective")
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        regions = nn.ModuleList(_Region(block, context_fn) for block in model.layers)
        # nn.Module.__setattr__ takes a module value before any property setter could
        owner = model.lm.model if isinstance(model, _Llama) else model
        owner.layers = regions
    elif name in ("full", "selective"):
        prime_ac.checkpoint_blocks(model, mode=name, blocks=_layers_path(model))
    if compile_blocks:  # after AC, as docs/checkpointing.md recommends
        for layer in model.layers:
            layer.compile()
    return model


def _layers_path(model: nn.Module) -> str:
    return "lm.model.layers" if isinstance(model, _Llama) else "layers"


def _block_forward_ops(model: nn.Module, tokens: torch.Tensor) -> int:
    """Operator calls dispatched by the blocks' forward (what a forward mode intercepts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0
        counting = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += Count.counting
            return func(*args, **(kwargs or {}))

    def count(module, args, kwargs=None):
        Count.counting = True

    def stop(module, args, out):
        Count.counting = False

    hooks = [
        h
        for layer in model.layers
        for h in (layer.register_forward_pre_hook(count), layer.register_forward_hook(stop))
    ]
    try:
        with torch.no_grad(), Count():
            model.loss(tokens)
    finally:
        for h in hooks:
            h.remove()
    return Count.calls


def _step(model: nn.Module, tokens: torch.Tensor) -> float:
    start = time.thread_time()
    model.loss(tokens).backward()
    elapsed = time.thread_time() - start
    for p in model.parameters():
        p.grad = None
    return elapsed


def measure(kind: str, size: int, steps: int, warmup: int, compile_blocks: bool = False) -> dict:
    if kind == "llama":
        base, seq = _Llama(size), 512
        tokens = torch.randint(0, base.vocab_size, (1, seq))
    else:
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


def per_operator_cost(calls: int = 2000, rounds: int = 11) -> dict:
    """Microseconds per operator call that each mode adds over a bare dispatch mode.

    A chain of ``calls`` operators on 4x4 tensors (cheap, so the mode's Python dominates), run
    interleaved in one process on one thread: ``replayed`` is a chain of ``neg`` (every call
    replayed; one kept ``mm`` first, so that the recompute needs its mode), ``kept`` a chain of
    ``mm`` (every call kept, the policy's default targets).
    """
    from prime_ac._compat import DispatchMode
    from prime_ac.contexts import context_fn

    x, w = torch.randn(4, 4), torch.randn(4, 4)

    def chain(op):
        def run():
            y = torch.mm(x, w)
            for _ in range(calls - 1):
                y = op(y)

        return run

    chains = {"replayed": chain(torch.neg), "kept": chain(lambda y: torch.mm(y, w))}

    class Bare(DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    policy = prime_ac.make_policy("selective")
    pairs = {
        "torch_sac": lambda: create_selective_checkpoint_contexts(policy),
        "prime_ac": lambda: context_fn(policy=policy)(),
    }
    times: dict[tuple[str, str, str], list[float]] = {}

    def timed(key, run, mode=None):
        start = time.thread_time()
        if mode is None:
            run()
        else:
            with mode:
                run()
        times.setdefault(key, []).append(time.thread_time() - start)

    for _ in range(rounds):
        for kind, run in chains.items():
            timed((kind, "bare", ""), run, Bare())
            for name, make in pairs.items():
                keep, replay = make()
                timed((kind, name, "forward"), run, keep)
                timed((kind, name, "recompute"), run, replay)
    median = {key: statistics.median(t) for key, t in times.items()}
    return {
        f"{name} {side} {kind}": (median[(kind, name, side)] - median[(kind, "bare", "")])
        / calls
        * 1e6
        for kind in chains
        for name in pairs
        for side in ("forward", "recompute")
    } | {f"bare {kind}": median[(kind, "bare", "")] / calls * 1e6 for kind in chains}


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
    parser.add_argument(
        "--models", nargs="+", default=["dense", "moe", "llama"], choices=["dense", "moe", "llama"]
    )
    parser.add_argument("--per-op", action="store_true", help="per-operator cost of each mode")
    parser.add_argument("--steps", type=int, help="measured rounds (default 11, quick 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--compile", action="store_true", help="compile each block (inductor) after wrapping it"
    )
    args = parser.parse_args()
    from report import header, load_average, machine  # benchmarks/ (the script's own folder)

    torch.set_num_threads(1)  # all work on the timed thread
    before = machine()
    if args.per_op:
        cost = per_operator_cost()
        if args.json:
            report = {"machine": before, "load_average_after": load_average(), "us_per_op": cost}
            print(json.dumps(report, indent=1))
        else:
            how = "thread CPU time, medians of 11 interleaved rounds of 2000-operator chains"
            print(header(before, load_average(), how))
            print("us per operator call over a bare dispatch mode")
            for key, value in cost.items():
                print(f"  {key:<32} {value:6.2f}")
        return
    sizes = args.sizes or ([64, 128] if args.quick else [64, 128, 256, 512])
    steps = args.steps or (3 if args.quick else 11)
    warmup = 1 if args.quick else 2
    kinds = [k for k in args.models if not (args.quick and k == "llama")]
    rows = [
        measure(kind, size, steps, warmup, args.compile)
        for kind in kinds
        for size in ([1024] if kind == "llama" and not args.sizes else sizes)
    ]
    after = load_average()
    if args.json:
        report = {"machine": before, "load_average_after": after, "steps": steps, "rows": rows}
        print(json.dumps(report, indent=1))
    else:
        how = f"thread CPU time, medians of {steps} interleaved steps (more below dim 256)"
        print(header(before, after, how))
        print(_table(rows))


if __name__ == "__main__":
    main()
