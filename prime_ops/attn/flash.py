"""Adapters from the ``prime_rl_attn`` contract to FlashAttention 2, 3 and 4.

Each adapter calls one pinned entry point of its library, every argument by keyword (FA4's
backward takes its six tensors by position, in the library's order q, k, v, out, dout, lse), and
translates the conventions that differ between them:

- window: the contract uses ``-1`` for unbounded; FA2 and FA3 take ``-1``, FA4 takes ``None``.
- lse of rows that see no key: the contract says ``-inf``; FA2 returns ``+inf`` (and its backward
  needs ``+inf`` back to produce zero probabilities); FA3 and FA4 already use ``-inf``.
- lse layout: all three return ``[H, total_q]`` fp32 for varlen inputs, as the contract does.

Libraries are imported on the first call through :func:`prime_ops.backends.import_backend`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from prime_ops.backends import import_backend

__all__ = [
    "FA3_BUILD",
    "fa2_backward",
    "fa2_forward",
    "fa3_backward",
    "fa3_forward",
    "fa4_backward",
    "fa4_forward",
]

FA3_BUILD = (
    "FA3 has no PyPI package; build it from source on a Hopper machine: git clone "
    "https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && "
    "pip install . --no-build-isolation"
)

_INF = float("inf")


def _fa2():
    return import_backend("flash_attn.flash_attn_interface", extra="fa2")


def _fa3():
    import_backend(
        "flash_attn_3._C", extra="fa3", build=FA3_BUILD
    )  # registers torch.ops.flash_attn_3
    return torch.ops.flash_attn_3


def _fa4():
    return import_backend("flash_attn.cute.interface", extra="fa4")


def _fa4_window(size: int) -> int | None:
    return None if size < 0 else size


def fa2_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    window_size_left,
    window_size_right,
    softcap,
) -> tuple[Tensor, Tensor]:
    out, lse, _, _ = _fa2()._flash_attn_varlen_forward(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
        softcap=softcap,
        alibi_slopes=None,
        return_softmax=False,
    )
    return out, lse.masked_fill_(lse == _INF, -_INF)


def fa2_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    window_size_left,
    window_size_right,
    softcap,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _fa2()._flash_attn_varlen_backward(
        dout=dout,
        q=q,
        k=k,
        v=v,
        out=out,
        softmax_lse=lse.masked_fill(lse == -_INF, _INF),
        dq=dq,
        dk=dk,
        dv=dv,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
        softcap=softcap,
        alibi_slopes=None,
        deterministic=False,
    )
    return dq, dk, dv


def fa3_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    window_size_left,
    window_size_right,
    softcap,
) -> tuple[Tensor, Tensor]:
    out, lse, _, _ = _fa3().fwd(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale,
        is_causal=causal,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
        softcap=softcap,
    )
    return out, lse


def fa3_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    window_size_left,
    window_size_right,
    softcap,
) -> tuple[Tensor, Tensor, Tensor]:
    # FA3's bwd returns its softmax_d and fp32 accumulators; the gradients land in dq, dk, dv.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _fa3().bwd(
        dout=dout,
        q=q,
        k=k,
        v=v,
        out=out,
        softmax_lse=lse,
        dq=dq,
        dk=dk,
        dv=dv,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale,
        is_causal=causal,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
        softcap=softcap,
        deterministic=False,
    )
    return dq, dk, dv


def fa4_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    window_size_left,
    window_size_right,
    softcap,
) -> tuple[Tensor, Tensor]:
    # Everything but q, k, v by keyword: FA4 inserted a positional `qv` before (beta9), and
    # later betas return more than two items.
    result = _fa4()._flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size_left=_fa4_window(window_size_left),
        window_size_right=_fa4_window(window_size_right),
        softcap=softcap if softcap > 0.0 else None,
        return_lse=True,
    )
    return result[0], result[1]


def fa4_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    window_size_left,
    window_size_right,
    softcap,
) -> tuple[Tensor, Tensor, Tensor]:
    grads = _fa4()._flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=softmax_scale,
        causal=causal,
        softcap=softcap,
        window_size_left=_fa4_window(window_size_left),
        window_size_right=_fa4_window(window_size_right),
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    return grads[0], grads[1], grads[2]
