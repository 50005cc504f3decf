"""Varlen attention as one opaque operator per backend, named as in prime-rl:
``prime_rl_attn::sdpa_varlen`` and ``prime_rl_attn::flash_attn_{2,3,4}_varlen``.

Every backend shares one schema, one fake and one autograd formula, so torch.compile traces,
autograd differentiates and checkpoint policies match the same operator whatever kernel runs:

    <op>(q [T, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], cu_seqlens_q, cu_seqlens_k,
         max_seqlen_q, max_seqlen_k, causal, softmax_scale,
         window_size_left, window_size_right, softcap) -> (out [T, H, Dv], lse [H, T])
    <op>_backward(dout, q, k, v, out, lse, cu_seqlens_q, ...) -> (dq, dk, dv)

``lse`` is natural-log, fp32 (fp64 for fp64 inputs, so float64 checks stay exact), ``-inf``
for rows that see no key. It is returned for merging partial results (ring attention) and
carries no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from prime_ops.attn import flash, sdpa
from prime_ops.attn.seqlens import can_read, spans
from prime_ops.devices import check_same_device

__all__ = ["BACKENDS", "OPS", "Backend", "check_arguments", "get_backend", "varlen_attention"]

_HALF = (torch.float16, torch.bfloat16)


def _no_limits(head_dim: int, head_dim_v: int, arch: int | None, backward: bool) -> None:
    pass


@dataclass(frozen=True)
class Backend:
    """A kernel pair behind the contract, and what it accepts (checked before any launch)."""

    name: str  # the front's ``backend=`` value
    op: str  # operator name in ``prime_rl_attn``, without ``_varlen``
    device_types: tuple[str, ...] | None  # None: any device
    dtypes: tuple[torch.dtype, ...]
    # (head_dim, head_dim_v, cuda arch or None, backward) -> raise ValueError
    limits: Callable[[int, int, int | None, bool], None]
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "sdpa",
            "sdpa",
            None,
            (*_HALF, torch.float32, torch.float64),
            _no_limits,
            sdpa.forward,
            sdpa.backward,
        ),
        Backend(
            "fa2",
            "flash_attn_2",
            ("cuda",),
            _HALF,
            flash.fa2_head_dims,
            flash.fa2_forward,
            flash.fa2_backward,
        ),
        Backend(
            "fa3",
            "flash_attn_3",
            ("cuda",),
            _HALF,
            flash.fa3_head_dims,
            flash.fa3_forward,
            flash.fa3_backward,
        ),
        Backend(
            "fa4",
            "flash_attn_4",
            ("cuda",),
            _HALF,
            flash.fa4_head_dims,
            flash.fa4_forward,
            flash.fa4_backward,
        ),
    )
}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"backend={name!r} is not an attention backend; choose one of {sorted(BACKENDS)}"
        ) from None


def check_arguments(
    backend: Backend,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    *,
    grads: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Raise ValueError for anything the kernel would reject or silently get wrong (metadata only).

    Runs in the kernels and the fakes alike, so a bad call fails while tracing, before a launch.
    ``grads`` is ``(dout, out, lse)`` for the backward, which checks them and the backward's own
    head-dim limits too.
    """
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be [tokens, heads, head_dim]; got shape {tuple(t.shape)}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; call {name}.contiguous() first")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in tokens and heads; got {k.shape} and {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim; got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q's heads ({q.shape[1]}) must be a multiple of k/v's heads ({k.shape[1]}) (GQA)"
        )
    named = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    if grads is not None:
        named.update(zip(("dout", "out", "lse"), grads, strict=True))
    check_same_device(f"prime_rl_attn::{backend.op}_varlen", **named)
    device = q.device.type
    if backend.device_types is not None and device not in (*backend.device_types, "meta"):
        raise ValueError(
            f"backend {backend.name!r} runs on {'/'.join(backend.device_types)} tensors; got "
            f"{device}. Use backend='sdpa' on other devices."
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in backend.dtypes:
        raise ValueError(
            f"backend {backend.name!r} takes {[str(d) for d in backend.dtypes]}; got {q.dtype}"
        )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor of batch + 1 offsets; got {cu.dtype} "
                f"of shape {tuple(cu.shape)}"
            )
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences; got "
            f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()} offsets"
        )
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_q/k must be >= 0; got {max_seqlen_q}, {max_seqlen_k}")
    if window_size_left < -1 or window_size_right < -1:
        raise ValueError(
            f"window_size entries must be >= -1 (-1: unbounded); got "
            f"({window_size_left}, {window_size_right})"
        )
    if not 0.0 <= softcap < math.inf:  # inf would cap nothing and give NaN (inf * tanh(0))
        raise ValueError(f"softcap must be finite and >= 0 (0: off); got {softcap}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale}")
    if grads is not None:
        dout, out, lse = grads
        out_shape = (q.shape[0], q.shape[1], v.shape[2])
        for name, t in (("dout", dout), ("out", out)):
            if tuple(t.shape) != out_shape:
                raise ValueError(f"{name} must have shape {out_shape}; got {tuple(t.shape)}")
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise ValueError(
                f"lse must have shape {(q.shape[1], q.shape[0])}; got {tuple(lse.shape)}"
            )
    backend.limits(q.shape[2], v.shape[2], flash.cuda_arch(q.device), grads is not None)


