"""``python -m prime_ac demo``: one training step of the built-in models per checkpoint mode.

By default the models have Llama-sized blocks (width 512, 8 heads, 512 tokens; 2 blocks, to fit
a minute): a step's time is in its FLOPs, as on a GPU at real sizes, so the time column orders
the modes as training sees them. ``--tiny`` runs the built-in tiny models (width 64) for quick
checks: there per-operator dispatch outweighs FLOPs, and replaying cheap operators is not free.

Modes: no AC, plain checkpointing (``torch.utils.checkpoint`` around each block, non-reentrant,
no ``context_fn``: what torch gives without a policy), and prime_ac's ``full`` and
``selective``. The table's deterministic columns come first: bytes held for backward, forward
operators and FLOPs replayed in backward (exact, the same on every run), and the gradient
difference against no AC (0.0: bitwise equal). Step times come last: medians over interleaved
rounds (one step of every mode per round, the order reversed every other round, so that drift
and bursts of load hit every mode alike), in CPU time of the main thread with torch on one
thread (``time.thread_time``, as benchmarks/eager_overhead.py measures): other processes on a
shared machine barely move it, where wall time moves by 2x.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from prime_ac.checkpoint import checkpoint_blocks
from prime_ac.measure import StepStats, measure_step
from prime_ac.models import build_model

__all__ = ["SIZES", "TINY_SIZES", "ModeResult", "compare_modes", "format_table"]

MODES = ("none", "plain", "full", "selective")

# compare_modes' sizes per model: the default (Llama-sized blocks), and --tiny (the built-in
# models as they are).
_WIDE = {"batch": 1, "seq_len": 512, "n_layers": 2, "dim": 512, "n_heads": 8, "n_kv_heads": 4}
SIZES = {
    "dense": {**_WIDE, "hidden_dim": 1376},  # Llama's 8/3 of the width
    "moe": {**_WIDE, "hidden_dim": 768, "n_experts": 4},
}
TINY_SIZES = {"dense": {"batch": 4, "seq_len": 128}, "moe": {"batch": 4, "seq_len": 128}}

# What carries FLOPs in the table: torch.utils.flop_counter has formulas for matrix products and
# attention only; norms, RoPE, activations, routing and views count 0 FLOPs.
FLOP_NOTE = (
    "FLOPs count matrix products and attention only (torch.utils.flop_counter); selective keeps "
    "them, so the ops it replays (norms, RoPE, activations, views) carry 0 FLOPs."
)
TIME_NOTE = (
    "Step times: CPU time of one thread, median over interleaved rounds; in brackets the middle "
    "half of the per-round ratios. At these widths a step's time is in its FLOPs, as on a GPU: "
    "full costs about what plain checkpointing costs, selective less."
)
TINY_TIME_NOTE = (
    "Step times: CPU time of one thread, median over interleaved rounds; in brackets the middle "
    "half of the per-round ratios. On models this small (--tiny) a step costs more in "
    "per-operator dispatch than in FLOPs, which is why replaying 0 FLOPs (selective) is not free."
)


@dataclass
class ModeResult:
    mode: str
    held_bytes: int
    held_ratio: float  # against no AC
    recomputed_ops: int  # forward operators executed during backward
    recomputed_flops: int  # of matrix products and attention, the ops with a FLOP formula
    recomputed_flops_ratio: float  # against one forward
    max_grad_diff: float  # against no AC; 0.0 means bitwise equal
    step_ratio: float  # median of the per-round ratios of step time against no AC
    step_ratio_low: float  # quartiles of those ratios: the spread
    step_ratio_high: float
    step_ratio_plain: float  # median of the per-round ratios against plain checkpointing
    step_s: float  # median step time in seconds (CPU time of one thread)


def _say(message: str) -> None:
    """Progress on stderr, so that ``--json`` output stays parseable."""
    print(message, file=sys.stderr, flush=True)


@contextmanager
def _one_thread():
    """Every step of every mode runs on one intra-op thread: times and gradients comparable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _plain_checkpointing(model) -> None:
    """``torch.utils.checkpoint`` around each block, no ``context_fn``; names unchanged."""
    for block in model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _tokens(model, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (batch, seq_len + 1), generator=generator)


def _step_seconds(model, tokens) -> float:
    model.zero_grad(set_to_none=True)
    start = time.thread_time()
    model.loss(tokens).backward()
    return time.thread_time() - start


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high


