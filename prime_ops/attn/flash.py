"""Adapters from the ``prime_rl_attn`` contract to FlashAttention 2, 3 and 4.

Each adapter calls one pinned entry point of its library, every argument by keyword (FA4's
backward takes its six tensors by position, in the library's order q, k, v, out, dout, lse), and
translates the conventions that differ between them:

- window: the contract uses ``-1`` for unbounded; FA2 and FA3 take ``-1``, FA4 takes ``None``.
- lse of rows that see no key: the contract says ``-inf``. FA2 returns ``+inf`` there (and its
  backward needs ``+inf`` back to produce zero probabilities); FA3 fills the whole lse with
  ``+inf`` when the batch has no key at all (``hopper/flash_api.cpp``, ``mha_fwd``: ``total_k ==
  0`` branch); FA4 already uses ``-inf``.
- lse layout: all three return ``[H, total_q]`` fp32 for varlen inputs, as the contract does.
- head dims: each library's own limits (and FA3's architectures) are mirrored by
  ``fa*_head_dims`` below, so a call the kernel would refuse fails before launch (also while
  tracing), naming the backend and the rule; ``fa4_softcap`` adds FA4's one softcap limit of
  the backward, checked with them.

Libraries are imported on the first call through :func:`prime_ops.backends.import_backend`.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from prime_ops.backends import import_backend

if TYPE_CHECKING:
    from prime_ops.attn.args import VarlenArgs

__all__ = [
    "FA3_BUILD",
    "cuda_arch",
    "fa2_backward",
    "fa2_forward",
    "fa2_head_dims",
    "fa3_backward",
    "fa3_forward",
    "fa3_head_dims",
    "fa4_backward",
    "fa4_forward",
    "fa4_head_dims",
    "fa4_softcap",
]

FA3_BUILD = (
    "FA3 has no package on PyPI; build it from source on a Hopper machine: git clone "
    "https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && "
    "pip install . --no-build-isolation"
)

_INF = float("inf")


def _fa2():
    return import_backend("flash_attn.flash_attn_interface", extra="fa2")


def _fa3():
    import_backend("flash_attn_3._C", extra=None, build=FA3_BUILD)  # registers the ops
    return torch.ops.flash_attn_3


def _fa4():
    return import_backend("flash_attn.cute.interface", extra="fa4")


# --- head-dim limits, as each library enforces them ------------------------------------------


def cuda_arch(device: torch.device) -> int | None:
    """Compute capability of a CUDA device as ``major * 10 + minor`` (90 = Hopper, 100 =
    Blackwell); None where it cannot be known (meta or fake tensors on a machine without CUDA).
    ``FLASH_ATTENTION_ARCH`` overrides it, as FA4's kernel selection does."""
    if device.type != "cuda":
        return None
    override = os.environ.get("FLASH_ATTENTION_ARCH")
    if override:
        digits = "".join(c for c in override if c.isdigit())
        return int(digits) if digits else None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _refuse(backend: str, dims: str, why: str) -> None:
    raise ValueError(f"backend {backend!r} cannot run head dims {dims}: {why}")


def fa2_head_dims(head_dim: int, head_dim_v: int, arch: int | None, backward: bool) -> None:
    """FA2 2.8.3 (``csrc/flash_attn/flash_api.cpp``): V's head dim equals Q/K's, at most 256; the
    kernel needs a multiple of 8 and the adapter pads to one, as ``flash_attn_interface`` does."""
    dims = f"(q/k {head_dim}, v {head_dim_v})"
    if head_dim != head_dim_v:
        _refuse("fa2", dims, "FA2 needs v's head dim equal to q's; use 'fa3' or 'fa4'")
    if not 1 <= head_dim <= 256:
        _refuse("fa2", dims, "FA2 supports head dims from 1 to 256")


