"""Block-scaled FP8 GEMMs (namespace ``prime_rl``), DeepGEMM on CUDA, a reference kernel on CPU.

``prime_rl::fp8_blockwise_mm(x, weight)`` computes ``x @ weight.T`` after quantizing ``x`` in 1x128
blocks and ``weight`` in 128x128 blocks to ``torch.float8_e4m3fn`` with fp32 scales (the recipe of
DeepGEMM's ``fp8_gemm_nt``). ``prime_rl::grouped_fp8_gemm(x, weight, offsets)`` does the same
per expert over the contiguous grouped layout: rows ``offsets[g-1]:offsets[g]`` of ``x`` use
``weight[g]``. Both ops take high-precision tensors and quantize inside, so one opaque op is what
autograd, torch.compile and checkpoint policies see. The backward ops reuse the same two kernels
(every product is an "NT" GEMM of a 1x128-quantized left and a 128x128-quantized right operand),
so the CPU kernels define the semantics the GPU path is tested against.

Scales are ``amax / 448`` per block, or, with ``ue8m0=True``, that value rounded up to a power of
two. DeepGEMM on SM100 reads scales as UE8M0 (it keeps only the exponent of an fp32 scale, which
is wrong by up to 2x unless the scale already is a power of two), so ``ue8m0=None`` (the default)
means "power-of-two scales where the device needs them": on CUDA devices of compute capability 10
and later; never on CPU. Pass ``ue8m0=True`` on CPU to get exactly what an SM100 GPU computes.

:func:`fp8_gemm_nt` and :func:`grouped_fp8_gemm_nt` multiply tensors that are already quantized;
:func:`quantize_blockwise` (the one quantizer every op here uses) and :func:`dequantize_blockwise`
produce and invert that format.
"""

from __future__ import annotations

import torch

from prime_ops import native
from prime_ops.backends import import_backend
from prime_ops.devices import check_same_device
from prime_ops.grouped import check_offsets_meta, check_offsets_values

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "dequantize_blockwise",
    "fp8_blockwise_mm",
    "fp8_gemm_nt",
    "grouped_fp8_gemm",
    "grouped_fp8_gemm_nt",
    "quantize_blockwise",
]

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8_DTYPE).max
_HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
_AMAX_FLOOR = 1e-12  # an all-zero block gets a tiny, finite scale
BUILD = (
    "DeepGEMM is built from source (nothing on PyPI installs it): git clone --recursive "
    "https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM && ./install.sh (see docs/backends.md)"
)


def _deep_gemm():
    return import_backend("deep_gemm", extra=None, build=BUILD)


