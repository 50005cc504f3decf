"""The argument record every varlen attention backend takes: the bottom of prime_ops.attn.

:mod:`prime_ops.attn.varlen` binds each op call into a :class:`VarlenArgs`; the backends
(:mod:`~prime_ops.attn.flash`, :mod:`~prime_ops.attn.sdpa`) and the ring variants read it from
here, so no backend imports the module that dispatches to it.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["VarlenArgs"]


class VarlenArgs(NamedTuple):
    """Everything of a varlen call but q, k and v, in the contract's conventions.

    ``max_seqlen_*`` bound every sequence (the packed length when the caller passed None);
    windows use -1 for unbounded; ``softcap`` 0 is off.
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float
    window_size_left: int
    window_size_right: int
    softcap: float