def fa3_head_dims(head_dim: int, head_dim_v: int, arch: int | None, backward: bool) -> None:
    """FA3 (``hopper/flash_api.cpp`` ``mha_fwd`` / ``mha_bwd``): multiples of 8, Q/K at most 256;
    V may differ from Q/K only for Q/K in (128, 192] with V in (96, 128], or Q/K <= 64 with
    V <= 512, and only on Hopper; the backward takes max(Q/K, V) <= 256. No kernel from SM100 on:
    ``ARCH_SWITCH`` (``hopper/static_switch.h``) sends every arch >= 90 to the SM90 kernels, which
    ``hopper/setup.py`` builds for sm_90a only (SM8x has its own, built for sm_80)."""
    if arch is not None and arch >= 100:
        raise ValueError(
            f"backend 'fa3' has no kernel for SM{arch}: FA3 sends every arch from SM90 up to its "
            "SM90 kernels, built for sm_90a only, so the launch would fail; use 'fa4' (or 'fa2')"
        )
    dims = f"(q/k {head_dim}, v {head_dim_v})"
    if head_dim % 8 or head_dim_v % 8 or head_dim < 8 or head_dim_v < 8:
        _refuse("fa3", dims, "FA3 needs head dims that are positive multiples of 8")
    if head_dim > 256:
        _refuse("fa3", dims, "FA3 supports q/k head dims up to 256")
    if head_dim_v != head_dim:
        if not (128 < head_dim <= 192 and 96 < head_dim_v <= 128) and not (
            head_dim <= 64 and head_dim_v <= 512
        ):
            _refuse(
                "fa3",
                dims,
                "FA3 allows v's head dim to differ from q's only for q/k in (128, 192] with v "
                "in (96, 128], or q/k <= 64 with v <= 512",
            )
        if arch is not None and arch // 10 != 9:
            _refuse(
                "fa3", dims, f"FA3 runs a different v head dim only on Hopper (SM90), not SM{arch}"
            )
    if backward and max(head_dim, head_dim_v) > 256:
        _refuse("fa3", dims, "FA3's backward supports head dims up to 256 (v's included)")


def fa4_head_dims(head_dim: int, head_dim_v: int, arch: int | None, backward: bool) -> None:
    """FA4 (``flash_attn/cute/interface.py``, ``_validate_head_dims``) for fp16/bf16: on SM90,
    multiples of 8 in [8, 256]; on SM100/SM110, multiples of 8 in [8, 128], or (192, 128),
    (256, 256), (64, 512), (512, 512). SM80/SM120 are not validated by the library; the backward
    does not run on SM80. Unknown arch (tracing without CUDA): only the bounds every arch shares."""
    dims = f"(q/k {head_dim}, v {head_dim_v})"
    if head_dim < 1 or head_dim_v < 1:
        _refuse("fa4", dims, "head dims must be positive")
    if arch is None:
        return
    family = arch // 10
    aligned = head_dim % 8 == 0 and head_dim_v % 8 == 0
    if family == 9 and not (
        aligned and head_dim <= 256 and head_dim_v <= 256 and min(head_dim, head_dim_v) >= 8
    ):
        _refuse("fa4", dims, "FA4 on SM90 takes multiples of 8 in [8, 256]")
    if family in (10, 11):
        standard = 8 <= head_dim <= 128 and 8 <= head_dim_v <= 128
        special = (head_dim, head_dim_v) in ((192, 128), (256, 256)) or (
            head_dim_v == 512 and head_dim in (64, 512)
        )
        if not (aligned and (standard or special)):
            _refuse(
                "fa4",
                dims,
                f"FA4 on SM{arch} takes multiples of 8 in [8, 128], or exactly (192, 128), "
                "(256, 256), (64, 512) or (512, 512); head dims 129-255 are refused otherwise",
            )
    if backward and family == 8:
        _refuse("fa4", dims, "FA4 has no backward on SM8x; use 'fa2' there")


