"""Varlen attention as one opaque operator per backend, under prime-rl's names and schemas.

prime-rl (``src/prime_rl/trainer/models/layers/attn.py``, newest version in the index, see
docs/attention.md) registers ``prime_rl_attn::flash_attn_{2,3,4}_varlen`` and their
``_backward`` ops; prime_ops registers the same names with prime-rl's arguments first, in its
order and types, and its own extras after them, with defaults:

    flash_attn_2_varlen / flash_attn_3_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
        window_size_left: int, window_size_right: int, softcap: float = 0.0) -> (out, lse)
    flash_attn_4_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q: int?, max_seqlen_k: int?, causal: bool,
        window_size_left: int?, window_size_right: int?,
        softmax_scale: float? = None, softcap: float = 0.0) -> (out, lse)
    <op>_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, <the same>) -> (dq, dk, dv)

``prime_rl_attn::sdpa_varlen`` (prime_ops' own, pure PyTorch) takes FA4's schema, so a prime-rl
call swaps kernels by name alone. prime-rl's older 8-argument FA4 call (no max_seqlen) binds to
the overload ``flash_attn_4_varlen.no_max_seqlen``, which forwards to the default overload.

Every op binds its arguments into one :class:`VarlenArgs` bundle, the only form the checks,
fakes and kernels take; one autograd formula serves them all. ``lse`` is natural-log, fp32 (fp64
for fp64 inputs, so float64 checks stay exact), ``-inf`` for rows that see no key. It is
returned for merging partial results (ring attention) and carries no gradient.

q, k and v need a unit stride in the head dim only (prime-rl passes transposed views): the
FlashAttention kernels take the strides as they are; another layout is copied once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from prime_ops.attn import flash, sdpa
from prime_ops.attn.args import VarlenArgs
from prime_ops.attn.seqlens import can_read, spans
from prime_ops.devices import check_same_device

__all__ = [
    "BACKENDS",
    "FA4_SCHEMA",
    "FLASH_SCHEMA",
    "OPS",
    "Backend",
    "Schema",
    "check_arguments",
    "get_backend",
    "head_dim_strided",
    "varlen_attention",
]

_HALF = (torch.float16, torch.bfloat16)
_SYMBOLIC = (torch.SymInt, torch.SymFloat)


@dataclass(frozen=True)
class Schema:
    """One op family's arguments after ``(q, k, v, cu_seqlens_q, cu_seqlens_k)``, in its order,
    as schema text (``"int? max_seqlen_q"``, ``"float softcap=0.0"``)."""

    params: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.split()[1].split("=")[0] for p in self.params)

    def text(self, leading: str, returns: str) -> str:
        tensors = "Tensor cu_seqlens_q, Tensor cu_seqlens_k"
        return f"({leading}, {tensors}, {', '.join(self.params)}) -> {returns}"

    def values(self, a: VarlenArgs) -> tuple:
        """The trailing arguments of a call of this op that computes ``a``."""
        return tuple(getattr(a, name) for name in self.names)

    def bind(self, q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, rest, named) -> VarlenArgs:
        """:class:`VarlenArgs` from an op call (the dispatcher passes omitted defaults as
        absent); None resolves as FA4 reads it: max_seqlen the packed length, scale
        ``head_dim ** -0.5``, window -1."""
        given = dict(zip(self.names, rest, strict=False)) | named
        defaults = {"softmax_scale": None, "softcap": 0.0}
        values = {name: given.get(name, defaults.get(name)) for name in self.names}
        return VarlenArgs(
            cu_q,
            cu_k,
            _tokens(q) if values["max_seqlen_q"] is None else values["max_seqlen_q"],
            _tokens(k) if values["max_seqlen_k"] is None else values["max_seqlen_k"],
            values["causal"],
            _default_scale(q) if values["softmax_scale"] is None else values["softmax_scale"],
            _unbounded(values["window_size_left"]),
            _unbounded(values["window_size_right"]),
            values["softcap"],
        )


# prime-rl's FA2/FA3 ops: a float scale before causal, int windows (-1 unbounded).
FLASH_SCHEMA = Schema(
    (
        "int max_seqlen_q",
        "int max_seqlen_k",
        "float softmax_scale",
        "bool causal",
        "int window_size_left",
        "int window_size_right",
        "float softcap=0.0",
    )
)
# prime-rl's FA4 op: optional max_seqlen and windows (None unbounded), no scale; prime_ops'
# scale and softcap follow with defaults.
FA4_SCHEMA = Schema(
    (
        "int? max_seqlen_q",
        "int? max_seqlen_k",
        "bool causal",
        "int? window_size_left",
        "int? window_size_right",
        "float? softmax_scale=None",
        "float softcap=0.0",
    )
)


def _default_scale(q: Tensor) -> float:
    return q.shape[-1] ** -0.5 if q.dim() and q.shape[-1] > 0 else 1.0  # refused later


def _tokens(t: Tensor) -> int:
    return t.shape[0] if t.dim() else 0  # a 0-d tensor is refused later


def _unbounded(size: int | None) -> int:
    return -1 if size is None else size


def head_dim_strided(t: Tensor) -> Tensor:
    """``t`` itself where its last dim has unit stride (any other strides are passed on to the
    kernels), else one contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _no_limits(head_dim: int, head_dim_v: int, arch: int | None, backward: bool) -> None:
    pass


