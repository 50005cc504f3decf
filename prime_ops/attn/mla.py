"""DeepSeek sparse attention over MLA's shared latent as one operator: ``prime_rl::sparse_mla``.

Each query token attends only to the ``topk`` KV rows its indices name (DeepSeek-V3.2 / GLM-5
DSA layers). MLA shares one latent per KV row: keys are the full ``d_qk`` channels, values the
first ``d_v`` of them. The op follows FlashMLA's ``flash_mla_sparse_fwd`` conventions:

    sparse_mla(q [T, Hq, Dqk], kv [S, Hkv, Dqk], indices [T, Hkv, topk] int32,
               softmax_scale, d_v, backend) -> (out [T, Hq, d_v], lse [T, Hq] fp32)
    sparse_mla_backward(dout, q, kv, indices, out, lse, softmax_scale, d_v, backend)
        -> (dq [T, Hq, Dqk], dkv [S, Hkv, Dqk])

Query head ``h`` reads KV head ``h // (Hq // Hkv)``. An index below 0 or ``>= S`` selects
nothing; a repeated index counts once per occurrence (as in FlashMLA's gather). ``lse`` follows
the prime_ops contract: natural log, ``-inf`` for a query with no valid index (whose output is
0); it carries no gradient. The backward scatter-adds into ``dkv``, so repeated rows sum.

``backend`` is part of the call (no silent fallback): ``reference`` (plain PyTorch, any device),
``triton`` (forward and backward in Triton), ``flashmla`` (FlashMLA forward on Hopper/Blackwell,
Triton backward).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from prime_ops.attn.flash import cuda_arch
from prime_ops.backends import import_backend
from prime_ops.devices import check_same_device

__all__ = [
    "BACKENDS",
    "FLASHMLA_BUILD",
    "SparseMLABackend",
    "reference_backward",
    "reference_forward",
    "sparse_mla",
]

_NEG_INF = float("-inf")
# Elements of the gathered KV block the reference materialises at once (64 MiB in fp32).
_GATHER_BUDGET = 1 << 24


# --- reference ----------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _query_blocks(q: Tensor, kv: Tensor, indices: Tensor):
    """Yield ``(rows, k, valid)`` per block of queries: ``k [b, Hkv, topk, Dqk]`` is the
    gathered KV (zeros at invalid slots) in the compute dtype, ``valid [b, Hkv, topk]``.

    Blocks are sized so the gathered KV stays under ``_GATHER_BUDGET`` elements."""
    tokens = q.shape[0]
    s, hkv, dqk = kv.shape
    topk = indices.shape[2]
    block = max(1, _GATHER_BUDGET // max(1, hkv * topk * dqk))
    heads = torch.arange(hkv, device=kv.device)[None, :, None]
    for start in range(0, tokens, block):
        rows = slice(start, min(start + block, tokens))
        idx = indices[rows].long()
        valid = (idx >= 0) & (idx < s)
        k = kv[idx.where(valid, 0), heads].to(_compute_dtype(kv.dtype))
        yield rows, k * valid[..., None], valid


def _grouped(x: Tensor, hkv: int, dtype: torch.dtype) -> Tensor:
    """``[b, Hq, D]`` -> ``[b, Hkv, G, D]``: query heads grouped by the KV head they read."""
    return x.to(dtype).reshape(x.shape[0], hkv, x.shape[1] // hkv, x.shape[2])


def _finite(lse: Tensor) -> Tensor:
    """Queries without a valid index have lse -inf; 0 there makes exp(-inf - 0) = 0, not NaN."""
    return lse.masked_fill(lse == _NEG_INF, 0.0)


def reference_forward(
    q: Tensor, kv: Tensor, indices: Tensor, softmax_scale: float, d_v: int
) -> tuple[Tensor, Tensor]:
    """Sparse MLA in plain PyTorch (fp32, or float64 for float64 inputs), a query block at a time."""
    hkv = kv.shape[1]
    dtype = _compute_dtype(q.dtype)
    out = q.new_empty(q.shape[0], q.shape[1], d_v)
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)
    for rows, k, valid in _query_blocks(q, kv, indices):
        qs = _grouped(q[rows], hkv, dtype)  # [b, Hkv, G, D]
        scores = torch.matmul(qs, k.transpose(-1, -2)) * softmax_scale  # [b, Hkv, G, topk]
        scores = scores.masked_fill(~valid[:, :, None, :], _NEG_INF)
        block_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(block_lse)[..., None])
        o = torch.matmul(probs, k[..., :d_v])
        out[rows] = o.flatten(1, 2).to(out.dtype)
        lse[rows] = block_lse.flatten(1).float()
    return out, lse


def reference_backward(
    dout: Tensor,
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    d_v: int,
) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`reference_forward` from the given ``out`` and ``lse``.

    With ``P = exp(scale * q.k - lse)`` and ``delta = rowsum(dout * out)``:
    ``dS = P * (dout.v - delta)``, ``dq = scale * dS @ k``, and each selected KV row receives
    ``scale * dS^T @ q`` on all channels plus ``P^T @ dout`` on its first ``d_v`` channels."""
    s, hkv, dqk = kv.shape
    dtype = _compute_dtype(q.dtype)
    delta = (out.to(dtype) * dout.to(dtype)).sum(-1)  # [T, Hq]
    dq = q.new_empty(q.shape)
    dkv = torch.zeros(s, hkv, dqk, dtype=dtype, device=kv.device)
    heads = torch.arange(hkv, device=kv.device)[None, :, None]
    for rows, k, valid in _query_blocks(q, kv, indices):
        qs = _grouped(q[rows], hkv, dtype)
        do = _grouped(dout[rows], hkv, dtype)
        scores = torch.matmul(qs, k.transpose(-1, -2)) * softmax_scale
        scores = scores.masked_fill(~valid[:, :, None, :], _NEG_INF)
        block_lse = _grouped(_finite(lse[rows])[..., None], hkv, dtype)  # [b, Hkv, G, 1]
        probs = torch.exp(scores - block_lse)
        dp = torch.matmul(do, k[..., :d_v].transpose(-1, -2))
        block_delta = _grouped(delta[rows][..., None], hkv, dtype)
        ds = probs * (dp - block_delta) * softmax_scale
        dq[rows] = torch.matmul(ds, k).flatten(1, 2).to(dq.dtype)
        dk = torch.matmul(ds.transpose(-1, -2), qs)  # [b, Hkv, topk, Dqk]: summed over G
        dk[..., :d_v] += torch.matmul(probs.transpose(-1, -2), do)
        idx = indices[rows].long()
        dkv.index_put_((idx.where(valid, 0), heads), dk * valid[..., None], accumulate=True)
    return dq, dkv.to(kv.dtype)