def fa4_softcap(head_dim: int, head_dim_v: int, arch: int | None, softcap: float) -> None:
    """FA4's backward (``flash_attn/cute/interface.py``, ``_flash_attn_bwd``) before 4.0.0b39 runs
    head dims (256, 256) on SM100/SM110 in a dedicated kernel and asserts ``softcap == 0.0`` for
    it, unless ``FLASH_ATTENTION_HD256_GENERIC_BWD=1`` picks its general kernel, which takes
    softcap; 4.0.0b39 dropped that kernel, and its backward takes softcap there. Checked with the
    head dims in the backward's kernel and fake (so also while tracing); without flash-attn-4
    installed (a trace on a machine without it) the rule of the extra's floor, 4.0.0b28, holds."""
    if (
        softcap > 0.0
        and arch is not None
        and arch // 10 in (10, 11)
        and (head_dim, head_dim_v) == (256, 256)
        and os.environ.get("FLASH_ATTENTION_HD256_GENERIC_BWD", "0") != "1"
        and _fa4_has_hd256_backward()
    ):
        _refuse(
            "fa4",
            f"(q/k {head_dim}, v {head_dim_v})",
            f"FA4's SM{arch} backward for head dims (256, 256) has no softcap (got "
            f"softcap={softcap}) before flash-attn-4 4.0.0b39; use 'fa2', softcap=0, "
            "FLASH_ATTENTION_HD256_GENERIC_BWD=1 (FA4's general backward kernel) or "
            "flash-attn-4>=4.0.0b39",
        )


def _fa4_has_hd256_backward() -> bool:
    """Whether the installed flash-attn-4 (read without importing it) is older than 4.0.0b39,
    the first release without the dedicated SM100 (256, 256) backward; True if none is."""
    try:
        release = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return True
    match = re.match(r"(\d+)\.(\d+)\.(\d+)(?:b(\d+))?", release)
    if match is None:
        return True
    major, minor, patch, beta = match.groups()
    final = beta is None  # 4.0.0 comes after every 4.0.0bN
    return (int(major), int(minor), int(patch), final, int(beta or 0)) < (4, 0, 0, False, 39)


# --- FA2 ---------------------------------------------------------------------------------------


def _pad8(t: Tensor) -> Tensor:
    """Pad the head dim to a multiple of 8 with zeros, as FA2's own autograd functions do."""
    extra = -t.shape[-1] % 8
    return F.pad(t, [0, extra]) if extra else t


def _fa2_max_seqlen_q(max_seqlen_q: int, q: Tensor, cu_seqlens_q: Tensor) -> int:
    """With ``max_seqlen_q == 1`` (and GQA, no window), FA2's ``mha_varlen_fwd`` reshapes q to
    ``[batch, ...]``, which needs exactly one query per sequence: an empty sequence (ring shards
    make them) breaks it. 2 is an equally valid bound that takes the general path."""
    if max_seqlen_q == 1 and q.shape[0] != cu_seqlens_q.shape[0] - 1:
        return 2
    return max_seqlen_q


def _fa2_options(a: VarlenArgs, max_seqlen_q: int) -> dict:
    """``a`` under the keyword names FA2's varlen forward and backward share."""
    return dict(
        cu_seqlens_q=a.cu_seqlens_q,
        cu_seqlens_k=a.cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=a.max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=a.softmax_scale,
        causal=a.causal,
        window_size_left=a.window_size_left,
        window_size_right=a.window_size_right,
        softcap=a.softcap,
        alibi_slopes=None,
    )


def fa2_forward(q: Tensor, k: Tensor, v: Tensor, a: VarlenArgs) -> tuple[Tensor, Tensor]:
    head_dim_v = v.shape[-1]
    out, lse, _, _ = _fa2()._flash_attn_varlen_forward(
        q=_pad8(q),
        k=_pad8(k),
        v=_pad8(v),
        **_fa2_options(a, _fa2_max_seqlen_q(a.max_seqlen_q, q, a.cu_seqlens_q)),
        return_softmax=False,
    )
    if out.shape[-1] != head_dim_v:
        out = out[..., :head_dim_v].contiguous()
    return out, lse.masked_fill_(lse == _INF, -_INF)