@dataclass(frozen=True)
class Backend:
    """A kernel pair behind the contract, and what it accepts (checked before any launch)."""

    name: str  # the front's ``backend=`` value
    op: str  # operator name in ``prime_rl_attn``, without ``_varlen``
    schema: Schema
    device_types: tuple[str, ...] | None  # None: any device
    dtypes: tuple[torch.dtype, ...]
    # (head_dim, head_dim_v, cuda arch or None, backward) -> raise ValueError
    limits: Callable[[int, int, int | None, bool], None]
    forward: Callable[[Tensor, Tensor, Tensor, VarlenArgs], tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "sdpa",
            "sdpa",
            FA4_SCHEMA,
            None,
            (*_HALF, torch.float32, torch.float64),
            _no_limits,
            sdpa.forward,
            sdpa.backward,
        ),
        Backend(
            "fa2",
            "flash_attn_2",
            FLASH_SCHEMA,
            ("cuda",),
            _HALF,
            flash.fa2_head_dims,
            flash.fa2_forward,
            flash.fa2_backward,
        ),
        Backend(
            "fa3",
            "flash_attn_3",
            FLASH_SCHEMA,
            ("cuda",),
            _HALF,
            flash.fa3_head_dims,
            flash.fa3_forward,
            flash.fa3_backward,
        ),
        Backend(
            "fa4",
            "flash_attn_4",
            FA4_SCHEMA,
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
    except (KeyError, TypeError):
        raise ValueError(
            f"backend={name!r} is not an attention backend; choose one of {sorted(BACKENDS)}"
        ) from None


def _check_types(q, k, v, a: VarlenArgs) -> None:
    """TypeError for a value of the wrong kind, before anything reads a shape."""
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": a.cu_seqlens_q}
    tensors["cu_seqlens_k"] = a.cu_seqlens_k
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("max_seqlen_q", "max_seqlen_k", "window_size_left", "window_size_right"):
        value = getattr(a, name)  # symbolic while tracing with dynamic shapes
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int (or None), got {value!r}")
    for name in ("softmax_scale", "softcap"):
        value = getattr(a, name)
        if isinstance(value, bool) or not isinstance(value, (int, float, *_SYMBOLIC)):
            raise TypeError(f"{name} must be a float, got {value!r}")
    if not isinstance(a.causal, bool):
        raise TypeError(f"causal must be a bool, got {a.causal!r}")


def check_arguments(
    backend: Backend,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: VarlenArgs,
    *,
    grads: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Raise TypeError/ValueError for anything the kernel would reject or silently get wrong
    (metadata only).

    Runs in the kernels and the fakes alike, so a bad call fails while tracing, before a launch.
    ``grads`` is ``(dout, out, lse)`` for the backward, which checks them and the backward's own
    head-dim limits too.
    """
    _check_types(q, k, v, a)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be [tokens, heads, head_dim]; got shape {tuple(t.shape)}"
            )
        if t.shape[1] < 1 or t.shape[2] < 1:
            raise ValueError(
                f"{name} needs at least one head and a head dim >= 1; got shape {tuple(t.shape)}"
            )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in tokens and heads; got {k.shape} and {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim; got {q.shape[2]} and {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q's heads ({q.shape[1]}) must be a multiple of k/v's heads ({k.shape[1]}) (GQA)"
        )
    named = {"q": q, "k": k, "v": v, "cu_seqlens_q": a.cu_seqlens_q}
    named["cu_seqlens_k"] = a.cu_seqlens_k
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
    for name, cu in (("cu_seqlens_q", a.cu_seqlens_q), ("cu_seqlens_k", a.cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor of batch + 1 offsets; got {cu.dtype} "
                f"of shape {tuple(cu.shape)}"
            )
    if a.cu_seqlens_q.numel() != a.cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences; got "
            f"{a.cu_seqlens_q.numel()} and {a.cu_seqlens_k.numel()} offsets"
        )
    if a.max_seqlen_q < 0 or a.max_seqlen_k < 0:
        raise ValueError(
            f"max_seqlen_q/k must be >= 0 (or None: the packed length); got {a.max_seqlen_q}, "
            f"{a.max_seqlen_k}"
        )
    if a.window_size_left < -1 or a.window_size_right < -1:
        raise ValueError(
            f"window_size entries must be >= -1 (-1 or None: unbounded); got "
            f"({a.window_size_left}, {a.window_size_right})"
        )
    if not 0.0 <= a.softcap < math.inf:  # inf would cap nothing and give NaN (inf * tanh(0))
        raise ValueError(f"softcap must be finite and >= 0 (0: off); got {a.softcap}")
    if not math.isfinite(a.softmax_scale):
        raise ValueError(f"softmax_scale must be finite; got {a.softmax_scale}")
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
    arch = flash.cuda_arch(q.device)
    backend.limits(q.shape[2], v.shape[2], arch, grads is not None)
    if grads is not None and backend.name == "fa4":  # FA4's one limit that is not a head dim
        flash.fa4_softcap(q.shape[2], v.shape[2], arch, a.softcap)


def _empty_outputs(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A fake's ``(out [T, H, Dv], lse [H, T])`` for the queries ``q`` and values ``v``."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return out, q.new_empty(q.shape[1], q.shape[0], dtype=sdpa.lse_dtype(q.dtype))


def _register_autograd(forward_op, backward_op, num_offsets: int = 2) -> None:
    """Autograd for ``forward_op(q, k, v, *offsets, *rest) -> (out, lse)`` through
    ``backward_op(dout, q, k, v, out, lse, *offsets, *rest)``: the first ``num_offsets``
    arguments after ``v`` are tensors to save, the rest (sizes, flags, names) are kept as given."""

    def setup_context(ctx, inputs, output):
        q, k, v, *rest = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, *rest[:num_offsets])
        ctx.rest = rest[num_offsets:]
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *offsets = ctx.saved_tensors
        dq, dk, dv = backward_op(dout.contiguous(), q, k, v, out, lse, *offsets, *ctx.rest)
        return (dq, dk, dv) + (None,) * (len(offsets) + len(ctx.rest))

    forward_op.register_autograd(backward, setup_context=setup_context)


def _define(backend: Backend):
    """Register ``prime_rl_attn::{op}_varlen`` and its ``_backward`` with fakes and autograd,
    under the backend's :class:`Schema`.

    Kernels and fakes look their backend up in :data:`BACKENDS` when called, so the registry
    stays the one place that says what runs and where (tests swap in counting kernels, or CPU
    runs of the adapters over stand-in libraries). The ops are registered for every device;
    :func:`check_arguments` refuses the devices a backend does not run on with a clear error.
    """
    name = f"prime_rl_attn::{backend.op}_varlen"
    schema = backend.schema
    qkv = "Tensor q, Tensor k, Tensor v"

    def forward_kernel(q, k, v, cu_q, cu_k, *rest, **named):
        spec = BACKENDS[backend.name]
        a = schema.bind(q, k, cu_q, cu_k, rest, named)
        check_arguments(spec, q, k, v, a)
        return spec.forward(*map(head_dim_strided, (q, k, v)), a)

    forward_op = torch.library.custom_op(
        name,
        forward_kernel,
        mutates_args=(),
        schema=schema.text(qkv, "(Tensor, Tensor)"),
    )

    @forward_op.register_fake
    def _(q, k, v, cu_q, cu_k, *rest, **named):
        check_arguments(BACKENDS[backend.name], q, k, v, schema.bind(q, k, cu_q, cu_k, rest, named))
        return _empty_outputs(q, v)

    def backward_kernel(dout, q, k, v, out, lse, cu_q, cu_k, *rest, **named):
        spec = BACKENDS[backend.name]
        a = schema.bind(q, k, cu_q, cu_k, rest, named)
        check_arguments(spec, q, k, v, a, grads=(dout, out, lse))
        tensors = map(head_dim_strided, (dout, q, k, v, out))
        return spec.backward(*tensors, lse, a)

    backward_op = torch.library.custom_op(
        f"{name}_backward",
        backward_kernel,
        mutates_args=(),
        schema=schema.text(
            "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse",
            "(Tensor, Tensor, Tensor)",
        ),
    )

    @backward_op.register_fake
    def _(dout, q, k, v, out, lse, cu_q, cu_k, *rest, **named):
        a = schema.bind(q, k, cu_q, cu_k, rest, named)
        check_arguments(BACKENDS[backend.name], q, k, v, a, grads=(dout, out, lse))
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    _register_autograd(forward_op, backward_op)
    return forward_op, backward_op


OPS = {name: _define(backend) for name, backend in BACKENDS.items()}


def _define_fa4_without_max_seqlen() -> None:
    """prime-rl's older FA4 schema ``(q, k, v, cu_seqlens_q, cu_seqlens_k, causal,
    window_size_left, window_size_right)``, as the overload ``no_max_seqlen``: it forwards to the
    default overload (whose fake and autograd then apply), so policies and traces see that one.
    A call binds to it only with exactly these 8 arguments (the default overload needs 10).

    ``causal`` is a ``Scalar`` here, not a ``bool``: torch turns any int into a bool, so the
    current order with the windows left out, ``(..., max_seqlen_q, max_seqlen_k, causal)``,
    would bind here as causal=True with window (max_seqlen_k, causal). Keeping the int lets that
    call raise instead."""
    name = "prime_rl_attn::flash_attn_4_varlen.no_max_seqlen"
    torch.library.define(
        name,
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Scalar causal, "
        "int? window_size_left, int? window_size_right) -> (Tensor, Tensor)",
    )

    @torch.library.impl(name, "CompositeImplicitAutograd")
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_size_left, window_size_right):
        if not isinstance(causal, bool):
            raise TypeError(
                f"prime_rl_attn::flash_attn_4_varlen got {causal!r} where a bool causal belongs "
                "in its 8-argument call (q, k, v, cu_seqlens_q, cu_seqlens_k, causal, "
                "window_size_left, window_size_right). The current call takes 10: (q, k, v, "
                "cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, "
                "window_size_left, window_size_right); pass both windows (None: unbounded)"
            )
        windows = (window_size_left, window_size_right)
        full = torch.ops.prime_rl_attn.flash_attn_4_varlen.default
        return full(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, causal, *windows)


_define_fa4_without_max_seqlen()


def _window(window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(
            f"window_size must be a pair (left, right) of ints, -1 or None for unbounded; got "
            f"{window_size!r}"
        )
    left, right = window_size
    return _unbounded(left), _unbounded(right)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    backend: str = "sdpa",
    check_cu_seqlens: bool = True,
) -> tuple[Tensor, Tensor]:
    """Attention over packed variable-length sequences; returns ``(out, lse)``.

    q ``[T, H, D]``, k/v ``[Tk, Hkv, D|Dv]`` (``H`` a multiple of ``Hkv``), int32 ``cu_seqlens``
    of batch + 1 offsets. ``max_seqlen_*`` bound the sequence lengths; None (as prime-rl passes
    to FA4) means the packed length, which needs no host read but sizes the flash kernels' grids
    for it. Queries align to the end of their keys (FlashAttention convention);
    ``window_size=(left, right)`` limits keys to ``[i - left, i + right]``, -1 or None unbounded;
    ``causal`` caps ``right`` at 0. ``softmax_scale`` defaults to ``D ** -0.5``; ``softcap > 0``
    applies ``softcap * tanh(s / softcap)`` to scores. ``lse`` is ``[H, T]``, fp32 (fp64 for
    fp64 inputs), ``-inf`` where a row sees no key, and carries no gradient. ``backend`` picks
    the operator: ``"sdpa"`` (``prime_rl_attn::sdpa_varlen``), ``"fa2"`` / ``"fa3"`` / ``"fa4"``
    (``prime_rl_attn::flash_attn_{2,3,4}_varlen``).

    q, k and v may be views with any strides whose head dim is contiguous (``x.transpose(0, 1)``
    of a ``[H, T, D]`` tensor): the flash kernels read them in place. Other layouts are copied
    once, which costs one tensor of the same size.

    Example::

        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        q, k, v = (torch.randn(7, 4, 16) for _ in range(3))
        out, lse = varlen_attention(q, k, v, cu, cu, 4, 4, causal=True)

    ``check_cu_seqlens`` reads the offsets on the host (one sync) to validate them in eager mode;
    it is skipped while compiling.
    """
    spec = get_backend(backend)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    left, right = _window(window_size)
    a = VarlenArgs(
        cu_seqlens_q,
        cu_seqlens_k,
        _tokens(q) if max_seqlen_q is None else max_seqlen_q,
        _tokens(k) if max_seqlen_k is None else max_seqlen_k,
        causal,
        _default_scale(q) if softmax_scale is None else softmax_scale,
        left,
        right,
        softcap,
    )
    _check_types(q, k, v, a)
    a = a._replace(softmax_scale=float(a.softmax_scale), softcap=float(a.softcap))
    if check_cu_seqlens and can_read(cu_seqlens_q):
        check_arguments(spec, q, k, v, a)
        spans(cu_seqlens_q, q.shape[0], a.max_seqlen_q, "cu_seqlens_q")
        spans(cu_seqlens_k, k.shape[0], a.max_seqlen_k, "cu_seqlens_k")
    forward_op, _ = OPS[spec.name]
    return forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, *spec.schema.values(a))
