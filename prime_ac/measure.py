"""Deterministic measurements of one training step: memory held for backward, replayed work.

Counting beats timing on shared machines: bytes held between forward and backward, operators
dispatched during backward and their FLOPs are exact and repeatable. A checkpointed step's
backward runs the same backward operators as the unwrapped step plus its recomputed forward
operators, so differences against the unwrapped step are the replayed work.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["StepStats", "StorageTracker", "OpCounter", "measure_step"]


class StorageTracker(TorchDispatchMode):
    """Records every storage that operators create while active.

    ``held_bytes()`` is then the size of those still alive: what the forward left behind for the
    backward, autograd's saved tensors and SAC's cache alike (both hold the storages).
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}
        self._preexisting: set[int] = set()

    def exclude(self, tensors) -> None:
        """Storages that existed before (parameters, inputs) are never counted, views included."""
        self._preexisting.update(t.untyped_storage().data_ptr() for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                if storage.data_ptr() not in self._preexisting:
                    self._storages.setdefault(storage.data_ptr(), weakref.ref(storage))
        return out

    def held_bytes(self) -> int:
        gc.collect()
        alive = (ref() for ref in self._storages.values())
        return sum(s.nbytes() for s in alive if s is not None)


class OpCounter(TorchDispatchMode):
    """Counts dispatched operator overloads."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class StepStats:
    loss: float
    held_bytes: int  # storages created in forward and alive at backward start (loss excluded)
    forward_flops: int
    backward_flops: int  # includes recompute under checkpointing
    backward_ops: Counter = field(repr=False)
    wall_s: float
    grads: dict[str, torch.Tensor] = field(repr=False)


def measure_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> StepStats:
    """Run ``loss_fn(model).backward()`` three times: timed, memory-tracked, counted.

    Gradients come from the timed run, which runs under no extra mode.
    """
    params = [p for p in model.parameters()] + [b for b in model.buffers()]

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = loss_fn(model)
    loss.backward()
    wall = time.perf_counter() - start
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    tracker = StorageTracker()
    tracker.exclude(params)
    with tracker:
        tracked = loss_fn(model)
    tracker._storages.pop(tracked.untyped_storage().data_ptr(), None)
    held = tracker.held_bytes()
    tracked.backward()

    model.zero_grad(set_to_none=True)
    forward_counter = FlopCounterMode(display=False)
    with forward_counter:
        counted = loss_fn(model)
    backward_counter, ops = FlopCounterMode(display=False), OpCounter()
    with backward_counter, ops:
        counted.backward()
    model.zero_grad(set_to_none=True)
    return StepStats(
        loss=loss.item(),
        held_bytes=held,
        forward_flops=forward_counter.get_total_flops(),
        backward_flops=backward_counter.get_total_flops(),
        backward_ops=ops.counts,
        wall_s=wall,
        grads=grads,
    )