def compare_modes(
    kind: str = "dense",
    *,
    modes: tuple[str, ...] = MODES,
    batch: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    repeats: int = 7,
    **model_overrides,
) -> list[ModeResult]:
    """Train the built-in ``kind`` model per mode, each from the same weights, on one thread.

    Counts come from one measured step per mode; times from ``repeats`` rounds that each run one
    step of every mode, after one warm-up round.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time at least one round (repeats=1)")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"modes={modes!r}: {unknown} not among {MODES}")
    order = tuple(m for m in MODES if m in {"none", "plain", *modes})
    with _one_thread():
        reference = build_model(kind, seed=seed, **model_overrides)
        tokens = _tokens(reference, batch, seq_len, seed)
        _say(f"{kind} model: measuring held bytes and replayed work ({', '.join(order)})")
        models, stats = {}, {}
        for mode in order:
            model = copy.deepcopy(reference)
            if mode == "plain":
                _plain_checkpointing(model)
            elif mode != "none":
                checkpoint_blocks(model, mode=mode)
            models[mode] = model
            stats[mode] = measure_step(model, lambda m: m.loss(tokens))
        _say(f"{kind} model: timing {repeats} interleaved rounds after a warm-up (1 thread)")
        times: dict[str, list[float]] = {mode: [] for mode in order}
        for round_ in range(repeats + 1):
            for mode in order if round_ % 2 else order[::-1]:
                seconds = _step_seconds(models[mode], tokens)
                if round_:  # round 0 warms up
                    times[mode].append(seconds)
    base: StepStats = stats["none"]
    results = []
    for mode in modes:
        s = stats[mode]
        diff = max((s.grads[n] - g).abs().max().item() for n, g in base.grads.items())
        recomputed_flops = s.backward_flops - base.backward_flops
        vs_none, vs_plain = (
            [t / b for t, b in zip(times[mode], times[other], strict=True)]
            for other in ("none", "plain")
        )
        low, high = _quartiles(vs_none)
        results.append(
            ModeResult(
                mode=mode,
                held_bytes=s.held_bytes,
                held_ratio=s.held_bytes / base.held_bytes,
                recomputed_ops=sum(s.backward_ops.values()) - sum(base.backward_ops.values()),
                recomputed_flops=recomputed_flops,
                recomputed_flops_ratio=recomputed_flops / base.forward_flops,
                max_grad_diff=diff,
                step_ratio=statistics.median(vs_none),
                step_ratio_low=low,
                step_ratio_high=high,
                step_ratio_plain=statistics.median(vs_plain),
                step_s=statistics.median(times[mode]),
            )
        )
    return results


def format_table(title: str, results: list[ModeResult], repeats: int) -> str:
    step = f"step time (median of {repeats})"
    header = (
        f"{'mode':<10} {'held for backward':>20} {'recomputed ops':>15} "
        f"{'recomputed FLOPs':>22} {'max |grad diff|':>16}   {step:<28}{'vs plain':>9}"
    )
    lines = [title, header, "-" * len(header)]
    for r in results:
        spread = f"({r.step_ratio_low:.2f}-{r.step_ratio_high:.2f})"
        time_ = f"{r.step_s * 1e3:6.1f} ms {r.step_ratio:.2f}x {spread}"
        lines.append(
            f"{r.mode:<10} {r.held_bytes / 2**20:>9.2f} MiB ({r.held_ratio:>5.1%}) "
            f"{r.recomputed_ops:>15} {r.recomputed_flops / 1e6:>9.1f} MFLOP "
            f"({r.recomputed_flops_ratio:>5.1%}) {r.max_grad_diff:>16.1e}   "
            f"{time_:<28}{r.step_ratio_plain:>8.2f}x"
        )
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.0%}", f"{max(values):.0%}"
    return low if low == high else f"{low[:-1]}-{high}"


def summary(report: dict[str, list[ModeResult]]) -> str:
    """Two lines for a newcomer: what full and selective hold and replay, and which to pick.

    Built from the deterministic columns only (bytes and FLOPs), so it reads the same on every
    machine and under any load.
    """
    by_mode: dict[str, list[ModeResult]] = {}
    for results in report.values():
        for r in results:
            by_mode.setdefault(r.mode, []).append(r)
    full, selective = by_mode["full"], by_mode["selective"]
    return (
        f"full holds {_span([r.held_ratio for r in full])} of no AC's memory and replays "
        f"{_span([r.recomputed_flops_ratio for r in full])} of the forward FLOPs; selective "
        f"holds {_span([r.held_ratio for r in selective])} and replays "
        f"{_span([r.recomputed_flops_ratio for r in selective])} (norms, activations, views).\n"
        "Pick selective when activations fit with it (least recompute), full when memory is "
        "what limits you, and no AC when everything fits without checkpointing."
    )


def _load() -> str:
    """The machine's load while timing, printed beside the times: one thread's CPU time still
    moves with load on a shared machine (the same no-AC step measured 2.6-2.9x slower on a
    loaded 2-core machine than on a quiet one), so a time is read together with its load."""
    one_minute = os.getloadavg()[0]
    return f"load average {one_minute:.1f} on {os.cpu_count()} cores"


def main(kinds: list[str], as_json: bool, repeats: int = 5, tiny: bool = False) -> int:
    start = time.perf_counter()
    load_before = _load()
    sizes = TINY_SIZES if tiny else SIZES
    report = {kind: compare_modes(kind, repeats=repeats, **sizes[kind]) for kind in kinds}
    if as_json:
        print(json.dumps({k: [r.__dict__ for r in v] for k, v in report.items()}, indent=2))
    else:
        for kind, results in report.items():
            print(
                format_table(
                    f"\n{kind} model: one training step per mode (ratios against no AC; "
                    "FLOPs against one forward)",
                    results,
                    repeats,
                )
            )
        print(f"\n{FLOP_NOTE}\n{TINY_TIME_NOTE if tiny else TIME_NOTE}")
        print(f"Times measured at {load_before} (start) and {_load()} (end).")
        if {"full", "selective"} <= {r.mode for results in report.values() for r in results}:
            print(f"\n{summary(report)}")
    _say(f"demo: {time.perf_counter() - start:.0f} s")
    worst = max(r.max_grad_diff for results in report.values() for r in results)
    return 0 if worst == 0.0 else 1
