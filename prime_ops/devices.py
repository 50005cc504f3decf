"""One device per op call.

A call that mixes devices (``offsets`` on ``meta``, ``x`` on CPU) is dispatched to the fake of the
"highest" device, which then returns uninitialised memory as if it were a result. Every op of
prime_ops checks this first, in its kernels and in its fakes.
"""

from __future__ import annotations

import torch

__all__ = ["check_same_device"]


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming each tensor's device unless all given tensors share one.

    Example::

        check_same_device("prime_rl::grouped_fp8_gemm", x=x, weight=weight, offsets=offsets)
    """
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"{op} needs every tensor on one device, got {listed}; move them first")
