"""``python -m prime_ac demo``: one training step of the built-in models per checkpoint mode."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import torch

from prime_ac.checkpoint import checkpoint_blocks
from prime_ac.measure import StepStats, measure_step
from prime_ac.models import build_model

__all__ = ["ModeResult", "compare_modes", "format_table"]

MODES = ("none", "full", "selective")


@dataclass
class ModeResult:
    mode: str
    held_bytes: int
    held_ratio: float  # against no AC
    recomputed_ops: int  # forward operators executed during backward
    recomputed_flops: int
    recomputed_flops_ratio: float  # against one forward
    wall_ratio: float  # step time against no AC, same run
    max_grad_diff: float  # against no AC; 0.0 means bitwise equal


def _tokens(model, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (batch, seq_len + 1), generator=generator)


def compare_modes(
    kind: str = "dense",
    *,
    modes: tuple[str, ...] = MODES,
    batch: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    **model_overrides,
) -> list[ModeResult]:
    """Train one step of the built-in ``kind`` model per mode, each from the same weights."""
    reference = build_model(kind, seed=seed, **model_overrides)
    tokens = _tokens(reference, batch, seq_len, seed)
    stats: dict[str, StepStats] = {}
    for mode in ("none", *[m for m in modes if m != "none"]):
        model = copy.deepcopy(reference)
        if mode != "none":
            checkpoint_blocks(model, mode=mode)
        model.loss(tokens).backward()  # warm-up: first-call costs stay out of the timing
        stats[mode] = measure_step(model, lambda m: m.loss(tokens))
    base = stats["none"]
    results = []
    for mode in modes:
        s = stats[mode]
        diff = max((s.grads[n] - g).abs().max().item() for n, g in base.grads.items())
        recomputed_flops = s.backward_flops - base.backward_flops
        results.append(
            ModeResult(
                mode=mode,
                held_bytes=s.held_bytes,
                held_ratio=s.held_bytes / base.held_bytes,
                recomputed_ops=sum(s.backward_ops.values()) - sum(base.backward_ops.values()),
                recomputed_flops=recomputed_flops,
                recomputed_flops_ratio=recomputed_flops / base.forward_flops,
                wall_ratio=s.wall_s / base.wall_s,
                max_grad_diff=diff,
            )
        )
    return results


def format_table(title: str, results: list[ModeResult]) -> str:
    header = (
        f"{'mode':<10} {'held for backward':>20} {'recomputed ops':>15} "
        f"{'recomputed FLOPs':>22} {'step time':>10} {'max |grad diff|':>16}"
    )
    lines = [title, header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.mode:<10} {r.held_bytes / 2**20:>9.2f} MiB ({r.held_ratio:>5.1%}) "
            f"{r.recomputed_ops:>15} {r.recomputed_flops / 1e6:>9.1f} MFLOP ({r.recomputed_flops_ratio:>5.1%}) "
            f"{r.wall_ratio:>9.2f}x {r.max_grad_diff:>16.1e}"
        )
    return "\n".join(lines)


def main(kinds: list[str], as_json: bool) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = {kind: compare_modes(kind) for kind in kinds}
    if as_json:
        print(json.dumps({k: [r.__dict__ for r in v] for k, v in report.items()}, indent=2))
    else:
        for kind, results in report.items():
            print(
                format_table(
                    f"\n{kind} model: one training step per mode "
                    "(ratios against no AC; FLOPs against one forward)",
                    results,
                )
            )
    worst = max(r.max_grad_diff for results in report.values() for r in results)
    return 0 if worst == 0.0 else 1
