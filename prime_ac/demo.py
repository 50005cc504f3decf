"""``python -m prime_ac demo``: one training step of the built-in models per checkpoint mode.

The table's deterministic columns come first: bytes held for backward, forward operators and
FLOPs replayed in backward (exact, the same on every run), and the gradient difference against no
AC (0.0: bitwise equal). Step times come last: the median of several steps per mode after a
warm-up, interleaved across modes so that a burst of load on the machine hits every mode alike,
with the spread of the per-round ratios.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import dataclass

import torch

from prime_ac.checkpoint import checkpoint_blocks
from prime_ac.measure import StepStats, measure_step
from prime_ac.models import build_model

__all__ = ["ModeResult", "compare_modes", "format_table"]

MODES = ("none", "full", "selective")

# What carries FLOPs in the table: torch.utils.flop_counter has formulas for matrix products and
# attention only; norms, RoPE, activations, routing and views count 0 FLOPs.
FLOP_NOTE = (
    "FLOPs count matrix products and attention only (torch.utils.flop_counter); selective keeps "
    "them, so the ops it replays (norms, RoPE, activations, views) carry 0 FLOPs."
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
    step_ratio: float  # median step time against no AC's median, interleaved rounds
    step_ratio_low: float  # lowest and highest per-round ratio: the spread
    step_ratio_high: float
    step_s: float  # median step time in seconds


def _tokens(model, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (batch, seq_len + 1), generator=generator)


def _step_seconds(model, tokens) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model.loss(tokens).backward()
    return time.perf_counter() - start


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
    """Train the built-in ``kind`` model per mode, each from the same weights.

    Counts come from one measured step per mode; times from ``repeats`` rounds that each run one
    step of every mode, after one warm-up round.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time at least one round (repeats=1)")
    reference = build_model(kind, seed=seed, **model_overrides)
    tokens = _tokens(reference, batch, seq_len, seed)
    order = ("none", *[m for m in modes if m != "none"])
    models, stats = {}, {}
    for mode in order:
        model = copy.deepcopy(reference)
        if mode != "none":
            checkpoint_blocks(model, mode=mode)
        models[mode] = model
        stats[mode] = measure_step(model, lambda m: m.loss(tokens))
    times: dict[str, list[float]] = {mode: [] for mode in order}
    for round_ in range(repeats + 1):
        for mode in order:
            seconds = _step_seconds(models[mode], tokens)
            if round_:  # round 0 warms up
                times[mode].append(seconds)
    base: StepStats = stats["none"]
    results = []
    for mode in modes:
        s = stats[mode]
        diff = max((s.grads[n] - g).abs().max().item() for n, g in base.grads.items())
        recomputed_flops = s.backward_flops - base.backward_flops
        ratios = [t / b for t, b in zip(times[mode], times["none"], strict=True)]
        median = statistics.median(times[mode])
        results.append(
            ModeResult(
                mode=mode,
                held_bytes=s.held_bytes,
                held_ratio=s.held_bytes / base.held_bytes,
                recomputed_ops=sum(s.backward_ops.values()) - sum(base.backward_ops.values()),
                recomputed_flops=recomputed_flops,
                recomputed_flops_ratio=recomputed_flops / base.forward_flops,
                max_grad_diff=diff,
                step_ratio=median / statistics.median(times["none"]),
                step_ratio_low=min(ratios),
                step_ratio_high=max(ratios),
                step_s=median,
            )
        )
    return results


def format_table(title: str, results: list[ModeResult], repeats: int) -> str:
    step = f"step time (median of {repeats}, range)"
    header = (
        f"{'mode':<10} {'held for backward':>20} {'recomputed ops':>15} "
        f"{'recomputed FLOPs':>22} {'max |grad diff|':>16}   {step}"
    )
    lines = [title, header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.mode:<10} {r.held_bytes / 2**20:>9.2f} MiB ({r.held_ratio:>5.1%}) "
            f"{r.recomputed_ops:>15} {r.recomputed_flops / 1e6:>9.1f} MFLOP ({r.recomputed_flops_ratio:>5.1%}) "
            f"{r.max_grad_diff:>16.1e}   {r.step_ratio:.2f}x ({r.step_ratio_low:.2f}-{r.step_ratio_high:.2f}x)"
        )
    return "\n".join(lines)


def main(kinds: list[str], as_json: bool, repeats: int = 7) -> int:
    report = {kind: compare_modes(kind, repeats=repeats) for kind in kinds}
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
        print(f"\n{FLOP_NOTE}")
    worst = max(r.max_grad_diff for results in report.values() for r in results)
    return 0 if worst == 0.0 else 1