def fa2_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, a: VarlenArgs
) -> tuple[Tensor, Tensor, Tensor]:
    q_p, k_p, v_p = _pad8(q), _pad8(k), _pad8(v)
    dq, dk, dv = torch.empty_like(q_p), torch.empty_like(k_p), torch.empty_like(v_p)
    _fa2()._flash_attn_varlen_backward(
        dout=_pad8(dout),
        q=q_p,
        k=k_p,
        v=v_p,
        out=_pad8(out),
        softmax_lse=lse.masked_fill(lse == -_INF, _INF),
        dq=dq,
        dk=dk,
        dv=dv,
        **_fa2_options(a, a.max_seqlen_q),
        deterministic=False,
    )
    if dq.shape[-1] != q.shape[-1]:
        width = q.shape[-1]
        dq, dk, dv = (g[..., :width].contiguous() for g in (dq, dk, dv))
    return dq, dk, dv


# --- FA3 ---------------------------------------------------------------------------------------


def _fa3_options(a: VarlenArgs) -> dict:
    """``a`` under the keyword names FA3's ``fwd`` and ``bwd`` share."""
    return dict(
        cu_seqlens_q=a.cu_seqlens_q,
        cu_seqlens_k=a.cu_seqlens_k,
        max_seqlen_q=a.max_seqlen_q,
        max_seqlen_k=a.max_seqlen_k,
        softmax_scale=a.softmax_scale,
        is_causal=a.causal,
        window_size_left=a.window_size_left,
        window_size_right=a.window_size_right,
        softcap=a.softcap,
    )


def fa3_forward(q: Tensor, k: Tensor, v: Tensor, a: VarlenArgs) -> tuple[Tensor, Tensor]:
    out, lse, _, _ = _fa3().fwd(q=q, k=k, v=v, **_fa3_options(a))
    if k.shape[0] == 0:  # no key in the whole batch: FA3 skips the kernel and writes +inf
        lse.fill_(-_INF)
    return out, lse


def fa3_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, a: VarlenArgs
) -> tuple[Tensor, Tensor, Tensor]:
    # FA3's bwd returns its softmax_d and fp32 accumulators; the gradients land in dq, dk, dv.
    # Its preprocessing maps lse -inf to p = 0, and with total_k == 0 it only zeroes dq.
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
        **_fa3_options(a),
        deterministic=False,
    )
    return dq, dk, dv


# --- FA4 ---------------------------------------------------------------------------------------


def _fa4_window(size: int) -> int | None:
    return None if size < 0 else size


def fa4_forward(q: Tensor, k: Tensor, v: Tensor, a: VarlenArgs) -> tuple[Tensor, Tensor]:
    # Everything but q, k, v by keyword: FA4 inserted a positional `qv` before (beta9), and
    # later betas return more than two items.
    result = _fa4()._flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=a.cu_seqlens_q,
        cu_seqlens_k=a.cu_seqlens_k,
        max_seqlen_q=a.max_seqlen_q,
        max_seqlen_k=a.max_seqlen_k,
        softmax_scale=a.softmax_scale,
        causal=a.causal,
        window_size_left=_fa4_window(a.window_size_left),
        window_size_right=_fa4_window(a.window_size_right),
        softcap=a.softcap if a.softcap > 0.0 else None,
        return_lse=True,
    )
    return result[0], result[1]


def fa4_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, a: VarlenArgs
) -> tuple[Tensor, Tensor, Tensor]:
    grads = _fa4()._flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=a.softmax_scale,
        causal=a.causal,
        softcap=a.softcap,
        window_size_left=_fa4_window(a.window_size_left),
        window_size_right=_fa4_window(a.window_size_right),
        cu_seqlens_q=a.cu_seqlens_q,
        cu_seqlens_k=a.cu_seqlens_k,
        max_seqlen_q=a.max_seqlen_q,
        max_seqlen_k=a.max_seqlen_k,
    )
    return grads[0], grads[1], grads[2]