def needs_ue8m0(device: torch.device) -> bool:
    """Whether DeepGEMM on ``device`` reads scales as UE8M0 (SM100 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def _resolve_ue8m0(ue8m0: bool | None, device: torch.device) -> bool:
    needed = needs_ue8m0(device)
    if ue8m0 is None:
        return needed
    if needed and not ue8m0:
        raise ValueError(
            f"ue8m0=False on {device}: DeepGEMM on this GPU (SM100+) keeps only the exponent of "
            "each scale, so fp32 scales would be wrong by up to 2x; pass ue8m0=None or True"
        )
    return ue8m0


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


# --- quantization -------------------------------------------------------------------------------


def quantize_blockwise(
    t: torch.Tensor, block_rows: int, *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to float8_e4m3fn with one fp32 scale per ``block_rows x 128`` block.

    ``block_rows=1`` is the activation layout (scales ``[M, ceil(K/128)]``), ``block_rows=128``
    the weight layout (scales ``[ceil(N/128), ceil(K/128)]``). The rule, in fp32 (``t`` is
    rounded to float32 first, so a float64 beyond its range is inf): ``scale = max(amax, 1e-12)
    / 448`` per block (rounded up to a power of two with ``ue8m0=True``), then ``q =
    round_to_nearest_even(clamp(t / scale, -448, 448))``; ``dequantize`` is ``q * scale``. A
    block holding NaN gets the scale NaN, one holding +-inf (and no NaN) the scale inf, and every
    code of such a block is NaN, so it dequantizes to NaN. The native kernel gives the same bits.

    Example::

        q, scale = quantize_blockwise(torch.randn(4, 256), 1)  # q [4, 256], scale [4, 2]
    """
    if block_rows not in (1, BLOCK):
        raise ValueError(f"block_rows must be 1 or {BLOCK}, got {block_rows}")
    if t.dim() != 2:
        raise ValueError(f"quantize_blockwise expects a 2-D tensor, got shape {tuple(t.shape)}")
    if t.dtype in _HIGH_PRECISION and native.has_kernel("quantize_fp8_blockwise", t.device):
        # one fused pass, bit-identical to the chain below (tests/test_native.py)
        return native.quantize_fp8_blockwise(t, block_rows, "ue8m0" if ue8m0 else "fp32")
    rows, cols = t.shape
    pr = (-rows) % block_rows
    pc = (-cols) % BLOCK
    padded = torch.nn.functional.pad(t.float(), (0, pc, 0, pr))
    nr, nc = (rows + pr) // block_rows, (cols + pc) // BLOCK
    blocks = padded.view(nr, block_rows, nc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    finite = amax.isfinite()
    scale = amax.clamp(min=_AMAX_FLOOR) / _FP8_MAX
    if ue8m0:  # scale = mantissa * 2**exponent, mantissa in [0.5, 1): round up to 2**exponent
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).int())
    # Non-finite blocks: inf, or the one NaN (0x7fc00000) whatever NaN the block held.
    scale = torch.where(finite, scale, torch.where(amax.isnan(), torch.nan, torch.inf))
    q = (blocks / scale).clamp(-_FP8_MAX, _FP8_MAX)
    q = torch.where(finite, q, torch.nan).to(FP8_DTYPE)
    q = q.view(rows + pr, cols + pc)[:rows, :cols].contiguous()
    return q, scale.view(nr, nc).contiguous()


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Invert :func:`quantize_blockwise` to fp32; the block height is read off the scale shape."""
    rows, cols = q.shape
    block_rows = 1 if scale.shape[0] == rows else BLOCK
    full = scale.repeat_interleave(block_rows, 0).repeat_interleave(BLOCK, 1)
    return q.float() * full[:rows, :cols]


# --- validation (shared by kernels and fakes: shapes and dtypes only, never values) ------------


def _check_fp8(name: str, t: torch.Tensor) -> None:
    if t.dtype != FP8_DTYPE:
        raise TypeError(
            f"{name} must be {FP8_DTYPE} (quantize it with prime_ops.fp8.quantize_blockwise), "
            f"got {t.dtype}"
        )


def _check_scale(name: str, scale: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{name} has shape {tuple(scale.shape)} but {layout} block scaling with block size "
            f"{BLOCK} needs {expected}"
        )


def _check_high_precision(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _HIGH_PRECISION:
        raise TypeError(
            f"{name} must be bfloat16, float16 or float32 (the op quantizes it itself), got "
            f"{t.dtype}; to multiply tensors that are already FP8 use prime_ops.fp8.fp8_gemm_nt"
        )


def _check_multiple(name: str, size: int, what: str) -> None:
    if size % BLOCK:
        raise ValueError(
            f"{name}: {what} is {size}, not a multiple of {BLOCK}; DeepGEMM's block-scaled FP8 "
            f"GEMMs need {BLOCK}-aligned dimensions (pad it, or keep this layer in bf16)"
        )


# --- quantized GEMMs ----------------------------------------------------------------------------


def fp8_gemm_nt(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``a @ b.T`` for FP8 ``a [M, K]`` (1x128 scales) and ``b [N, K]`` (128x128 scales).

    The product accumulates in fp32 and is rounded once to ``out_dtype``. CUDA calls
    ``deep_gemm.fp8_gemm_nt`` (writing fp32 directly unless ``out_dtype`` is bf16); CPU
    dequantizes and multiplies in fp32.
    """
    check_same_device("fp8_gemm_nt", a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    _check_fp8("a", a)
    _check_fp8("b", b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a must be [M, K] and b [N, K] with the same K, got {tuple(a.shape)} and "
            f"{tuple(b.shape)}"
        )
    (m, k), n = a.shape, b.shape[0]
    _check_scale("a_scale", a_scale, (m, _blocks(k)), "1x128 activation")
    _check_scale("b_scale", b_scale, (_blocks(n), _blocks(k)), "128x128 weight")
    if a.device.type == "cuda":
        return _deep_gemm_nt(a, a_scale, b, b_scale, out_dtype)
    out = dequantize_blockwise(a, a_scale) @ dequantize_blockwise(b, b_scale).T
    return out.to(out_dtype)


def grouped_fp8_gemm_nt(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Rows ``offsets[g-1]:offsets[g]`` of FP8 ``a [M, K]`` times ``b[g].T`` (``b [G, N, K]``).

    Any segment lengths work. On CUDA ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` reads one
    group index per block of rows, so each segment is padded to
    ``deep_gemm.get_mk_alignment_for_contiguous_layout()`` rows (padding rows marked -1, which
    the kernel skips) and the padding is stripped from the result, all on the device. That
    kernel writes bf16 only; other output dtypes run one ``fp8_gemm_nt`` per group (one host
    read of ``offsets``). CPU multiplies group by group in fp32.
    """
    check_same_device(
        "grouped_fp8_gemm_nt", a=a, a_scale=a_scale, b=b, b_scale=b_scale, offsets=offsets
    )
    _check_fp8("a", a)
    _check_fp8("b", b)
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        raise ValueError(
            f"a must be [M, K] and b [G, N, K] with the same K, got {tuple(a.shape)} and "
            f"{tuple(b.shape)}"
        )
    (m, k), (g, n) = a.shape, b.shape[:2]
    _check_scale("a_scale", a_scale, (m, _blocks(k)), "1x128 activation")
    _check_scale("b_scale", b_scale, (g, _blocks(n), _blocks(k)), "128x128 weight")
    check_offsets_meta(offsets, g)
    check_offsets_values(offsets, m)
    if a.device.type == "cuda":
        return _deep_gemm_grouped_nt(a, a_scale, b, b_scale, offsets, out_dtype)
    out = a.new_empty(m, n, dtype=out_dtype)
    start = 0
    for i, end in enumerate(offsets.tolist()):
        lhs = dequantize_blockwise(a[start:end], a_scale[start:end])
        out[start:end] = (lhs @ dequantize_blockwise(b[i], b_scale[i]).T).to(out_dtype)
        start = end
    return out


def _check_power_of_two(device: torch.device, *scales: torch.Tensor) -> None:
    if needs_ue8m0(device):  # queued on the device: no host sync
        # Non-finite scales (blocks holding NaN or inf) pass: they give NaN products, not a
        # device-side assert that would leave the CUDA context unusable.
        powers = [((torch.frexp(s).mantissa == 0.5) | ~s.isfinite()).all() for s in scales]
        ok = torch.stack(powers).all()
        torch._assert_async(ok, "DeepGEMM on SM100+ needs power-of-two scales (ue8m0=True)")


def _d_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """DeepGEMM writes bf16 or fp32: anything but bf16 is written in fp32 and cast once."""
    return torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32


def _deep_gemm_nt(a, a_scale, b, b_scale, out_dtype):
    _check_power_of_two(a.device, a_scale, b_scale)
    d = torch.empty(a.shape[0], b.shape[0], dtype=_d_dtype(out_dtype), device=a.device)
    _deep_gemm().fp8_gemm_nt((a, a_scale), (b, b_scale), d)
    return d.to(out_dtype)


def _deep_gemm_grouped_nt(a, a_scale, b, b_scale, offsets, out_dtype):
    deep_gemm = _deep_gemm()
    if _d_dtype(out_dtype) != torch.bfloat16:
        out = a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)
        start = 0
        for i, end in enumerate(offsets.tolist()):
            rows = slice(start, end)
            out[rows] = _deep_gemm_nt(a[rows], a_scale[rows], b[i], b_scale[i], out_dtype)
            start = end
        return out
    _check_power_of_two(a.device, a_scale, b_scale)
    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    dest, group_of_row, padded_rows = _padded_layout(offsets, a.shape[0], align)
    layout = torch.full((padded_rows,), -1, dtype=torch.int32, device=a.device)
    layout[dest] = group_of_row
    a_pad = torch.zeros(padded_rows, a.shape[1], dtype=torch.uint8, device=a.device)
    a_pad[dest] = a.view(torch.uint8)  # bytes: scatter kernels need not support float8
    a_pad = a_pad.view(a.dtype)
    a_scale_pad = a_scale.new_ones(padded_rows, a_scale.shape[1])
    a_scale_pad[dest] = a_scale
    d = torch.empty(padded_rows, b.shape[1], dtype=torch.bfloat16, device=a.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_pad, a_scale_pad), (b, b_scale), d, layout)
    return d[dest]


def _padded_layout(offsets: torch.Tensor, rows: int, align: int):
    """Where each row goes when every group's segment is padded to a multiple of ``align``.

    Returns ``(dest, group_of_row, padded_rows)``: row ``r`` of group ``g`` lands at
    ``dest[r]``; ``padded_rows`` is a bound known without reading ``offsets`` on the host.
    """
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    padded = (counts + align - 1) // align * align
    padded_starts = torch.cumsum(padded, 0) - padded
    starts = offsets - counts
    row = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    group_of_row = torch.searchsorted(offsets, row, right=True).to(torch.int32)
    dest = (padded_starts[group_of_row] + row - starts[group_of_row]).long()
    bound = rows + offsets.numel() * (align - 1)
    return dest, group_of_row, (bound + align - 1) // align * align


# --- the ops ------------------------------------------------------------------------------------


def _mm_nt(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, ue8m0: bool) -> torch.Tensor:
    """Quantize ``a`` (1x128) and ``b`` (128x128), then ``a @ b.T``."""
    qa, sa = quantize_blockwise(a, 1, ue8m0=ue8m0)
    qb, sb = quantize_blockwise(b, BLOCK, ue8m0=ue8m0)
    return fp8_gemm_nt(qa, sa, qb, sb, out_dtype)


def _grouped_nt(a, b, offsets, out_dtype, ue8m0):
    qa, sa = quantize_blockwise(a, 1, ue8m0=ue8m0)
    qb, sb = zip(*(quantize_blockwise(w, BLOCK, ue8m0=ue8m0) for w in b), strict=True)
    return grouped_fp8_gemm_nt(qa, sa, torch.stack(qb), torch.stack(sb), offsets, out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 128: they add nothing to a product over rows."""
    return torch.nn.functional.pad(t, (0, 0, 0, (-t.shape[0]) % BLOCK))


def _check_grad(grad: torch.Tensor, rows: int, cols: int) -> None:
    _check_high_precision("grad", grad)
    if tuple(grad.shape) != (rows, cols):
        raise ValueError(
            f"grad must have shape [M, N] = [{rows}, {cols}] (the forward output's), got "
            f"{list(grad.shape)}"
        )


def _check_mm(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_same_device("prime_rl::fp8_blockwise_mm", x=x, weight=weight)
    _check_high_precision("x", x)
    _check_high_precision("weight", weight)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fp8_blockwise_mm needs x [M, K] and weight [N, K] with the same K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    _check_multiple("x", x.shape[1], "K (in features)")
    _check_multiple("weight", weight.shape[0], "N (out features)")


@torch.library.custom_op("prime_rl::fp8_blockwise_mm", mutates_args=())
def _fp8_blockwise_mm(
    x: torch.Tensor, weight: torch.Tensor, ue8m0: bool | None = None
) -> torch.Tensor:
    _check_mm(x, weight)
    return _mm_nt(x, weight, x.dtype, _resolve_ue8m0(ue8m0, x.device))


@_fp8_blockwise_mm.register_fake
def _(x, weight, ue8m0=None):
    _check_mm(x, weight)
    return x.new_empty(x.shape[0], weight.shape[0])


def _check_mm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_same_device("prime_rl::fp8_blockwise_mm_backward", grad=grad, x=x, weight=weight)
    _check_mm(x, weight)
    _check_grad(grad, x.shape[0], weight.shape[0])


@torch.library.custom_op("prime_rl::fp8_blockwise_mm_backward", mutates_args=())
def _fp8_blockwise_mm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, ue8m0: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_mm_backward(grad, x, weight)
    ue8m0 = _resolve_ue8m0(ue8m0, x.device)
    grad_x = _mm_nt(grad, weight.T.contiguous(), x.dtype, ue8m0)
    grad_w = _mm_nt(
        _pad_rows(grad).T.contiguous(), _pad_rows(x).T.contiguous(), weight.dtype, ue8m0
    )
    return grad_x, grad_w


@_fp8_blockwise_mm_backward.register_fake
def _(grad, x, weight, ue8m0=None):
    _check_mm_backward(grad, x, weight)
    return torch.empty_like(x), torch.empty_like(weight)


def _mm_setup(ctx, inputs, output):
    x, weight, ctx.ue8m0 = inputs
    ctx.save_for_backward(x, weight)


def _mm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.prime_rl.fp8_blockwise_mm_backward(
        grad.contiguous(), x, weight, ctx.ue8m0
    )
    return grad_x, grad_w, None


_fp8_blockwise_mm.register_autograd(_mm_backward, setup_context=_mm_setup)


def _check_grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    check_same_device("prime_rl::grouped_fp8_gemm", x=x, weight=weight, offsets=offsets)
    _check_high_precision("x", x)
    _check_high_precision("weight", weight)
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"grouped_fp8_gemm needs x [M, K] and weight [G, N, K] with the same K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    _check_multiple("x", x.shape[1], "K (in features)")
    _check_multiple("weight", weight.shape[1], "N (out features)")
    check_offsets_meta(offsets, weight.shape[0])


@torch.library.custom_op("prime_rl::grouped_fp8_gemm", mutates_args=())
def _grouped_fp8_gemm(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, ue8m0: bool | None = None
) -> torch.Tensor:
    _check_grouped(x, weight, offsets)
    return _grouped_nt(x, weight, offsets, x.dtype, _resolve_ue8m0(ue8m0, x.device))


@_grouped_fp8_gemm.register_fake
def _(x, weight, offsets, ue8m0=None):
    _check_grouped(x, weight, offsets)
    return x.new_empty(x.shape[0], weight.shape[1])


def _check_grouped_backward(grad, x, weight, offsets) -> None:
    check_same_device(
        "prime_rl::grouped_fp8_gemm_backward", grad=grad, x=x, weight=weight, offsets=offsets
    )
    _check_grouped(x, weight, offsets)
    _check_grad(grad, x.shape[0], weight.shape[1])


@torch.library.custom_op("prime_rl::grouped_fp8_gemm_backward", mutates_args=())
def _grouped_fp8_gemm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    ue8m0: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_grouped_backward(grad, x, weight, offsets)
    check_offsets_values(offsets, x.shape[0])
    ue8m0 = _resolve_ue8m0(ue8m0, x.device)
    grad_x = _grouped_nt(grad, weight.transpose(1, 2), offsets, x.dtype, ue8m0)
    # dW[g] = grad_g.T @ x_g contracts over each group's rows: one dense NT GEMM per group,
    # which needs the offsets on the host (one sync per backward on CUDA).
    grad_w = torch.zeros_like(weight)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            lhs = _pad_rows(grad[start:end]).T.contiguous()
            rhs = _pad_rows(x[start:end]).T.contiguous()
            grad_w[g] = _mm_nt(lhs, rhs, weight.dtype, ue8m0)
        start = end
    return grad_x, grad_w


@_grouped_fp8_gemm_backward.register_fake
def _(grad, x, weight, offsets, ue8m0=None):
    _check_grouped_backward(grad, x, weight, offsets)
    return torch.empty_like(x), torch.empty_like(weight)


def _grouped_setup(ctx, inputs, output):
    x, weight, offsets, ctx.ue8m0 = inputs
    ctx.save_for_backward(x, weight, offsets)


def _grouped_backward(ctx, grad):
    x, weight, offsets = ctx.saved_tensors
    grad_x, grad_w = torch.ops.prime_rl.grouped_fp8_gemm_backward(
        grad.contiguous(), x, weight, offsets, ctx.ue8m0
    )
    return grad_x, grad_w, None, None


_grouped_fp8_gemm.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def fp8_blockwise_mm(
    x: torch.Tensor, weight: torch.Tensor, *, ue8m0: bool | None = None
) -> torch.Tensor:
    """``x @ weight.T`` in block-scaled FP8 (``x [..., K]``, ``weight [N, K]``); autograd-enabled.

    ``ue8m0``: power-of-two scales; None picks what the device needs (see the module docstring).

    Example::

        y = fp8_blockwise_mm(torch.randn(8, 256), torch.randn(384, 256))  # [8, 384], fp32
    """
    out = torch.ops.prime_rl.fp8_blockwise_mm(x.reshape(-1, x.shape[-1]), weight, ue8m0)
    return out.view(*x.shape[:-1], weight.shape[0])


def grouped_fp8_gemm(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, ue8m0: bool | None = None
) -> torch.Tensor:
    """Per-group ``x_g @ weight[g].T`` in block-scaled FP8 over the contiguous grouped layout.

    ``offsets`` is int32 ``[G]``: the cumulative row end of each group (``offsets[-1] == M``), the
    convention of ``torch._grouped_mm``; segments may have any length.

    Example::

        offsets = torch.tensor([3, 3, 8], dtype=torch.int32)  # rows 0:3 -> 0, 3:8 -> 2
        z = grouped_fp8_gemm(torch.randn(8, 128), torch.randn(3, 256, 128), offsets)
    """
    return torch.ops.prime_rl.grouped_fp8_gemm(x, weight, offsets, ue8m0)
