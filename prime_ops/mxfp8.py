"""MXFP8 transport for expert parallelism: quantised all-to-alls as ``prime_rl_collectives`` ops.

MXFP8 (OCP Microscaling spec v1.0) stores ``float8_e4m3fn`` elements with one E8M0 scale (a
power of two, ``float8_e8m0fnu``) per 32 consecutive elements of the last dim. A token row of
``H`` channels travels as ``H + H / 32`` bytes instead of ``2 H`` in bf16: 0.52x the traffic.

    prime_rl_collectives::mxfp8_all_to_all_single(x, output_splits, input_splits, group_name,
        quantize_grad, scale_rule, quantizer) -> Tensor   (x's dtype, dequantised)

and prime-rl's op (``src/prime_rl/trainer/distributed/collectives.py`` @ 3be02f75c7b9), whose
backward sends in the other wire format than its forward:

    prime_rl_collectives::mxfp8_all_to_all(x, output_splits, input_splits, group_name, quantized,
        scale_rule="rceil", quantizer="torch") -> Tensor   (x's dtype)

with prime-rl's fronts :func:`mxfp8_all_to_all_dispatch` (``quantized=True``: MXFP8 forward,
full-precision gradient) and :func:`mxfp8_all_to_all_combine` (the reverse).

The sending rank quantises ``x`` (rows along dim 0, as :func:`prime_ops.collectives.
all_to_all_single`), packs elements and scales of each row into one uint8 row, exchanges them
with ``prime_rl_collectives::all_to_all_single`` and dequantises what it receives. The backward
treats quantisation as the identity (straight-through) and sends the gradient back through the
adjoint exchange: in full precision by default, or as MXFP8 too with ``quantize_grad=True``.

Scale rules (``scale_rule``), for a block with largest magnitude ``amax``:

- ``"rceil"`` (default; NVIDIA's conversion and torchao's expert-parallel default):
  ``scale = 2 ** ceil(log2(amax / 448))``, so no element saturates.
- ``"floor"`` (the OCP spec's reference conversion): ``scale = 2 ** (floor(log2(amax)) - 8)``;
  elements above 448 times the scale saturate to +-448.

``quantizer`` picks the kernel: ``"torch"`` (plain PyTorch, any device; the reference) or
``"torchao"`` (torchao's Triton MX cast: bf16 on CUDA devices of compute capability 10.0 or newer
with CUDA 12.8+, or ROCm MI350; ``pip install 'prime-ops[mxfp8]'``). torchao 0.16 to 0.18 define
the cast only there (``torchao/prototype/mx_formats/kernels.py``; elsewhere the name raises
"needs triton"), so on Hopper and older the call raises before any exchange and names
``"torch"``, which runs on every device.

The op holds no state: quantising is deterministic, nothing is cached between calls and no
buffer outlives a call, so a replay under full activation checkpointing recomputes the same
result with the same exchange, like every other op of the namespace. It is therefore not in the
mandatory set; selective checkpointing keeps it through the ``prime_rl_collectives`` target.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from prime_ops.backends import import_backend
from prime_ops.collectives import (
    _all_to_all_sizes,
    _as_splits,
    _check_sendable,
    _check_tensor,
    _run_checks,
    _where,
)
from prime_ops.groups import Fingerprint, rank_local, resolve_call, resolve_name

__all__ = [
    "BLOCK",
    "ELEMENT_DTYPE",
    "SCALE_DTYPE",
    "dequantize_mx",
    "mxfp8_all_to_all_combine",
    "mxfp8_all_to_all_dispatch",
    "mxfp8_all_to_all_single",
    "quantize_mx",
]

BLOCK = 32
ELEMENT_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float8_e8m0fnu
_E4M3_MAX = 448.0
_E4M3_EMAX = 8  # largest power of two below 448
_E8M0_BIAS = 127
_E8M0_NAN = 255
_RULES = ("rceil", "floor")
_QUANTIZERS = ("torch", "torchao")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --- quantisation -------------------------------------------------------------------------------


def _check_quantizable(x: Tensor, scale_rule: str) -> None:
    if scale_rule not in _RULES:
        raise ValueError(f"scale_rule must be one of {_RULES}; got {scale_rule!r}")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ValueError(
            f"MXFP8 scales blocks of {BLOCK} elements along the last dim, so x.shape[-1] must be "
            f"a multiple of {BLOCK}; got shape {tuple(x.shape)} (pad the hidden dim)"
        )
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be one of {[str(d) for d in _DTYPES]}; got {x.dtype}")


def _block_exponent(amax: Tensor, scale_rule: str) -> Tensor:
    """Unbiased int32 scale exponent per block, clamped to E8M0's range [-127, 127]."""
    if scale_rule == "rceil":
        # amax / 448 rounded up to a power of two; multiplying by the rounded reciprocal is
        # what torchao's cast does (and decides the rare tie the same way).
        descale = amax * (1.0 / _E4M3_MAX)
        mantissa, exponent = torch.frexp(descale)  # descale = mantissa * 2**exponent
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
        exponent = torch.where(descale == 0, -_E8M0_BIAS, exponent)
    else:
        _, exponent = torch.frexp(amax)  # floor(log2(amax)) = exponent - 1
        exponent = torch.where(amax == 0, -_E8M0_BIAS, exponent - 1 - _E4M3_EMAX)
    return exponent.clamp(-_E8M0_BIAS, _E8M0_BIAS)


