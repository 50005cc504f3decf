"""Triton kernels for ``prime_rl::sparse_mla``: forward and backward.

One program handles one query token and one KV head, i.e. all ``G = Hq // Hkv`` query heads
that read the same selected rows (padded to at least 16 for ``tl.dot``). The selected rows are
visited ``BLOCK_K`` at a time; head dims are visited ``BLOCK_D`` channels at a time, so
``d_qk = 576`` and ``d_v = 512`` need no power-of-two padding. Invalid slots (index < 0 or
>= S, or past ``topk``) load zeros and score ``-inf``.

- forward: a first pass over the selected rows computes the log-sum-exp; a second pass
  accumulates ``P @ V`` for one ``BLOCK_DV`` slice of the output (grid axis 2).
- backward (``delta = rowsum(dout * out)`` computed beforehand): per block of rows, rebuild
  ``P`` from lse, ``dS = P * (dout @ V^T - delta) * scale``; ``dq += dS @ K`` into this
  program's own fp32 rows, and ``dS^T @ q`` (+ ``P^T @ dout`` on the value channels) is
  atomically added into an fp32 ``dkv``: repeated indices add up.

Imported only on the first ``backend="triton"`` or ``"flashmla"`` call. On CPU the kernels run
under ``TRITON_INTERPRET=1`` (tests); Triton reads it when ``triton`` is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["backward", "forward"]

BLOCK_K = 16
BLOCK_D = 64


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32; ``UPCAST`` multiplies in fp32 (the CPU interpreter gets
    bf16 products wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _select(ind_ptr, t, g, k0, stride_it, stride_ih, TOPK, S, BLOCK_K: tl.constexpr):
    """Rows ``k0 .. k0 + BLOCK_K`` of the selection: (row index clamped to 0, valid mask)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    in_topk = offs_k < TOPK
    idx = tl.load(ind_ptr + t * stride_it + g * stride_ih + offs_k, mask=in_topk, other=-1)
    valid = in_topk & (idx >= 0) & (idx < S)
    return tl.where(valid, idx, 0), valid


@triton.jit
def _heads(g, G, BLOCK_H: tl.constexpr):
    """The ``G`` query heads that read KV head ``g`` (padded to ``BLOCK_H``) and their mask."""
    offs_h = tl.arange(0, BLOCK_H)
    return g * G + offs_h, offs_h < G


@triton.jit
def _load_heads(ptr, t, head_q, hmask, offs_d, dmask, stride_t, stride_h):
    """Channels ``offs_d`` of token ``t``'s heads ``head_q`` in q, out or dout
    (``[BLOCK_H, BLOCK_D]``), zeros where masked."""
    return tl.load(
        ptr + t * stride_t + head_q[:, None] * stride_h + offs_d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )


@triton.jit
def _load_rows(kv_ptr, rows, valid, g, offs_d, dmask, stride_ks, stride_kh):
    """Channels ``offs_d`` of the selected KV rows of head ``g`` (``[BLOCK_K, BLOCK_D]``), zeros
    for invalid slots."""
    return tl.load(
        kv_ptr + rows[:, None] * stride_ks + g * stride_kh + offs_d[None, :],
        mask=valid[:, None] & dmask[None, :],
        other=0.0,
    )


@triton.jit
def _scores(
    q_ptr,
    kv_ptr,
    t,
    g,
    rows,
    valid,
    head_q,
    hmask,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    D,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``q . k`` for this program's heads and rows, fp32 ``[BLOCK_H, BLOCK_K]``."""
    acc = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        qb = _load_heads(q_ptr, t, head_q, hmask, offs_d, dmask, stride_qt, stride_qh)
        kb = _load_rows(kv_ptr, rows, valid, g, offs_d, dmask, stride_ks, stride_kh)
        acc += _dot(qb, tl.trans(kb), PRECISION, UPCAST)
    return acc


@triton.jit
def _forward_kernel(
    q_ptr,
    kv_ptr,
    ind_ptr,
    out_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_it,
    stride_ih,
    stride_ot,
    stride_oh,
    S,
    TOPK,
    G,
    D,
    DV,
    scale,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0)
    g = tl.program_id(1)
    vc = tl.program_id(2)
    head_q, hmask = _heads(g, G, BLOCK_H)

    # Pass 1: running max and sum -> natural-log lse.
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)  # noqa: E741
    for k0 in range(0, TOPK, BLOCK_K):
        rows, valid = _select(ind_ptr, t, g, k0, stride_it, stride_ih, TOPK, S, BLOCK_K)
        s = _scores(
            q_ptr, kv_ptr, t, g, rows, valid, head_q, hmask, stride_qt, stride_qh,
            stride_ks, stride_kh, D, PRECISION, UPCAST, BLOCK_H, BLOCK_K, BLOCK_D,
        )  # fmt: skip
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)  # noqa: E741
        m = m_new
    lse = tl.where(l > 0.0, m + tl.log(tl.where(l > 0.0, l, 1.0)), float("-inf"))
    lse_safe = tl.where(l > 0.0, lse, 0.0)

    # Pass 2: this program's slice of the output channels.
    offs_dv = vc * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dvmask = offs_dv < DV
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for k0 in range(0, TOPK, BLOCK_K):
        rows, valid = _select(ind_ptr, t, g, k0, stride_it, stride_ih, TOPK, S, BLOCK_K)
        s = _scores(
            q_ptr, kv_ptr, t, g, rows, valid, head_q, hmask, stride_qt, stride_qh,
            stride_ks, stride_kh, D, PRECISION, UPCAST, BLOCK_H, BLOCK_K, BLOCK_D,
        )  # fmt: skip
        p = tl.where(valid[None, :], tl.exp(s * scale - lse_safe[:, None]), 0.0)
        v = _load_rows(kv_ptr, rows, valid, g, offs_dv, dvmask, stride_ks, stride_kh)
        acc += _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    tl.store(
        out_ptr + t * stride_ot + head_q[:, None] * stride_oh + offs_dv[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None] & dvmask[None, :],
    )
    if vc == 0:
        tl.store(lse_ptr + t * (G * tl.num_programs(1)) + head_q, lse, mask=hmask)