# --- FlashMLA forward ---------------------------------------------------------------------------


FLASHMLA_BUILD = (
    "FlashMLA is built from source on a Hopper/Blackwell machine: git clone "
    "https://github.com/deepseek-ai/FlashMLA && cd FlashMLA && git submodule update --init "
    "--recursive && pip install -v . --no-build-isolation"
)


def _flash_mla():
    # PyPI's flash-mla (1.0.0.dev0) predates the sparse kernels: no extra to name.
    return import_backend("flash_mla", extra=None, build=FLASHMLA_BUILD)


def flashmla_forward(
    q: Tensor, kv: Tensor, indices: Tensor, softmax_scale: float, d_v: int
) -> tuple[Tensor, Tensor]:
    """``flash_mla.flash_mla_sparse_fwd`` with its lse converted to the prime_ops contract.

    FlashMLA's first sparse release (Sept. 2025) returned lse in base 2 (``-inf`` for a query
    without valid index); since the release that added ``attn_sink`` / ``topk_length`` (Jan.
    2026) it returns the natural log with ``+inf`` there. The parameter list tells them apart.
    """
    fwd = _flash_mla().flash_mla_sparse_fwd
    out, _max_logits, lse = fwd(
        q=q.contiguous(),
        kv=kv.contiguous(),
        indices=indices.contiguous(),
        sm_scale=softmax_scale,
        d_v=d_v,
    )
    if "topk_length" not in inspect.signature(fwd).parameters:
        lse = lse * math.log(2.0)
    return out, lse.masked_fill(lse == float("inf"), _NEG_INF)


def _flashmla_limits(q: Tensor, kv: Tensor, indices: Tensor, d_v: int) -> None:
    arch = cuda_arch(q.device)
    if arch is not None and arch != 90 and arch // 10 != 10:
        # FlashMLA's sparse_fwd.h: TORCH_CHECK(is_sm90a || is_sm100f) (9.0 or 10.x only).
        raise ValueError(
            f"backend 'flashmla' runs on SM90 and SM100/SM103 only (FlashMLA's sparse kernels); "
            f"this device is SM{arch}. Use backend='triton' there."
        )
    if kv.shape[1] != 1:
        raise ValueError(f"backend 'flashmla' needs one KV head (MQA); got Hkv={kv.shape[1]}")
    if q.shape[1] not in (64, 128):
        raise ValueError(f"backend 'flashmla' needs 64 or 128 query heads; got {q.shape[1]}")
    if q.shape[2] not in (512, 576) or d_v != 512:
        raise ValueError(
            f"backend 'flashmla' needs d_qk 512 or 576 and d_v 512; got d_qk={q.shape[2]}, "
            f"d_v={d_v}. Use backend='triton' or 'reference' for other head dims."
        )
    if indices.shape[2] == 0 or indices.shape[2] % 128:
        raise ValueError(
            f"backend 'flashmla' needs topk to be a positive multiple of 128 (its kernels read "
            f"indices in blocks of 128); got {indices.shape[2]}. Pad indices with -1."
        )