def _e8m0(biased: Tensor) -> Tensor:
    return biased.to(torch.uint8).view(SCALE_DTYPE)


def quantize_mx(x: Tensor, scale_rule: str = "rceil") -> tuple[Tensor, Tensor]:
    """Quantise ``x`` to MXFP8: ``(elements float8_e4m3fn [..., H], scales float8_e8m0fnu
    [..., H / 32])`` with one power-of-two scale per 32 elements of the last dim.

    A block holding NaN or inf gets the E8M0 NaN scale (its values dequantise to NaN).

    Example::

        data, scale = quantize_mx(torch.randn(4, 64))
        dequantize_mx(data, scale, torch.float32)  # within 2**-4 relative (plus subnormals)
    """
    _check_quantizable(x, scale_rule)
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True)
    biased = _block_exponent(amax, scale_rule) + _E8M0_BIAS
    biased = torch.where(torch.isfinite(amax), biased, _E8M0_NAN)
    # 2**-exponent, exactly: the E8M0 value whose biased exponent mirrors ours around the bias.
    reciprocal = _e8m0((2 * _E8M0_BIAS - biased) & 0xFF).float()
    data = (blocks * reciprocal).clamp(-_E4M3_MAX, _E4M3_MAX).to(ELEMENT_DTYPE)
    return data.flatten(-2), _e8m0(biased).squeeze(-1)


def dequantize_mx(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Invert :func:`quantize_mx`: ``element * scale`` (exact in fp32), cast to ``dtype``."""
    blocks = data.float().unflatten(-1, (-1, BLOCK))
    return (blocks * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def _torchao_quantize(x: Tensor, scale_rule: str) -> tuple[Tensor, Tensor]:
    kernels = import_backend("torchao.prototype.mx_formats.kernels", extra="mxfp8")
    data, scale = kernels.triton_to_mxfp8_dim0(
        x.contiguous(), inner_block_size=BLOCK, scaling_mode=scale_rule
    )
    return data, scale.view(SCALE_DTYPE)


def _installed_torchao() -> tuple[int, int] | None:
    """torchao's (major, minor), read without importing it; None if it is not installed."""
    try:
        release = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match[1]), int(match[2])) if match else None


def _torchao_cast_missing(device: torch.device) -> str | None:
    """Why torchao has no MX cast on ``device`` (its import-time gate: SM100+ with CUDA 12.8+,
    or MI350 from 0.17 on), or None where it has one or where the device cannot be known (fake
    tensors traced without CUDA)."""
    if not torch.cuda.is_available():
        return None
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if "gfx950" not in arch:
            return f"ROCm {arch} (torchao needs MI350, gfx950)"
        version = _installed_torchao()
        if version is not None and version < (0, 17):
            return f"MI350 with torchao {'.'.join(map(str, version))} (MI350: torchao 0.17+)"
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major < 10:
        return f"SM{major}{minor} (torchao needs SM100 or newer)"
    version = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if version < (12, 8):
        return f"CUDA {torch.version.cuda} (torchao needs CUDA 12.8 or newer)"
    return None