@triton.jit
def _backward_kernel(
    q_ptr,
    kv_ptr,
    ind_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    dkv_ptr,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_it,
    stride_ih,
    stride_ot,
    stride_oh,
    S,
    TOPK,
    G,
    D,
    DV,
    scale,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    g = tl.program_id(1)
    hq = G * tl.num_programs(1)
    head_q, hmask = _heads(g, G, BLOCK_H)
    lse = tl.load(lse_ptr + t * hq + head_q, mask=hmask, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(delta_ptr + t * hq + head_q, mask=hmask, other=0.0)
    dtype = q_ptr.dtype.element_ty

    for k0 in range(0, TOPK, BLOCK_K):
        rows, valid = _select(ind_ptr, t, g, k0, stride_it, stride_ih, TOPK, S, BLOCK_K)
        pmask = hmask[:, None] & valid[None, :]
        s = _scores(
            q_ptr, kv_ptr, t, g, rows, valid, head_q, hmask, stride_qt, stride_qh,
            stride_ks, stride_kh, D, PRECISION, UPCAST, BLOCK_H, BLOCK_K, BLOCK_D,
        )  # fmt: skip
        p = tl.where(pmask, tl.exp(s * scale - lse[:, None]), 0.0)
        dp = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        for d0 in range(0, DV, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dmask = offs_d < DV
            do = _load_heads(dout_ptr, t, head_q, hmask, offs_d, dmask, stride_ot, stride_oh)
            v = _load_rows(kv_ptr, rows, valid, g, offs_d, dmask, stride_ks, stride_kh)
            dp += _dot(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None]) * scale
        ds_lp = ds.to(dtype)
        p_lp = p.to(dtype)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            k = _load_rows(kv_ptr, rows, valid, g, offs_d, dmask, stride_ks, stride_kh)
            qb = _load_heads(q_ptr, t, head_q, hmask, offs_d, dmask, stride_qt, stride_qh)
            qmask = hmask[:, None] & dmask[None, :]
            # dq rows belong to this program alone: a plain read-modify-write.
            dq_offs = (t * hq + head_q[:, None]) * D + offs_d[None, :]
            dq = tl.load(dq_ptr + dq_offs, mask=qmask, other=0.0)
            dq += _dot(ds_lp, k, PRECISION, UPCAST)
            tl.store(dq_ptr + dq_offs, dq, mask=qmask)
            dk = _dot(tl.trans(ds_lp), qb, PRECISION, UPCAST)
            do = _load_heads(dout_ptr, t, head_q, hmask, offs_d, offs_d < DV, stride_ot, stride_oh)
            dk += _dot(tl.trans(p_lp), do, PRECISION, UPCAST)
            tl.atomic_add(
                dkv_ptr + (rows[:, None] * tl.num_programs(1) + g) * D + offs_d[None, :],
                dk,
                mask=valid[:, None] & dmask[None, :],
            )


def _launch(
    q: Tensor, kv: Tensor, indices: Tensor, o: Tensor, softmax_scale: float, d_v: int
) -> tuple[tuple, dict]:
    """What both kernels take after their pointers: the strides of q, kv, the indices and the
    output (``out``, or ``dout`` for the backward), the sizes and the scale; and their
    compile-time constants."""
    (_, hq, d), (s, hkv, _) = q.shape, kv.shape
    args = (
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1), o.stride(0), o.stride(1),
        s, indices.shape[2], hq // hkv, d, d_v, softmax_scale,
    )  # fmt: skip
    constants = {
        # fp32 inputs multiply in full fp32 (TF32 would lose precision the reference keeps)
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "UPCAST": q.device.type == "cpu" and q.dtype == torch.bfloat16,
        "BLOCK_H": max(16, triton.next_power_of_2(hq // hkv)),
        "BLOCK_K": BLOCK_K,
        "BLOCK_D": BLOCK_D,
    }
    return args, constants


def forward(
    q: Tensor, kv: Tensor, indices: Tensor, softmax_scale: float, d_v: int
) -> tuple[Tensor, Tensor]:
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    t, hq = q.shape[:2]
    out = q.new_empty(t, hq, d_v)
    lse = q.new_empty(t, hq, dtype=torch.float32)
    if t == 0:
        return out, lse
    args, constants = _launch(q, kv, indices, out, softmax_scale, d_v)
    block_dv = min(BLOCK_D, max(16, triton.next_power_of_2(d_v)))
    grid = (t, kv.shape[1], triton.cdiv(d_v, block_dv))
    _forward_kernel[grid](q, kv, indices, out, lse, *args, **constants, BLOCK_DV=block_dv)
    return out, lse


def backward(
    dout: Tensor,
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    d_v: int,
) -> tuple[Tensor, Tensor]:
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    dout, lse = dout.contiguous(), lse.contiguous()
    delta = (out.float() * dout.float()).sum(-1).contiguous()
    (t, hq, d), (s, hkv, _) = q.shape, kv.shape
    dq = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(s, hkv, d, dtype=torch.float32, device=kv.device)
    if t > 0:
        args, constants = _launch(q, kv, indices, dout, softmax_scale, d_v)
        _backward_kernel[(t, hkv)](q, kv, indices, dout, lse, delta, dq, dkv, *args, **constants)
    return dq.to(q.dtype), dkv.to(kv.dtype)
