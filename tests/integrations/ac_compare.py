"""One training step of a model under some activation checkpointing, against no AC.

Held bytes and backward FLOPs come from prime_ac.measure (storages alive when backward starts;
FLOPs of every backward operator, recompute included), the same counters for every wrapper, so a
framework's own AC and prime_ac's are measured alike. Gradients are keyed by parameter name with
torch's ``CheckpointWrapper`` segment removed, so wrapped and unwrapped models compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from prime_ac.measure import measure_step

_WRAPPER = "_checkpoint_wrapped_module."


@dataclass
class Step:
    held: int  # bytes held for backward
    backward_flops: int
    grads: dict[str, torch.Tensor]


def step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> Step:
    stats = measure_step(model, loss_fn)
    grads = {name.replace(_WRAPPER, ""): g for name, g in stats.grads.items()}
    return Step(stats.held_bytes, stats.backward_flops, grads)


def assert_bitwise(got: Step, want: Step, label: str) -> None:
    assert got.grads.keys() == want.grads.keys(), label
    different = [n for n in want.grads if not torch.equal(got.grads[n], want.grads[n])]
    assert not different, f"{label}: gradients differ from no AC in {different}"


def run(
    build: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module], torch.Tensor],
    apply: Callable[[nn.Module], object],
    reference: Step,
    label: str,
) -> Step:
    """Build a fresh model, apply the AC, take one step; gradients must be those of no AC."""
    model = build()
    apply(model)
    result = step(model, loss_fn)
    assert_bitwise(result, reference, label)
    return result


def replayed(result: Step, reference: Step) -> int:
    """FLOPs the backward spent re-running the forward."""
    return result.backward_flops - reference.backward_flops