def _define(backend: Backend):
    """Register ``prime_rl_attn::{op}_varlen`` and its ``_backward`` with fakes and autograd.

    Kernels and fakes look their backend up in :data:`BACKENDS` when called, so the registry
    stays the one place that says what runs and where (tests swap in counting kernels, or CPU
    runs of the adapters over stand-in libraries). The ops are registered for every device;
    :func:`check_arguments` refuses the devices a backend does not run on with a clear error.
    """
    name = f"prime_rl_attn::{backend.op}_varlen"

    @torch.library.custom_op(name, mutates_args=())
    def forward_op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        softmax_scale: float,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
    ) -> tuple[Tensor, Tensor]:
        args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        window = (softmax_scale, window_size_left, window_size_right, softcap)
        spec = BACKENDS[backend.name]
        check_arguments(spec, q, k, v, *args, *window)
        return spec.forward(q, k, v, *args, causal, *window)

    @forward_op.register_fake
    def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap):
        spec = BACKENDS[backend.name]
        check_arguments(spec, q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, softcap)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        return out, q.new_empty(q.shape[1], q.shape[0], dtype=sdpa.lse_dtype(q.dtype))

    @torch.library.custom_op(f"{name}_backward", mutates_args=())
    def backward_op(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        softmax_scale: float,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        window = (softmax_scale, window_size_left, window_size_right, softcap)
        spec = BACKENDS[backend.name]
        check_arguments(spec, q, k, v, *args, *window, grads=(dout, out, lse))
        return spec.backward(dout, q, k, v, out, lse, *args, causal, *window)

    @backward_op.register_fake
    def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, left, right, cap):
        spec = BACKENDS[backend.name]
        window = (scale, left, right, cap)
        check_arguments(spec, q, k, v, cu_q, cu_k, max_q, max_k, *window, grads=(dout, out, lse))
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens_q, cu_seqlens_k, *rest = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.rest = rest
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = backward_op(
            dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.rest
        )
        return (dq, dk, dv) + (None,) * 9

    forward_op.register_autograd(backward, setup_context=setup_context)
    return forward_op, backward_op


OPS = {name: _define(backend) for name, backend in BACKENDS.items()}


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    backend: str = "sdpa",
    check_cu_seqlens: bool = True,
) -> tuple[Tensor, Tensor]:
    """Attention over packed variable-length sequences; returns ``(out, lse)``.

    q ``[T, H, D]``, k/v ``[Tk, Hkv, D|Dv]`` (``H`` a multiple of ``Hkv``), int32 ``cu_seqlens``
    of batch + 1 offsets. Queries align to the end of their keys (FlashAttention convention);
    ``window_size=(left, right)`` limits keys to ``[i - left, i + right]``, -1 unbounded;
    ``causal`` caps ``right`` at 0. ``softmax_scale`` defaults to ``D ** -0.5``; ``softcap > 0``
    applies ``softcap * tanh(s / softcap)`` to scores. ``lse`` is ``[H, T]``, fp32 (fp64 for
    fp64 inputs), ``-inf`` where a row sees no key, and carries no gradient. ``backend`` picks
    the operator: ``"sdpa"`` (``prime_rl_attn::sdpa_varlen``), ``"fa2"`` / ``"fa3"`` / ``"fa4"``
    (``prime_rl_attn::flash_attn_{2,3,4}_varlen``).

    Example::

        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        q, k, v = (torch.randn(7, 4, 16) for _ in range(3))
        out, lse = varlen_attention(q, k, v, cu, cu, 4, 4, causal=True)

    ``check_cu_seqlens`` reads the offsets on the host (one sync) to validate them in eager mode;
    it is skipped while compiling.
    """
    spec = get_backend(backend)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    left, right = window_size
    if check_cu_seqlens and can_read(cu_seqlens_q):
        check_arguments(
            spec,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            left,
            right,
            softcap,
        )
        spans(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        spans(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    forward_op, _ = OPS[spec.name]
    return forward_op(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        float(softmax_scale),
        left,
        right,
        float(softcap),
    )
