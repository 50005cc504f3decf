"""Block-scaled FP8 GEMMs (namespace ``prime_rl``), DeepGEMM on CUDA, a reference kernel on CPU.

``prime_rl::fp8_blockwise_mm(x, weight, block_size)`` computes ``x @ weight.T`` after quantizing
``x`` in 1x128 blocks and ``weight`` in 128x128 blocks to ``torch.float8_e4m3fn`` with fp32 scales
(the recipe of DeepGEMM's ``fp8_gemm_nt``). ``prime_rl::grouped_fp8_gemm(x, weight, offs)`` is
``torch._grouped_mm`` in FP8: rows ``offs[g-1]:offs[g]`` of ``x`` times ``weight[g]`` (``[K, N]``).
Both ops take high-precision tensors and quantize inside, so one opaque op is what autograd,
torch.compile and checkpoint policies see. Their schemas are prime-rl's (see "the ops" below and
docs/backends.md#prime-rl-compatibility), prime_ops' extras after them with defaults. The backward
ops reuse the same two kernels (every product is an "NT" GEMM of a 1x128-quantized left and a
128x128-quantized right operand), so the CPU kernels define the semantics the GPU path is tested
against.

Scales are ``amax / 448`` per block, or, with ``ue8m0=True``, that value rounded up to a power of
two. DeepGEMM on SM100 reads scales as UE8M0 (it keeps only the exponent of an fp32 scale, which
is wrong by up to 2x unless the scale already is a power of two), so ``ue8m0=None`` (the default)
means "power-of-two scales where the device needs them": on CUDA devices of compute capability 10
and later; never on CPU. Pass ``ue8m0=True`` on CPU to get exactly what an SM100 GPU computes.

:func:`fp8_gemm_nt` and :func:`grouped_fp8_gemm_nt` multiply tensors that are already quantized;
:func:`quantize_blockwise` (the one quantizer every op here uses) and :func:`dequantize_blockwise`
produce and invert that format. Every entry point checks scale shapes against the data and
refuses an output dtype it cannot produce exactly.

prime-rl's fused FP8 SwiGLU MLP ops (``fp8_gate_up_mm``, ``fp8_clamped_swiglu``,
``fp8_gate_up_clamped_swiglu_backward``) are here too, with the same quantization.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prime_ops import native
from prime_ops._compat import CLAMP_GRAD_PASSES_AT_BOUNDS
from prime_ops.backends import import_backend
from prime_ops.devices import check_same_device
from prime_ops.grouped import check_offsets_meta, check_offsets_values

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "accumulate_wgrad_fp32",
    "dequantize_blockwise",
    "fp8_blockwise_mm",
    "fp8_gemm_nt",
    "grouped_fp8_gemm",
    "grouped_fp8_gemm_nt",
    "quantize_blockwise",
    "wgrad_accumulators",
]

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8_DTYPE).max
_HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
# What a GEMM can write exactly: the fp32 product, or that product rounded once.
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_AMAX_FLOOR = 1e-12  # an all-zero block gets a tiny, finite scale
BUILD = (
    "DeepGEMM is built from source (nothing on PyPI installs it): git clone --recursive "
    "https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM && ./install.sh (see docs/backends.md)"
)


def _deep_gemm():
    return import_backend("deep_gemm", extra=None, build=BUILD)


def _uses_deep_gemm(device: torch.device) -> bool:
    """Whether the GEMMs on ``device`` run in DeepGEMM (CUDA) rather than the CPU kernels."""
    return device.type == "cuda"


def _deep_gemm_arch(device: torch.device) -> int:
    """The major compute capability of ``device`` itself: DeepGEMM picks its kernels by it."""
    return torch.cuda.get_device_capability(device)[0]


def needs_ue8m0(device: torch.device) -> bool:
    """Whether DeepGEMM on ``device`` reads scales as UE8M0 (SM100 and later)."""
    return _uses_deep_gemm(device) and _deep_gemm_arch(device) >= 10


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
    """Invert :func:`quantize_blockwise` to fp32; the block height is read off the scale shape.

    ``scale`` must be the 1x128 layout ``[rows, ceil(cols / 128)]`` or the 128x128 layout
    ``[ceil(rows / 128), ceil(cols / 128)]`` of ``q``; any other shape is refused.

    Example::

        q, scale = quantize_blockwise(torch.randn(4, 256), 1)
        x = dequantize_blockwise(q, scale)  # [4, 256] fp32, within FP8's rounding of the input
    """
    _check_fp8("q", q)
    if q.dim() != 2:
        raise ValueError(f"q must be a 2-D FP8 tensor, got shape {tuple(q.shape)}")
    rows, cols = q.shape
    per_row, per_block = (rows, _blocks(cols)), (_blocks(rows), _blocks(cols))
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be float32, got {scale.dtype}")
    if tuple(scale.shape) not in (per_row, per_block):
        raise ValueError(
            f"scale has shape {tuple(scale.shape)} but q {tuple(q.shape)} needs {per_row} (1x128 "
            f"blocks) or {per_block} (128x128 blocks); pass the scale quantize_blockwise returned "
            "with q"
        )
    block_rows = 1 if tuple(scale.shape) == per_row else BLOCK
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


def _check_gemm_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(
            f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32 (the fp32 product, "
            f"rounded once), got {out_dtype}; cast the result yourself if you need another type"
        )


def _check_tensor(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")


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
    ``deep_gemm.fp8_gemm_nt``, writing fp32 directly unless ``out_dtype`` is bf16 (on SM90
    through its accumulating 1d1d kernel, the only one there that writes fp32); CPU
    dequantizes and multiplies in fp32.
    """
    check_same_device("fp8_gemm_nt", a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    _check_gemm_out_dtype(out_dtype)
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
    if _uses_deep_gemm(a.device):
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
    _check_gemm_out_dtype(out_dtype)
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
    check_offsets_meta(offsets, g, weight="b")
    check_offsets_values(offsets, m)
    if _uses_deep_gemm(a.device):
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
    if _d_dtype(out_dtype) == torch.float32 and _deep_gemm_arch(a.device) == 9:
        # SM90's 128x128-scale kernel (1d2d) writes bf16 only: fp32 comes from the 1d1d kernel,
        # which only accumulates, so accumulate into zeros.
        d = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
        _sm90_accumulate(a, a_scale, b, b_scale, d)
        return d.to(out_dtype)
    d = torch.empty(a.shape[0], b.shape[0], dtype=_d_dtype(out_dtype), device=a.device)
    _deep_gemm().fp8_gemm_nt((a, a_scale), (b, b_scale), d)
    return d.to(out_dtype)


def _sm90_accumulate(a, a_scale, b, b_scale, d):
    """``d += a @ b.T`` in fp32 on SM90: DeepGEMM's weight-gradient recipe (1, 1, 128), its
    ``sm90_fp8_gemm_1d1d`` kernel, accumulating through ``c = d``. That kernel takes 1x128 scales
    for ``b`` too: each 128x128 block's scale repeated on its 128 rows is the same product."""
    row_scales = b_scale.repeat_interleave(BLOCK, 0)[: b.shape[0]].contiguous()
    _deep_gemm().fp8_gemm_nt((a, a_scale), (b, row_scales), d, c=d, recipe=(1, 1, BLOCK))


def _accumulate_nt(a, a_scale, b, b_scale, buf):
    """``buf += a @ b.T`` (fp32 ``buf``): in the kernel on SM90, in torch elsewhere."""
    device = a.device
    if _uses_deep_gemm(device) and _deep_gemm_arch(device) == 9 and buf.is_contiguous():
        _sm90_accumulate(a, a_scale, b, b_scale, buf)
    else:
        buf.add_(fp8_gemm_nt(a, a_scale, b, b_scale, torch.float32))


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
#
# Schemas: prime-rl's first (src/prime_rl/trainer/models/layers/fp8_linear.py and
# fp8_grouped_gemm.py, the newest versions in the search index: fp8_blockwise_mm with wgrad_key,
# x_fp8 and x_sf, and fp8_grouped_gemm.py's custom ops), then prime_ops' extras with defaults.

# wgrad_key -> callable returning the fp32 buffer that key's weight gradient is added into. prime-rl
# fills a dict of this shape itself (``_wgrad_accumulators[id(module)] = accumulator``); after the
# switch its name is bound to this one (docs/migration.md), so its registrations land here.
wgrad_accumulators: dict[int, Callable[[], torch.Tensor]] = {}


def accumulate_wgrad_fp32(key: int, accumulator: Callable[[], torch.Tensor] | None) -> None:
    """Add the weight gradient of every ``fp8_blockwise_mm(..., wgrad_key=key)`` into
    ``accumulator()`` (an fp32 tensor of the weight's shape) instead of returning it.

    prime-rl's ``Float8BlockwiseLinear.accumulate_wgrad_fp32``: the weight then gets no ``.grad``
    from this op, and a bf16 rounding of each micro-batch's gradient is avoided. ``key`` 0 means
    "no accumulator"; ``accumulator=None`` removes the key's entry.

    Example::

        buf = torch.zeros(128, 128)
        accumulate_wgrad_fp32(7, lambda: buf)
    """
    if not isinstance(key, int) or isinstance(key, bool) or key == 0:
        raise ValueError(f"key must be a nonzero int (0 means no accumulator), got {key!r}")
    if accumulator is None:
        wgrad_accumulators.pop(key, None)
    elif not callable(accumulator):
        raise TypeError(
            f"accumulator must be a callable returning the fp32 buffer, got {accumulator!r}"
        )
    else:
        wgrad_accumulators[key] = accumulator


def _check_wgrad_key(key: int) -> None:
    """A nonzero key names an accumulator: one not registered would lose the gradient in silence
    (the weight gets a bf16 ``.grad`` while the fp32 buffer stays at zero), so it is refused."""
    if key != 0 and key not in wgrad_accumulators:
        raise KeyError(
            f"wgrad_key={key} has no fp32 accumulator registered: register one with "
            f"prime_ops.fp8.accumulate_wgrad_fp32({key}, lambda: buffer) (prime-rl: bind its "
            "_wgrad_accumulators to prime_ops.fp8.wgrad_accumulators, docs/migration.md), or "
            "pass wgrad_key=0 for a plain weight gradient"
        )


def _accumulator(key: int, weight: torch.Tensor) -> torch.Tensor | None:
    _check_wgrad_key(key)
    if key == 0:
        return None
    buf = wgrad_accumulators[key]()
    if buf.dtype != torch.float32 or buf.shape != weight.shape or buf.device != weight.device:
        raise ValueError(
            f"the accumulator of wgrad_key={key} returned {buf.dtype} {tuple(buf.shape)} on "
            f"{buf.device}; it must return a float32 tensor of the weight's shape "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    return buf


def _mm_nt(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, ue8m0: bool) -> torch.Tensor:
    """Quantize ``a`` (1x128) and ``b`` (128x128), then ``a @ b.T``."""
    qa, sa = quantize_blockwise(a, 1, ue8m0=ue8m0)
    qb, sb = quantize_blockwise(b, BLOCK, ue8m0=ue8m0)
    return fp8_gemm_nt(qa, sa, qb, sb, out_dtype)


def _grouped_nt(a, b, offsets, out_dtype, ue8m0):
    """Rows of group ``g`` of ``a`` times ``b[g].T`` (``b [G, N, K]``, any strides)."""
    qa, sa = quantize_blockwise(a, 1, ue8m0=ue8m0)
    pairs = (quantize_blockwise(w.contiguous(), BLOCK, ue8m0=ue8m0) for w in b)
    qb, sb = zip(*pairs, strict=True)
    return grouped_fp8_gemm_nt(qa, sa, torch.stack(qb), torch.stack(sb), offsets, out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 128: they add nothing to a product over rows."""
    return torch.nn.functional.pad(t, (0, 0, 0, (-t.shape[0]) % BLOCK))


def _check_block_size(block_size: int) -> None:
    if block_size != BLOCK:
        raise ValueError(
            f"block_size must be {BLOCK} (the block DeepGEMM's FP8 GEMMs scale by), got "
            f"{block_size}"
        )


def _check_out_dtype(out_dtype: torch.dtype | None) -> torch.dtype:
    """None is prime-rl's output dtype, bf16."""
    if out_dtype is None:
        return torch.bfloat16
    _check_gemm_out_dtype(out_dtype)
    return out_dtype


def _check_mm(x, weight, block_size, x_fp8=None, x_sf=None) -> None:
    _check_tensor("prime_rl::fp8_blockwise_mm", x=x, weight=weight)
    check_same_device("prime_rl::fp8_blockwise_mm", x=x, weight=weight, x_fp8=x_fp8, x_sf=x_sf)
    _check_high_precision("x", x)
    _check_high_precision("weight", weight)
    _check_block_size(block_size)
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_blockwise_mm needs x [..., K] and weight [N, K] with the same K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    _check_multiple("x", x.shape[-1], "K (in features)")
    _check_multiple("weight", weight.shape[0], "N (out features)")
    if (x_fp8 is None) != (x_sf is None):
        raise ValueError(
            "x_fp8 and x_sf come together (x's FP8 cast and its scales), got only "
            f"{'x_fp8' if x_sf is None else 'x_sf'}; pass both or neither"
        )
    if x_fp8 is not None:
        tokens, k = x.numel() // x.shape[-1], x.shape[-1]
        _check_fp8("x_fp8", x_fp8)
        if x_fp8.numel() != tokens * k:
            raise ValueError(
                f"x_fp8 has shape {tuple(x_fp8.shape)} but x is {tuple(x.shape)}: x_fp8 must "
                "hold x's per-token cast, element for element"
            )
        if x_sf.dtype != torch.float32:
            raise TypeError(f"x_sf must be float32, got {x_sf.dtype}")
        if x_sf.dim() != 2 or x_sf.shape[0] != _blocks(k) or x_sf.shape[1] < tokens:
            raise ValueError(
                f"x_sf has shape {tuple(x_sf.shape)} but x's 1x128 scales stored as prime-rl's "
                f"producers store them need [K / 128, >= tokens] = [{_blocks(k)}, >= {tokens}]"
            )


@torch.library.custom_op("prime_rl::fp8_blockwise_mm", mutates_args=())
def _fp8_blockwise_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_size: int,
    wgrad_key: int = 0,
    x_fp8: torch.Tensor | None = None,
    x_sf: torch.Tensor | None = None,
    ue8m0: bool | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    _check_mm(x, weight, block_size, x_fp8, x_sf)
    out_dtype = _check_out_dtype(out_dtype)
    ue8m0 = _resolve_ue8m0(ue8m0, x.device)
    x_2d = x.reshape(-1, x.shape[-1])
    qw, sw = quantize_blockwise(weight, BLOCK, ue8m0=ue8m0)
    if x_fp8 is None:
        qx, sx = quantize_blockwise(x_2d, 1, ue8m0=ue8m0)
    else:  # the producer's cast: scales [K / 128, >= tokens], read as [tokens, K / 128]
        qx, sx = x_fp8.reshape(x_2d.shape), x_sf[:, : x_2d.shape[0]].T
    out = fp8_gemm_nt(qx, sx, qw, sw, out_dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


@_fp8_blockwise_mm.register_fake
def _(x, weight, block_size, wgrad_key=0, x_fp8=None, x_sf=None, ue8m0=None, out_dtype=None):
    _check_mm(x, weight, block_size, x_fp8, x_sf)
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=_check_out_dtype(out_dtype))


def _check_mm_backward(grad_output, x, weight, block_size) -> None:
    check_same_device(
        "prime_rl::fp8_blockwise_mm_backward", grad_output=grad_output, x=x, weight=weight
    )
    _check_mm(x, weight, block_size)
    _check_grad(grad_output, (*x.shape[:-1], weight.shape[0]))


def _check_grad(grad: torch.Tensor, shape: tuple[int, ...]) -> None:
    _check_high_precision("grad_output", grad)
    if tuple(grad.shape) != tuple(shape):
        raise ValueError(
            f"grad_output must have the forward output's shape {list(shape)}, got "
            f"{list(grad.shape)}"
        )


@torch.library.custom_op("prime_rl::fp8_blockwise_mm_backward", mutates_args=())
def _fp8_blockwise_mm_backward(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    block_size: int,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    wgrad_key: int = 0,
    ue8m0: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """With an fp32 accumulator registered for ``wgrad_key`` (:func:`accumulate_wgrad_fp32`),
    the weight gradient is added into it and the returned weight gradient is empty, as in
    prime-rl. A gradient not asked for is returned as zeros."""
    _check_mm_backward(grad_output, x, weight, block_size)
    ue8m0 = _resolve_ue8m0(ue8m0, x.device)
    x_2d = x.reshape(-1, x.shape[-1])
    grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
    grad_x = torch.zeros_like(x)
    grad_w = torch.zeros_like(weight)
    if needs_grad_x:
        grad_x = _mm_nt(grad_2d, weight.T.contiguous(), x.dtype, ue8m0).view(x.shape)
    if needs_grad_weight:
        accumulator = _accumulator(wgrad_key, weight)
        lhs, rhs = _pad_rows(grad_2d).T.contiguous(), _pad_rows(x_2d).T.contiguous()
        if accumulator is None:
            grad_w = _mm_nt(lhs, rhs, weight.dtype, ue8m0)
        else:
            qa, sa = quantize_blockwise(lhs, 1, ue8m0=ue8m0)
            qb, sb = quantize_blockwise(rhs, BLOCK, ue8m0=ue8m0)
            _accumulate_nt(qa, sa, qb, sb, accumulator)
            grad_w = weight.new_empty(0)
    return grad_x, grad_w


@_fp8_blockwise_mm_backward.register_fake
def _(grad_output, x, weight, block_size, needs_grad_x, needs_grad_weight, wgrad_key=0, ue8m0=None):
    _check_mm_backward(grad_output, x, weight, block_size)
    if needs_grad_weight:
        _check_wgrad_key(wgrad_key)
    accumulates = needs_grad_weight and wgrad_key in wgrad_accumulators
    return torch.empty_like(x), weight.new_empty(0) if accumulates else torch.empty_like(weight)


def _mm_setup(ctx, inputs, output):
    x, weight, ctx.block_size, ctx.wgrad_key, _, _, ctx.ue8m0, _ = inputs
    ctx.save_for_backward(x, weight)


def _mm_backward(ctx, grad_output):
    x, weight = ctx.saved_tensors
    needs_grad_x, needs_grad_weight = ctx.needs_input_grad[:2]
    grad_x, grad_w = torch.ops.prime_rl.fp8_blockwise_mm_backward(
        grad_output.contiguous(),
        x,
        weight,
        ctx.block_size,
        needs_grad_x,
        needs_grad_weight,
        ctx.wgrad_key,
        ctx.ue8m0,
    )
    keep_w = needs_grad_weight and ctx.wgrad_key not in wgrad_accumulators
    return grad_x if needs_grad_x else None, grad_w if keep_w else None, *[None] * 6


_fp8_blockwise_mm.register_autograd(_mm_backward, setup_context=_mm_setup)


# --- prime-rl's fused FP8 SwiGLU MLP (fp8_linear.py: fp8_clamped_swiglu_mlp) --------------------
#
# prime-rl's ``_FP8GateUpClampedSwiglu`` (its autograd.Function, which stays prime-rl's) calls
# ``fp8_gate_up_mm`` and ``fp8_clamped_swiglu`` forward and ``fp8_gate_up_clamped_swiglu_backward``
# backward. The SwiGLU is rounded where eager bf16 PyTorch rounds it, as prime-rl's fused kernel
# is; the GEMMs quantize as fp8_blockwise_mm does.


def _check_gate_up(x, gate_weight, up_weight, block_size) -> None:
    op = "prime_rl::fp8_gate_up_mm"
    _check_tensor(op, x=x, gate_weight=gate_weight, up_weight=up_weight)
    check_same_device(op, x=x, gate_weight=gate_weight, up_weight=up_weight)
    if x.dim() != 2 or gate_weight.shape != up_weight.shape or gate_weight.dim() != 2:
        raise ValueError(
            f"{op} needs a 2-D x [T, K] and gate_weight, up_weight [I, K] of one shape, got "
            f"{tuple(x.shape)}, {tuple(gate_weight.shape)} and {tuple(up_weight.shape)}"
        )
    _check_high_precision("up_weight", up_weight)
    _check_mm(x, gate_weight, block_size)


def _stacked(gate_weight, up_weight):
    """``[gate; up]``: with I a multiple of 128 its 128x128 blocks are each weight's own."""
    return torch.cat([gate_weight, up_weight])


@torch.library.custom_op("prime_rl::fp8_gate_up_mm", mutates_args=())
def _fp8_gate_up_mm(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    block_size: int,
    ue8m0: bool | None = None,
) -> torch.Tensor:
    """``[x @ gate_weight.T | x @ up_weight.T]`` in bf16: one GEMM, each half equal to
    ``fp8_blockwise_mm`` of its weight."""
    _check_gate_up(x, gate_weight, up_weight, block_size)
    ue8m0 = _resolve_ue8m0(ue8m0, x.device)
    return _mm_nt(x, _stacked(gate_weight, up_weight), torch.bfloat16, ue8m0)


@_fp8_gate_up_mm.register_fake
def _(x, gate_weight, up_weight, block_size, ue8m0=None):
    _check_gate_up(x, gate_weight, up_weight, block_size)
    return x.new_empty(x.shape[0], 2 * gate_weight.shape[0], dtype=torch.bfloat16)


def _gate_up_setup(ctx, inputs, output):
    x, gate_weight, up_weight, ctx.block_size, ctx.ue8m0 = inputs
    ctx.save_for_backward(x, gate_weight, up_weight)


def _gate_up_backward(ctx, grad_output):
    x, gate_weight, up_weight = ctx.saved_tensors
    needs_x, needs_gate, needs_up = ctx.needs_input_grad[:3]
    grad_x, grad_w = torch.ops.prime_rl.fp8_blockwise_mm_backward(
        grad_output.contiguous(),
        x,
        _stacked(gate_weight, up_weight),
        ctx.block_size,
        needs_x,
        needs_gate or needs_up,
        0,
        ctx.ue8m0,
    )
    grad_gate, grad_up = grad_w.chunk(2)
    return (
        grad_x if needs_x else None,
        grad_gate if needs_gate else None,
        grad_up if needs_up else None,
        None,
        None,
    )


_fp8_gate_up_mm.register_autograd(_gate_up_backward, setup_context=_gate_up_setup)


def _clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=1)
    return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _check_swiglu(gate_up: torch.Tensor, limit: float) -> int:
    """The intermediate size I of ``gate_up [T, 2I]``."""
    _check_tensor("prime_rl::fp8_clamped_swiglu", gate_up=gate_up)
    _check_high_precision("gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % (2 * BLOCK):
        raise ValueError(
            f"gate_up must be [T, 2I] ([gate | up], I a multiple of {BLOCK}), got "
            f"{tuple(gate_up.shape)}"
        )
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise TypeError(f"limit must be a float, got {limit!r}")
    return gate_up.shape[1] // 2


def _swiglu_backward(grad_h: torch.Tensor, gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """``d[gate | up]`` by eager autograd's formulas, in ``gate_up``'s dtype (a custom op's
    kernel runs below autograd, so they are spelled out: mul, clamp's mask, silu_backward); at the
    clamps' bounds the gradient passes or stops as the running torch's autograd does."""
    gate, up = gate_up.chunk(2, dim=1)
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    d_u = grad_h * torch.nn.functional.silu(g)
    d_g = torch.ops.aten.silu_backward(grad_h * u, g)
    zero = grad_h.new_zeros(())
    if CLAMP_GRAD_PASSES_AT_BOUNDS:
        d_gate = torch.where(gate <= limit, d_g, zero)
        d_up = torch.where((up >= -limit) & (up <= limit), d_u, zero)
    else:
        d_gate = torch.where(gate < limit, d_g, zero)
        d_up = torch.where((up > -limit) & (up < limit), d_u, zero)
    return torch.cat([d_gate, d_up], dim=1)


@torch.library.custom_op("prime_rl::fp8_clamped_swiglu", mutates_args=())
def _fp8_clamped_swiglu(
    gate_up: torch.Tensor, limit: float, ue8m0: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h = silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)`` from ``gate_up = [gate |
    up]``, and ``h``'s 1x128 FP8 cast: values ``[T, I]`` and scales stored as prime-rl's down
    projection reads them, ``[I / 128, ceil(T / 4) * 4]`` (``x_sf`` of fp8_blockwise_mm)."""
    _check_swiglu(gate_up, limit)
    ue8m0 = _resolve_ue8m0(ue8m0, gate_up.device)
    h = _clamped_swiglu(gate_up, limit)
    q, scale = quantize_blockwise(h, 1, ue8m0=ue8m0)
    rows = h.shape[0]
    h_sf = scale.new_zeros(scale.shape[1], -(-rows // 4) * 4)
    h_sf[:, :rows] = scale.T
    return h, q, h_sf


@_fp8_clamped_swiglu.register_fake
def _(gate_up, limit, ue8m0=None):
    inter = _check_swiglu(gate_up, limit)
    rows = gate_up.shape[0]
    return (
        gate_up.new_empty(rows, inter),
        gate_up.new_empty(rows, inter, dtype=FP8_DTYPE),
        gate_up.new_empty(inter // BLOCK, -(-rows // 4) * 4, dtype=torch.float32),
    )


def _swiglu_setup(ctx, inputs, output):
    gate_up, ctx.limit, _ = inputs
    ctx.save_for_backward(gate_up)


def _swiglu_autograd_backward(ctx, grad_h, _grad_q, _grad_sf):
    (gate_up,) = ctx.saved_tensors
    if grad_h is None:
        return None, None, None
    return _swiglu_backward(grad_h, gate_up, ctx.limit), None, None


_fp8_clamped_swiglu.register_autograd(_swiglu_autograd_backward, setup_context=_swiglu_setup)


def _check_gate_up_backward(grad_h, x, gate_weight, up_weight, gate_up, limit, block_size):
    op = "prime_rl::fp8_gate_up_clamped_swiglu_backward"
    _check_tensor(op, grad_h=grad_h, gate_up=gate_up)
    check_same_device(op, grad_h=grad_h, x=x, gate_weight=gate_weight, gate_up=gate_up)
    _check_gate_up(x, gate_weight, up_weight, block_size)
    inter = _check_swiglu(gate_up, limit)
    if tuple(gate_up.shape) != (x.shape[0], 2 * gate_weight.shape[0]):
        raise ValueError(
            f"gate_up must be fp8_gate_up_mm's output [T, 2I] = {[x.shape[0], 2 * inter]}, got "
            f"{list(gate_up.shape)}"
        )
    _check_grad(grad_h, (x.shape[0], inter))


@torch.library.custom_op("prime_rl::fp8_gate_up_clamped_swiglu_backward", mutates_args=())
def _fp8_gate_up_clamped_swiglu_backward(
    grad_h: torch.Tensor,
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate_up: torch.Tensor,
    limit: float,
    block_size: int,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    gate_wgrad_key: int = 0,
    up_wgrad_key: int = 0,
    ue8m0: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate and up projections' backward from ``grad_h``: ``d[gate | up]`` as eager bf16
    autograd gives it, the two data-gradient GEMMs summed in ``x.dtype``, two weight-gradient
    GEMMs. A weight whose key has an accumulator (:func:`accumulate_wgrad_fp32`) gets its
    gradient added there and an empty one returned; gradients not asked for are zeros."""
    _check_gate_up_backward(grad_h, x, gate_weight, up_weight, gate_up, limit, block_size)
    ue8m0 = _resolve_ue8m0(ue8m0, x.device)
    d_gate, d_up = _swiglu_backward(grad_h.contiguous(), gate_up, limit).chunk(2, dim=1)
    grad_x = torch.zeros_like(x)
    grads_w = [torch.zeros_like(gate_weight), torch.zeros_like(up_weight)]
    halves = ((d_gate, gate_weight, gate_wgrad_key), (d_up, up_weight, up_wgrad_key))
    if needs_grad_x:
        gate_x, up_x = (
            _mm_nt(d.contiguous(), w.T.contiguous(), x.dtype, ue8m0) for d, w, _ in halves
        )
        grad_x = gate_x + up_x
    if needs_grad_weight:
        rhs = _pad_rows(x).T.contiguous()
        for i, (d, weight, key) in enumerate(halves):
            accumulator = _accumulator(key, weight)
            lhs = _pad_rows(d).T.contiguous()
            if accumulator is None:
                grads_w[i] = _mm_nt(lhs, rhs, weight.dtype, ue8m0)
            else:
                qa, sa = quantize_blockwise(lhs, 1, ue8m0=ue8m0)
                qb, sb = quantize_blockwise(rhs, BLOCK, ue8m0=ue8m0)
                _accumulate_nt(qa, sa, qb, sb, accumulator)
                grads_w[i] = weight.new_empty(0)
    return grad_x, grads_w[0], grads_w[1]


@_fp8_gate_up_clamped_swiglu_backward.register_fake
def _(
    grad_h, x, gate_weight, up_weight, gate_up, limit, block_size, needs_grad_x,
    needs_grad_weight, gate_wgrad_key=0, up_wgrad_key=0, ue8m0=None,
):  # fmt: skip
    _check_gate_up_backward(grad_h, x, gate_weight, up_weight, gate_up, limit, block_size)
    grads_w = []
    for weight, key in ((gate_weight, gate_wgrad_key), (up_weight, up_wgrad_key)):
        if needs_grad_weight:
            _check_wgrad_key(key)
        accumulates = needs_grad_weight and key in wgrad_accumulators
        grads_w.append(weight.new_empty(0) if accumulates else torch.empty_like(weight))
    return torch.empty_like(x), *grads_w


def _check_grouped(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> None:
    _check_tensor("prime_rl::grouped_fp8_gemm", x=x, weight=weight, offs=offs)
    check_same_device("prime_rl::grouped_fp8_gemm", x=x, weight=weight, offs=offs)
    _check_high_precision("x", x)
    _check_high_precision("weight", weight)
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"grouped_fp8_gemm needs x [M, K] and weight [G, K, N] (torch._grouped_mm's layout) "
            f"with the same K, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    _check_multiple("x", x.shape[1], "K (in features)")
    _check_multiple("weight", weight.shape[2], "N (out features)")
    check_offsets_meta(offs, weight.shape[0], name="offs")


@torch.library.custom_op("prime_rl::grouped_fp8_gemm", mutates_args=())
def _grouped_fp8_gemm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, ue8m0: bool | None = None
) -> torch.Tensor:
    _check_grouped(x, weight, offs)
    check_offsets_values(offs, x.shape[0], name="offs")
    ue8m0 = _resolve_ue8m0(ue8m0, x.device)
    return _grouped_nt(x, weight.transpose(1, 2), offs, x.dtype, ue8m0)


@_grouped_fp8_gemm.register_fake
def _(x, weight, offs, ue8m0=None):
    _check_grouped(x, weight, offs)
    return x.new_empty(x.shape[0], weight.shape[2])


def _check_grouped_backward(grad_output, x, weight, offs) -> None:
    check_same_device(
        "prime_rl::grouped_fp8_gemm_backward",
        grad_output=grad_output,
        x=x,
        weight=weight,
        offs=offs,
    )
    _check_grouped(x, weight, offs)
    _check_grad(grad_output, (x.shape[0], weight.shape[2]))


@torch.library.custom_op("prime_rl::grouped_fp8_gemm_backward", mutates_args=())
def _grouped_fp8_gemm_backward(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    ue8m0: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_grouped_backward(grad_output, x, weight, offs)
    check_offsets_values(offs, x.shape[0], name="offs")
    ue8m0 = _resolve_ue8m0(ue8m0, x.device)
    grad_x = torch.zeros_like(x)
    grad_w = torch.zeros_like(weight)
    if needs_grad_x:  # dX_g = dY_g @ W[g].T: W[g] [K, N] is the NT right operand as it is
        grad_x = _grouped_nt(grad_output, weight, offs, x.dtype, ue8m0)
    if needs_grad_weight:
        # dW[g] = X_g.T @ dY_g contracts over each group's rows: one dense NT GEMM per group,
        # which needs the offsets on the host (one sync per backward on CUDA).
        start = 0
        for g, end in enumerate(offs.tolist()):
            if end > start:
                lhs = _pad_rows(x[start:end]).T.contiguous()
                rhs = _pad_rows(grad_output[start:end]).T.contiguous()
                grad_w[g] = _mm_nt(lhs, rhs, weight.dtype, ue8m0)
            start = end
    return grad_x, grad_w


@_grouped_fp8_gemm_backward.register_fake
def _(grad_output, x, weight, offs, needs_grad_x, needs_grad_weight, ue8m0=None):
    _check_grouped_backward(grad_output, x, weight, offs)
    return torch.empty_like(x), torch.empty_like(weight)


def _grouped_setup(ctx, inputs, output):
    x, weight, offs, ctx.ue8m0 = inputs
    ctx.save_for_backward(x, weight, offs)


def _grouped_backward(ctx, grad_output):
    x, weight, offs = ctx.saved_tensors
    needs_grad_x, needs_grad_weight = ctx.needs_input_grad[:2]
    grad_x, grad_w = torch.ops.prime_rl.grouped_fp8_gemm_backward(
        grad_output.contiguous(), x, weight, offs, needs_grad_x, needs_grad_weight, ctx.ue8m0
    )
    return grad_x if needs_grad_x else None, grad_w if needs_grad_weight else None, None, None


_grouped_fp8_gemm.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def fp8_blockwise_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    wgrad_key: int = 0,
    ue8m0: bool | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` in block-scaled FP8 (``x [..., K]``, ``weight [N, K]``); autograd-enabled.

    The output is in ``out_dtype``, by default ``x.dtype`` (the op itself, called as prime-rl
    calls it, returns bf16). ``ue8m0``: power-of-two scales; None picks what the device needs
    (see the module docstring). ``wgrad_key``: see :func:`accumulate_wgrad_fp32`.

    Example::

        y = fp8_blockwise_mm(torch.randn(8, 256), torch.randn(384, 256))  # [8, 384], fp32
    """
    _check_tensor("fp8_blockwise_mm", x=x, weight=weight)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return torch.ops.prime_rl.fp8_blockwise_mm(
        x, weight, BLOCK, wgrad_key, None, None, ue8m0, out_dtype
    )


def grouped_fp8_gemm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, *, ue8m0: bool | None = None
) -> torch.Tensor:
    """Per-group ``x_g @ weight[g]`` in block-scaled FP8: ``torch._grouped_mm``'s contract.

    ``x [M, K]``, ``weight [G, K, N]``; ``offs`` is int32 ``[G]``: the cumulative row end of each
    group (``offs[-1] == M``); segments may have any length. The output is ``[M, N]`` in
    ``x.dtype``.

    Example::

        offs = torch.tensor([3, 3, 8], dtype=torch.int32)  # rows 0:3 -> 0, 3:8 -> 2
        z = grouped_fp8_gemm(torch.randn(8, 128), torch.randn(3, 128, 256), offs)  # [8, 256]
    """
    return torch.ops.prime_rl.grouped_fp8_gemm(x, weight, offs, ue8m0)