# --- Triton -------------------------------------------------------------------------------------


def _triton_kernels():
    # Imported by name (not from the package) so tests can re-import it in interpreter mode.
    return import_backend("prime_ops.attn.mla_triton", extra="triton")


def triton_forward(q, kv, indices, softmax_scale, d_v):
    return _triton_kernels().forward(q, kv, indices, softmax_scale, d_v)


def triton_backward(dout, q, kv, indices, out, lse, softmax_scale, d_v):
    return _triton_kernels().backward(dout, q, kv, indices, out, lse, softmax_scale, d_v)


def _triton_device(q: Tensor) -> None:
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend 'triton' runs on CUDA tensors; on CPU only under the Triton interpreter "
            "(set TRITON_INTERPRET=1 before triton is first imported; slow, for tests). Use "
            "backend='reference' on CPU."
        )


def _no_limits(q: Tensor, kv: Tensor, indices: Tensor, d_v: int) -> None:
    pass


# --- backends and checks ------------------------------------------------------------------------

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SparseMLABackend:
    """A forward/backward pair behind ``prime_rl::sparse_mla`` and what it accepts."""

    name: str
    device_types: tuple[str, ...] | None  # None: any device
    dtypes: tuple[torch.dtype, ...]
    limits: Callable[[Tensor, Tensor, Tensor, int], None]  # (q, kv, indices, d_v) -> raise
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor]]


BACKENDS: dict[str, SparseMLABackend] = {
    b.name: b
    for b in (
        SparseMLABackend(
            "reference",
            None,
            (*_HALF, torch.float32, torch.float64),
            _no_limits,
            reference_forward,
            reference_backward,
        ),
        SparseMLABackend(
            "triton",
            ("cuda", "cpu"),
            (*_HALF, torch.float32),
            _no_limits,
            triton_forward,
            triton_backward,
        ),
        SparseMLABackend(
            "flashmla",
            ("cuda",),
            (torch.bfloat16,),
            _flashmla_limits,
            flashmla_forward,
            triton_backward,
        ),
    )
}


def _backend(name: str) -> SparseMLABackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"backend={name!r} is not a sparse_mla backend; choose one of {sorted(BACKENDS)}"
        ) from None


def check_arguments(
    q: Tensor, kv: Tensor, indices: Tensor, softmax_scale: float, d_v: int, backend: str
) -> SparseMLABackend:
    """Raise ValueError for anything a kernel would reject or get silently wrong (metadata only).

    Runs in the kernels and the fakes alike, so a bad call fails while tracing."""
    spec = _backend(backend)
    for name, t, layout in (
        ("q", q, "[tokens, heads, d_qk]"),
        ("kv", kv, "[kv_tokens, kv_heads, d_qk]"),
        ("indices", indices, "[tokens, kv_heads, topk]"),
    ):
        if t.dim() != 3:
            raise ValueError(f"{name} must be {layout}; got shape {tuple(t.shape)}")
    if q.shape[2] != kv.shape[2]:
        raise ValueError(
            f"q and kv must have the same head dim d_qk; got {q.shape[2]} and {kv.shape[2]}"
        )
    if kv.shape[1] == 0 or q.shape[1] % kv.shape[1]:
        raise ValueError(
            f"q's heads ({q.shape[1]}) must be a multiple of kv's heads ({kv.shape[1]})"
        )
    if tuple(indices.shape[:2]) != (q.shape[0], kv.shape[1]):
        raise ValueError(
            f"indices must be [tokens, kv_heads, topk] = [{q.shape[0]}, {kv.shape[1]}, topk]; "
            f"got {tuple(indices.shape)}"
        )
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32 (FlashMLA's layout); got {indices.dtype}")
    if not 0 < d_v <= q.shape[2]:
        raise ValueError(
            f"d_v must be in [1, d_qk={q.shape[2]}] (values are kv[..., :d_v]); got {d_v}"
        )
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale}")
    check_same_device("prime_rl::sparse_mla", q=q, kv=kv, indices=indices)
    if q.dtype != kv.dtype:
        raise ValueError(f"q and kv must share a dtype; got {q.dtype} and {kv.dtype}")
    device = q.device.type
    if spec.device_types is not None and device not in (*spec.device_types, "meta"):
        raise ValueError(
            f"backend {spec.name!r} runs on {'/'.join(spec.device_types)} tensors; got "
            f"{device}. Use backend='reference' on other devices."
        )
    if q.dtype not in spec.dtypes:
        raise ValueError(
            f"backend {spec.name!r} takes {[str(d) for d in spec.dtypes]}; got {q.dtype}"
        )
    if spec.name == "triton" and device == "cpu":
        _triton_device(q)
    spec.limits(q, kv, indices, d_v)
    return spec


