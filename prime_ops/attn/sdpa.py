"""Pure-PyTorch varlen attention: the numerical reference, and the backend for CPUs and any GPU.

Each packed sequence is computed on its own with explicit scores in fp32 (or float64), so the
log-sum-exp comes out exactly and softcap needs no special kernel. The backward uses the ``out``
and ``lse`` it is given rather than recomputing them: ring attention relies on this to turn a
shard's scores into the globally normalised probabilities.

Memory per sequence is ``H * L_q * L_k`` fp32 scores; this backend is for checking and small runs,
the flash backends are for production sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from prime_ops.attn.seqlens import spans

if TYPE_CHECKING:
    from prime_ops.attn.args import VarlenArgs

__all__ = ["backward", "forward", "lse_dtype", "visible"]


def visible(len_q: int, len_k: int, causal: bool, left: int, right: int, device) -> Tensor:
    """Bool ``[len_q, len_k]``: which keys each query sees.

    Queries are aligned to the end of the keys (query ``i`` sits at key position
    ``i + len_k - len_q``), the FlashAttention convention; ``causal`` caps the right window at 0.
    """
    pos = torch.arange(len_q, device=device)[:, None] + (len_k - len_q)
    key = torch.arange(len_k, device=device)[None, :]
    if causal:
        right = 0 if right < 0 else min(right, 0)
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= key <= pos + right
    if left >= 0:
        mask &= key >= pos - left
    return mask


def _mask(len_q: int, len_k: int, a: VarlenArgs, device) -> Tensor:
    return visible(len_q, len_k, a.causal, a.window_size_left, a.window_size_right, device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The contract's lse dtype for inputs of ``dtype``: fp32, or fp64 for fp64 inputs (an fp32
    lse would cap a float64 backward, which uses it, at fp32 accuracy)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads(x: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """``[L, H, D]`` -> ``[H // groups, groups, L, D]``: query heads grouped by their kv head."""
    length, heads, dim = x.shape
    return x.to(dtype).reshape(length, heads // groups, groups, dim).permute(1, 2, 0, 3)


def _unheads(x: Tensor) -> Tensor:
    """Inverse of :func:`_heads`: ``[Hkv, G, L, D]`` -> ``[L, Hkv * G, D]``."""
    hkv, groups, length, dim = x.shape
    return x.permute(2, 0, 1, 3).reshape(length, hkv * groups, dim)


def _scores(qs: Tensor, ks: Tensor, scale: float, softcap: float) -> tuple[Tensor, Tensor | None]:
    """Scores ``[Hkv, G, Lq, Lk]`` and, with softcap, the tanh needed by the backward."""
    scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale
    if softcap <= 0.0:
        return scores, None
    capped = torch.tanh(scores / softcap)
    return capped * softcap, capped


def _finite(lse: Tensor) -> Tensor:
    """Rows that see no key have lse -inf; use 0 there so exp(-inf - 0) gives p = 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _sequences(q, k, a):
    spans_q = spans(a.cu_seqlens_q, q.shape[0], a.max_seqlen_q, "cu_seqlens_q")
    spans_k = spans(a.cu_seqlens_k, k.shape[0], a.max_seqlen_k, "cu_seqlens_k")
    return [(sq, sk) for sq, sk in zip(spans_q, spans_k, strict=True) if sq[1] > sq[0]]


def forward(q: Tensor, k: Tensor, v: Tensor, a: VarlenArgs) -> tuple[Tensor, Tensor]:
    """``(out [T, H, Dv], lse [H, T])``; rows that see no key get out 0 and lse -inf."""
    groups = q.shape[1] // k.shape[1]
    acc = _compute_dtype(q.dtype)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full(
        (q.shape[1], q.shape[0]), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device
    )
    for (q0, q1), (k0, k1) in _sequences(q, k, a):
        qs = _heads(q[q0:q1], groups, acc)
        ks = _heads(k[k0:k1], 1, acc)
        vs = _heads(v[k0:k1], 1, acc)
        scores, _ = _scores(qs, ks, a.softmax_scale, a.softcap)
        mask = _mask(q1 - q0, k1 - k0, a, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(seq_lse)[..., None])
        out[q0:q1] = _unheads(torch.matmul(probs, vs)).to(out.dtype)
        lse[:, q0:q1] = seq_lse.reshape(q.shape[1], q1 - q0).to(lse.dtype)
    return out, lse


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, a: VarlenArgs
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` from the given ``out`` and ``lse`` (which may be global, see module doc)."""
    groups = q.shape[1] // k.shape[1]
    acc = _compute_dtype(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in _sequences(q, k, a):
        qs = _heads(q[q0:q1], groups, acc)
        ks = _heads(k[k0:k1], 1, acc)
        vs = _heads(v[k0:k1], 1, acc)
        dos = _heads(dout[q0:q1], groups, acc)
        os_ = _heads(out[q0:q1], groups, acc)
        seq_lse = lse[:, q0:q1].to(acc).reshape(k.shape[1], groups, q1 - q0)
        scores, capped = _scores(qs, ks, a.softmax_scale, a.softcap)
        mask = _mask(q1 - q0, k1 - k0, a, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.exp(scores - _finite(seq_lse)[..., None])
        dprobs = torch.matmul(dos, vs.transpose(-1, -2))
        delta = (dos * os_).sum(dim=-1, keepdim=True)
        dscores = probs * (dprobs - delta)
        if capped is not None:
            dscores = dscores * (1.0 - capped * capped)
        dscores = dscores * a.softmax_scale
        dq[q0:q1] = _unheads(torch.matmul(dscores, ks)).to(dq.dtype)
        dk[k0:k1] = _unheads(torch.matmul(dscores.transpose(-1, -2), qs).sum(1, keepdim=True)).to(
            dk.dtype
        )
        dv[k0:k1] = _unheads(torch.matmul(probs.transpose(-1, -2), dos).sum(1, keepdim=True)).to(
            dv.dtype
        )
    return dq, dk, dv