def _check_quantizer(x: Tensor, quantizer: str) -> None:
    if quantizer not in _QUANTIZERS:
        raise ValueError(f"quantizer must be one of {_QUANTIZERS}; got {quantizer!r}")
    if quantizer != "torchao":
        return
    if x.device.type not in ("cuda", "meta") or x.dtype != torch.bfloat16:
        raise ValueError(
            f"quantizer='torchao' casts bf16 CUDA tensors; got {x.dtype} on {x.device.type}. "
            "Use quantizer='torch' for other dtypes and devices."
        )
    missing = _torchao_cast_missing(x.device) if x.device.type == "cuda" else None
    if missing is not None:
        raise ValueError(
            f"quantizer='torchao': torchao defines its MXFP8 cast (triton_to_mxfp8_dim0) only on "
            f"SM100+ with CUDA 12.8+ or ROCm MI350, and this device is {missing}. Use "
            "quantizer='torch' here (the reference cast, on any device)."
        )


# --- the transport op ---------------------------------------------------------------------------

_NAMESPACE = "prime_rl_collectives"


def _pack(x: Tensor, scale_rule: str, quantizer: str) -> Tensor:
    """``[N, ...]`` -> uint8 ``[N, M + M / 32]``: each row's elements, then its scales."""
    rows = x.reshape(x.shape[0], _row_width(x))
    if quantizer == "torchao":
        data, scale = _torchao_quantize(rows, scale_rule)
    else:
        data, scale = quantize_mx(rows, scale_rule)
    return torch.cat([data.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def _unpack(wire: Tensor, like: Tensor) -> Tensor:
    width = _row_width(like)
    data = wire[:, :width].contiguous().view(ELEMENT_DTYPE)
    scale = wire[:, width:].contiguous().view(SCALE_DTYPE)
    out = dequantize_mx(data, scale, like.dtype)
    return out.view(wire.shape[0], *like.shape[1:])


def _row_width(x: Tensor) -> int:
    width = 1
    for size in x.shape[1:]:
        width *= size
    return width


def _exchange_quantized(x, output_splits, input_splits, group_name, scale_rule, quantizer):
    """The quantised exchange of both ops: rows travel as MXFP8 bytes, arrive in ``x.dtype``."""
    wire = _pack(x, scale_rule, quantizer)
    received = torch.ops.prime_rl_collectives.all_to_all_single(
        wire, output_splits, input_splits, group_name
    )
    return _unpack(received, x)


def _check(x: Tensor, scale_rule: str, quantizer: str, op: str = "mxfp8_all_to_all_single"):
    _check_tensor(x, op)
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be [rows, ..., hidden]; got shape {tuple(x.shape)}")
    _check_quantizable(x, scale_rule)
    _check_quantizer(x, quantizer)


@torch.library.custom_op(f"{_NAMESPACE}::mxfp8_all_to_all_single", mutates_args=())
def _mxfp8_all_to_all_single(
    x: Tensor,
    output_splits: Tensor,
    input_splits: Tensor,
    group_name: str,
    quantize_grad: bool,
    scale_rule: str,
    quantizer: str,
) -> Tensor:
    """Quantise rows of ``x``, all-to-all them as bytes, dequantise to ``x.dtype``."""
    with rank_local("mxfp8_all_to_all_single", resolve_name(group_name, "mxfp8_all_to_all_single")):
        _check(x, scale_rule, quantizer)
    return _exchange_quantized(x, output_splits, input_splits, group_name, scale_rule, quantizer)


@_mxfp8_all_to_all_single.register_fake
def _(x, output_splits, input_splits, group_name, quantize_grad, scale_rule, quantizer):
    _check(x, scale_rule, quantizer)
    wire = x.new_empty((x.shape[0], _row_width(x) * (BLOCK + 1) // BLOCK), dtype=torch.uint8)
    # The plain all-to-all's fake checks the splits and gives the run-time row count.
    received = torch.ops.prime_rl_collectives.all_to_all_single(
        wire, output_splits, input_splits, group_name
    )
    return x.new_empty((received.shape[0], *x.shape[1:]))


def _setup(ctx, inputs, output):
    """Both ops' setup_context: their backward exchanges back (splits swapped), same options."""
    x, output_splits, input_splits, *options = inputs
    ctx.rows = x.shape[0]
    ctx.options = tuple(options)
    ctx.save_for_backward(output_splits, input_splits)


def _backward(ctx, grad):
    output_splits, input_splits = ctx.saved_tensors
    group_name, quantize_grad, scale_rule, quantizer = ctx.options
    # Straight-through: the adjoint exchange sends each gradient row back to where it came from.
    if quantize_grad:
        grad_x = _mxfp8_all_to_all_single(
            grad.contiguous(), input_splits, output_splits, *ctx.options
        )
    else:
        grad_x = torch.ops.prime_rl_collectives.all_to_all_single(
            grad.contiguous(), input_splits, output_splits, group_name
        )
    torch._check(grad_x.shape[0] == ctx.rows)
    return grad_x, None, None, None, None, None, None


_mxfp8_all_to_all_single.register_autograd(_backward, setup_context=_setup)


def mxfp8_all_to_all_single(
    x: Tensor,
    output_splits: Tensor | Sequence[int],
    input_splits: Tensor | Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    quantize_grad: bool = False,
    scale_rule: str = "rceil",
    quantizer: str = "torch",
) -> Tensor:
    """:func:`prime_ops.collectives.all_to_all_single` that sends rows as MXFP8.

    ``x [N, ..., H]`` (bf16, fp16 or fp32; ``H`` a multiple of 32) is quantised with one E8M0
    scale per 32 elements, exchanged as ``H + H / 32`` bytes per row and returned dequantised in
    ``x.dtype``. The gradient goes back through the adjoint exchange, in full precision unless
    ``quantize_grad``. ``group=None`` is the default process group.

    Example (2 ranks, each sends 1 row to rank 0 and 2 to rank 1)::

        out = mxfp8_all_to_all_single(torch.randn(3, 64), [1, 1], [1, 2])  # rank 0: [2, 64]
    """
    options = {
        "quantize_grad": bool(quantize_grad),
        "scale_rule": scale_rule,
        "quantizer": quantizer,
    }
    group, *splits = _front("mxfp8_all_to_all_single", x, output_splits, input_splits, group,
                            options)  # fmt: skip
    return _mxfp8_all_to_all_single(
        x, *splits, group.group_name, quantize_grad, scale_rule, quantizer
    )


# --- prime-rl's op: mxfp8_all_to_all(..., quantized) --------------------------------------------


def _check_quantized(quantized) -> None:
    # The schema says ``bool?`` (prime-rl's says ``bool``): a ``bool`` argument turns None into
    # False before Python sees it, and so ran the full-precision path in silence.
    if not isinstance(quantized, bool):
        raise TypeError(
            "mxfp8_all_to_all: quantized must be True (rows travel as MXFP8: dispatch) or False "
            f"(x's dtype: combine); got {quantized!r}"
        )


@torch.library.custom_op(f"{_NAMESPACE}::mxfp8_all_to_all", mutates_args=())
def _mxfp8_all_to_all(
    x: Tensor,
    output_splits: Tensor,
    input_splits: Tensor,
    group_name: str,
    quantized: bool | None,
    scale_rule: str = "rceil",
    quantizer: str = "torch",
) -> Tensor:
    """prime-rl's MXFP8 expert-parallel all-to-all: rows travel as MXFP8 when ``quantized``
    (dispatch), in ``x.dtype`` otherwise (combine); the output is always ``x.dtype``."""
    op = "mxfp8_all_to_all"
    with rank_local(op, resolve_name(group_name, op)):
        _check_quantized(quantized)
        _check(x, scale_rule, quantizer, op)
    if not quantized:
        return torch.ops.prime_rl_collectives.all_to_all_single(
            x.contiguous(), output_splits, input_splits, group_name
        )
    return _exchange_quantized(x, output_splits, input_splits, group_name, scale_rule, quantizer)


@_mxfp8_all_to_all.register_fake
def _(x, output_splits, input_splits, group_name, quantized, scale_rule="rceil", quantizer="torch"):
    _check_quantized(quantized)
    _check(x, scale_rule, quantizer, "mxfp8_all_to_all")
    received = torch.ops.prime_rl_collectives.all_to_all_single(
        x, output_splits, input_splits, group_name
    )
    return x.new_empty((received.shape[0], *x.shape[1:]))


def _a2a_backward(ctx, grad):
    output_splits, input_splits = ctx.saved_tensors
    group_name, quantized, scale_rule, quantizer = ctx.options
    # The adjoint exchange in the other wire format (prime-rl's and torchtitan's asymmetry): a
    # dispatch sends its gradient back in full precision, a combine sends its gradient as MXFP8.
    grad_x = _mxfp8_all_to_all(
        grad.contiguous(),
        input_splits,
        output_splits,
        group_name,
        not quantized,
        scale_rule,
        quantizer,
    )
    torch._check(grad_x.shape[0] == ctx.rows)
    return grad_x, None, None, None, None, None, None


_mxfp8_all_to_all.register_autograd(_a2a_backward, setup_context=_setup)


def _front(op, x, output_splits, input_splits, group, options: dict) -> tuple[Tensor, Tensor]:
    """Checks of an MXFP8 all-to-all front (checked mode: with the options in the fingerprint);
    returns the splits as tensors."""
    group = resolve_call(group, op)
    splits = []

    def convert():  # default mode: the op reads the sizes (a sync for device tensors) once
        _check_sendable(x, op)
        _check(x, options["scale_rule"], options["quantizer"], op)
        splits[:] = (
            _as_splits("output_splits", output_splits),
            _as_splits("input_splits", input_splits),
        )

    def describe():
        convert()
        recv, send = _all_to_all_sizes(x, *splits, group.size())
        shared = {"x.shape[1:]": tuple(x.shape[1:]), **_where(x), **options}
        return Fingerprint(shared, tuple(send), tuple(recv))

    _run_checks(op, group, describe, convert)
    return group, *splits


def _prime_rl_front(op, x, output_splits, input_splits, group, quantized, scale_rule, quantizer):
    """prime-rl's dispatch and combine: the front's checks, then ``mxfp8_all_to_all``."""
    options = {"quantized": quantized, "scale_rule": scale_rule, "quantizer": quantizer}
    group, *splits = _front(op, x, output_splits, input_splits, group, options)
    return _mxfp8_all_to_all(x, *splits, group.group_name, quantized, scale_rule, quantizer)


def mxfp8_all_to_all_dispatch(
    x: Tensor,
    output_splits: Tensor | Sequence[int],
    input_splits: Tensor | Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    scale_rule: str = "rceil",
    quantizer: str = "torch",
) -> Tensor:
    """prime-rl's ``mxfp8_all_to_all_dispatch``: token rows to their experts' ranks as MXFP8
    (``prime_rl_collectives::mxfp8_all_to_all`` with ``quantized=True``), returned in
    ``x.dtype``; the gradient comes back in full precision.

    Example (2 ranks, each sends 1 row to rank 0 and 2 to rank 1)::

        out = mxfp8_all_to_all_dispatch(torch.randn(3, 64), [1, 1], [1, 2])  # rank 0: [2, 64]
    """
    op = "mxfp8_all_to_all_dispatch"
    return _prime_rl_front(op, x, output_splits, input_splits, group, True, scale_rule, quantizer)


def mxfp8_all_to_all_combine(
    x: Tensor,
    output_splits: Tensor | Sequence[int],
    input_splits: Tensor | Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    scale_rule: str = "rceil",
    quantizer: str = "torch",
) -> Tensor:
    """prime-rl's ``mxfp8_all_to_all_combine``: expert outputs back in full precision
    (``quantized=False``); their gradient travels as MXFP8. ``x [N, ..., H]`` must be
    quantisable (``H`` a multiple of 32) since the backward quantises it."""
    op = "mxfp8_all_to_all_combine"
    return _prime_rl_front(op, x, output_splits, input_splits, group, False, scale_rule, quantizer)
