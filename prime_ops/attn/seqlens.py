"""Reading and slicing ``cu_seqlens``, the int32 offsets that describe a packed batch."""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

from prime_ops._compat import is_fake

__all__ = ["can_read", "shard_cu_seqlens", "spans"]


def spans(cu_seqlens: Tensor, total: int, max_seqlen: int, name: str) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` per sequence, after checking the offsets (one host read).

    Offsets must start at 0, never decrease and end at ``total``; no sequence may be longer than
    ``max_seqlen``, because kernels size their grids from it.
    """
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"{name} must start at 0 and end at the packed length {total}; got "
            f"{bounds[0]}..{bounds[-1]}"
        )
    pairs = list(pairwise(bounds))
    for i, (start, end) in enumerate(pairs):
        if end < start:
            raise ValueError(f"{name} must be non-decreasing; entry {i + 1} < entry {i}: {bounds}")
        if end - start > max_seqlen:
            raise ValueError(
                f"{name} holds a sequence of {end - start} tokens, longer than max_seqlen "
                f"{max_seqlen}; pass the true maximum"
            )
    return pairs


def shard_cu_seqlens(cu_seqlens: Tensor, start: int, length: int) -> Tensor:
    """Offsets of every sequence cut to the token range ``[start, start + length)``.

    Sequences outside the range keep zero length, so the batch size is unchanged and the result
    indexes the shard from 0 to ``length``. Computed on the tensors' device: no host sync.
    """
    bounds = cu_seqlens.to(torch.int64)
    first = bounds[:-1].clamp(start, start + length)
    last = bounds[1:].clamp(start, start + length)
    return torch.cat([bounds.new_zeros(1), (last - first).cumsum(0)]).to(torch.int32)


def can_read(cu_seqlens: Tensor) -> bool:
    """Whether the offsets' values can be read now: not while compiling, not on fake or meta."""
    return not (
        torch.compiler.is_compiling() or is_fake(cu_seqlens) or cu_seqlens.device.type == "meta"
    )