# --- the ops ------------------------------------------------------------------------------------


@torch.library.custom_op("prime_rl::sparse_mla", mutates_args=())
def _sparse_mla(
    q: Tensor, kv: Tensor, indices: Tensor, softmax_scale: float, d_v: int, backend: str
) -> tuple[Tensor, Tensor]:
    spec = check_arguments(q, kv, indices, softmax_scale, d_v, backend)
    return spec.forward(q, kv, indices, softmax_scale, d_v)


@_sparse_mla.register_fake
def _(q, kv, indices, softmax_scale, d_v, backend):
    check_arguments(q, kv, indices, softmax_scale, d_v, backend)
    out = q.new_empty(q.shape[0], q.shape[1], d_v)
    return out, q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("prime_rl::sparse_mla_backward", mutates_args=())
def _sparse_mla_backward(
    dout: Tensor,
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    d_v: int,
    backend: str,
) -> tuple[Tensor, Tensor]:
    spec = _check_backward(dout, q, kv, indices, out, lse, softmax_scale, d_v, backend)
    return spec.backward(dout, q, kv, indices, out, lse, softmax_scale, d_v)


def _check_backward(dout, q, kv, indices, out, lse, softmax_scale, d_v, backend):
    """The forward's checks, and the forward's outputs (and their gradient) in its shapes."""
    spec = check_arguments(q, kv, indices, softmax_scale, d_v, backend)
    out_shape = (q.shape[0], q.shape[1], d_v)
    for name, t, shape, dtype in (
        ("dout", dout, out_shape, q.dtype),
        ("out", out, out_shape, q.dtype),
        ("lse", lse, out_shape[:2], torch.float32),
    ):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != q.device:
            raise ValueError(
                f"{name} must be {dtype} {list(shape)} on {q.device} (the forward's), got "
                f"{t.dtype} {list(t.shape)} on {t.device}"
            )
    return spec


@_sparse_mla_backward.register_fake
def _(dout, q, kv, indices, out, lse, softmax_scale, d_v, backend):
    _check_backward(dout, q, kv, indices, out, lse, softmax_scale, d_v, backend)
    return torch.empty_like(q), torch.empty_like(kv)


def _setup_context(ctx, inputs, output):
    q, kv, indices, ctx.softmax_scale, ctx.d_v, ctx.backend = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, indices, out, lse)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, kv, indices, out, lse = ctx.saved_tensors
    dq, dkv = _sparse_mla_backward(
        dout.contiguous(), q, kv, indices, out, lse, ctx.softmax_scale, ctx.d_v, ctx.backend
    )
    return dq, dkv, None, None, None, None


_sparse_mla.register_autograd(_backward, setup_context=_setup_context)


def sparse_mla(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    softmax_scale: float | None = None,
    d_v: int = 512,
    *,
    backend: str = "reference",
) -> tuple[Tensor, Tensor]:
    """Sparse MLA attention; returns ``(out [T, Hq, d_v], lse [T, Hq] fp32)``.

    ``q [T, Hq, Dqk]``, ``kv [S, Hkv, Dqk]`` (MLA's latent plus rope channels; values are
    ``kv[..., :d_v]``), ``indices [T, Hkv, topk]`` int32 naming the KV rows each query attends
    to (negative, e.g. ``-1``, or ``>= S``: none). ``softmax_scale`` defaults to ``Dqk ** -0.5``.
    ``lse`` is the natural-log log-sum-exp, ``-inf`` for a query with no valid index, without
    gradient.

    Example (CPU)::

        q, kv = torch.randn(4, 8, 96), torch.randn(16, 1, 96)
        indices = torch.randint(-1, 16, (4, 1, 6), dtype=torch.int32)
        out, lse = sparse_mla(q, kv, indices, d_v=64)  # out [4, 8, 64], lse [4, 8]
    """
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    return _sparse_mla(q, kv, indices, float(softmax_scale), d_v, backend)
