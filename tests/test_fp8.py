"""prime_rl::fp8_blockwise_mm and prime_rl::grouped_fp8_gemm: CPU kernels, fakes, DeepGEMM adapter.

The reference is written here from the definition, in float64, without prime_ops' quantizer:
per-block amax, fp32 scale (rounded up to a power of two for UE8M0), e4m3 round-to-nearest-even
by explicit spacing. Errors against exact math are bounded by the e4m3 rounding bound.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import prime_ops
from prime_ops import fp8
from prime_ops.fp8 import BLOCK, FP8_DTYPE, quantize_blockwise

E4M3_MAX, E4M3_MIN_EXP, E4M3_MANTISSA_BITS = 448.0, -6, 3


# --- independent float64 reference -------------------------------------------------------------


def _ref_scales(t: torch.Tensor, block_rows: int, ue8m0: bool) -> torch.Tensor:
    """One scale per ``block_rows x 128`` block, as float64 holding fp32 (or power-of-two) values."""
    rows, cols = t.shape
    out = torch.empty(math.ceil(rows / block_rows), math.ceil(cols / 128), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            block = t[i * block_rows : (i + 1) * block_rows, j * 128 : (j + 1) * 128]
            amax = max(block.double().abs().max().item(), 1e-12)
            scale = float(torch.tensor(amax / E4M3_MAX, dtype=torch.float64).float())
            if ue8m0:
                scale = 2.0 ** math.ceil(math.log2(scale))
            out[i, j] = scale
    return out


def _ref_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values (already within +-448) to the nearest e4m3 value, ties to even."""
    exp = torch.floor(torch.log2(v.abs().clamp(min=2.0**-30))).clamp(min=E4M3_MIN_EXP)
    step = torch.exp2(exp - E4M3_MANTISSA_BITS)
    return torch.round(v / step) * step  # torch.round rounds half to even


def _ref_quantize(t: torch.Tensor, block_rows: int, ue8m0: bool = False):
    """(e4m3 values as float64, scales as float64, per-element scale) of ``t``."""
    scales = _ref_scales(t, block_rows, ue8m0)
    full = scales.repeat_interleave(block_rows, 0).repeat_interleave(128, 1)[
        : t.shape[0], : t.shape[1]
    ]
    # The quotient is an fp32 value (the kernels divide in fp32), then rounded to e4m3.
    q = _ref_e4m3((t.double() / full).float().double().clamp(-E4M3_MAX, E4M3_MAX))
    return q, scales, full


def _ref_dequantized(t, block_rows, ue8m0=False):
    q, _, full = _ref_quantize(t, block_rows, ue8m0)
    return q * full


def _rounding_bound(t, block_rows, ue8m0=False):
    """Per element: the largest error quantization may make: half an e4m3 step, plus the fp32
    rounding of the quotient (which can move a value onto a tie), scaled back."""
    _, _, full = _ref_quantize(t, block_rows, ue8m0)
    scaled = t.double().abs() / full
    exp = torch.floor(torch.log2(scaled.clamp(min=2.0**-30))).clamp(min=E4M3_MIN_EXP)
    return (torch.exp2(exp - E4M3_MANTISSA_BITS - 1) + 2.0**-23 * scaled) * full


def _assert_product_bound(out, a, b, ue8m0=False):
    """|exact a @ b.T - out| within the e4m3 rounding of both operands plus fp32 accumulation."""
    a64, b64 = a.double(), b.double()
    ea, eb = _rounding_bound(a, 1, ue8m0), _rounding_bound(b, BLOCK, ue8m0)
    bound = ea @ b64.abs().T + a64.abs() @ eb.T + ea @ eb.T
    bound += a.shape[1] * 2.0**-23 * ((a64.abs() + ea) @ (b64.abs() + eb).T)  # fp32 sums
    err = (a64 @ b64.T - out.double()).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    # ... and the bound is tight: errors do reach a good fraction of it somewhere.
    assert err.max() >= 0.05 * bound.max()


def _varied(gen, rows, cols):
    """Values whose magnitude varies by orders of magnitude from block to block (and a zero)."""
    t = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    t *= 10.0 ** torch.randint(-6, 4, (rows, 1), generator=gen)
    t[:, :128] *= 10.0 ** torch.randint(-3, 3, (1, 1), generator=gen)
    t[0] = 0.0
    return t.float()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# --- quantization ------------------------------------------------------------------------------


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("block_rows", [1, BLOCK])
def test_quantize_matches_the_float64_definition(gen, block_rows, ue8m0):
    t = _varied(gen, 130, 300)
    q, scale = quantize_blockwise(t, block_rows, ue8m0=ue8m0)
    ref_q, ref_scale, _ = _ref_quantize(t, block_rows, ue8m0)
    assert q.dtype == FP8_DTYPE and q.shape == t.shape and scale.dtype == torch.float32
    assert scale.shape == ref_scale.shape
    assert torch.equal(scale.double(), ref_scale)
    assert torch.equal(q.double(), ref_q)
    if ue8m0:
        mantissa, _ = torch.frexp(scale)
        assert torch.all(mantissa == 0.5)  # exact powers of two, what SM100 reads
    else:
        assert q.double().abs().max() == E4M3_MAX  # some block's amax maps to the top


def test_quantize_rejects_bad_block():
    with pytest.raises(ValueError, match="block_rows must be 1 or 128"):
        quantize_blockwise(torch.ones(4, 128), 64)


# --- dense op ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ue8m0", [False, True])
def test_forward_against_exact_math(gen, ue8m0):
    x, w = _varied(gen, 7, 256), torch.randn(384, 256, generator=gen)
    out = fp8.fp8_blockwise_mm(x, w, ue8m0=ue8m0)
    assert out.dtype == torch.float32
    ref = _ref_dequantized(x, 1, ue8m0) @ _ref_dequantized(w, BLOCK, ue8m0).T
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    _assert_product_bound(out, x, w, ue8m0)


def test_front_keeps_leading_dims(gen):
    x, w = torch.randn(2, 3, 128, generator=gen), torch.randn(128, 128, generator=gen)
    out = fp8.fp8_blockwise_mm(x, w)
    assert out.shape == (2, 3, 128)
    torch.testing.assert_close(out.view(6, 128), fp8.fp8_blockwise_mm(x.view(6, 128), w))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_backward_quantizes_each_product(gen, ue8m0):
    x = torch.randn(5, 256, generator=gen, requires_grad=True)
    w = torch.randn(128, 256, generator=gen, requires_grad=True)
    g = torch.randn(5, 128, generator=gen)
    fp8.fp8_blockwise_mm(x, w, ue8m0=ue8m0).backward(g)
    # grad_x = q(g) @ q(w.T).T; grad_w = q(g.T) @ q(x.T).T (rows zero-padded to 128).
    _assert_product_bound(x.grad, g, w.detach().T.contiguous(), ue8m0)
    pad = torch.zeros(123, 128), torch.zeros(123, 256)
    g_t, x_t = torch.cat([g, pad[0]]).T.contiguous(), torch.cat([x.detach(), pad[1]]).T.contiguous()
    _assert_product_bound(w.grad, g_t, x_t, ue8m0)


@pytest.mark.parametrize(("dtype", "ue8m0"), [(torch.float32, None), (torch.bfloat16, True)])
def test_opcheck_dense(gen, dtype, ue8m0):
    x = torch.randn(3, 128, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(256, 128, generator=gen).to(dtype).requires_grad_()
    opcheck(torch.ops.prime_rl.fp8_blockwise_mm.default, (x, w, BLOCK, 0, None, None, ue8m0))
    g = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    args = (g, x.detach(), w.detach(), BLOCK, True, True, 0, ue8m0)
    opcheck(torch.ops.prime_rl.fp8_blockwise_mm_backward.default, args)


# --- prime-rl's fused SwiGLU MLP ops ------------------------------------------------------------


def _swiglu_input(gen, rows=5, inter=128, limit=1.0):
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 2).bfloat16()
    gate_up[0, :4] = (
        limit  # on the clamps' edges, where torch 2.14 stops the gradient and 2.13 passes it
    )
    gate_up[0, inter : inter + 2] = torch.tensor([-limit, limit])
    return gate_up


def test_swiglu_backward_is_eager_autograd(gen):
    """The op's spelled-out backward equals eager bf16 autograd bitwise, clamp edges included."""
    limit = 1.0
    gate_up = _swiglu_input(gen, limit=limit)
    grad_h = torch.randn(5, 128, generator=gen).bfloat16()
    leaf = gate_up.clone().requires_grad_()
    gate, up = leaf.chunk(2, dim=1)
    h = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    h.backward(grad_h)
    assert torch.equal(fp8._swiglu_backward(grad_h, gate_up, limit), leaf.grad)
    out, q, sf = torch.ops.prime_rl.fp8_clamped_swiglu(gate_up, limit)
    assert torch.equal(out, h.detach())
    ref_q, ref_scale = quantize_blockwise(h.detach(), 1)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert sf.shape == (1, 8) and torch.equal(sf[:, :5], ref_scale.T)


@pytest.mark.parametrize("ue8m0", [None, True])
def test_opcheck_fused_mlp_ops(gen, ue8m0):
    x = torch.randn(5, 128, generator=gen).bfloat16().requires_grad_()
    gate, up = (torch.randn(128, 128, generator=gen).bfloat16().requires_grad_() for _ in "gu")
    opcheck(torch.ops.prime_rl.fp8_gate_up_mm.default, (x, gate, up, BLOCK, ue8m0))
    gate_up = _swiglu_input(gen).requires_grad_()
    # no aot_dispatch check: it sums every output, and torch cannot sum float8 (the cast)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    opcheck(torch.ops.prime_rl.fp8_clamped_swiglu.default, (gate_up, 1.0, ue8m0), test_utils=checks)
    grad_h = torch.randn(5, 128, generator=gen).bfloat16()
    args = (grad_h, x.detach(), gate.detach(), up.detach(), gate_up.detach(), 1.0, BLOCK)
    opcheck(
        torch.ops.prime_rl.fp8_gate_up_clamped_swiglu_backward.default,
        (*args, True, True, 0, 0, ue8m0),
    )


def test_fused_mlp_ops_reject_bad_inputs():
    x, w = torch.randn(4, 128), torch.randn(128, 128)
    with pytest.raises(ValueError, match="gate_weight, up_weight \\[I, K\\] of one shape"):
        torch.ops.prime_rl.fp8_gate_up_mm(x, w, torch.randn(256, 128), BLOCK)
    with pytest.raises(ValueError, match="gate_up must be \\[T, 2I\\]"):
        torch.ops.prime_rl.fp8_clamped_swiglu(torch.randn(4, 200), 1.0)
    with pytest.raises(ValueError, match="gate_up must be fp8_gate_up_mm's output"):
        torch.ops.prime_rl.fp8_gate_up_clamped_swiglu_backward(
            torch.randn(4, 128), x, w, w, torch.randn(4, 512), 1.0, BLOCK, True, True
        )
    with pytest.raises(KeyError, match="wgrad_key=5 has no fp32 accumulator"):
        torch.ops.prime_rl.fp8_gate_up_clamped_swiglu_backward(
            torch.randn(4, 128), x, w, w, torch.randn(4, 256), 1.0, BLOCK, False, True, 0, 5
        )


# --- grouped op --------------------------------------------------------------------------------


def _grouped_case(gen, counts=(3, 0, 5)):
    x = torch.randn(sum(counts), 128, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), 128, 256, generator=gen, requires_grad=True)  # [G, K, N]
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return x, w, offsets


def test_grouped_against_exact_math(gen):
    x, w, offsets = _grouped_case(gen)
    g = torch.randn(8, 256, generator=gen)
    out = fp8.grouped_fp8_gemm(x, w, offsets)
    out.backward(g)
    start = 0
    for i, end in enumerate(offsets.tolist()):
        rows = slice(start, end)
        if end > start:
            _assert_product_bound(out[rows].detach(), x.detach()[rows], w.detach()[i].T)
            _assert_product_bound(x.grad[rows], g[rows], w.detach()[i].contiguous())
        start = end
    assert torch.all(w.grad[1] == 0)  # the empty group gets no gradient


def test_opcheck_grouped(gen):
    x, w, offsets = _grouped_case(gen)
    opcheck(torch.ops.prime_rl.grouped_fp8_gemm.default, (x, w, offsets, None))
    g = torch.randn(8, 256, generator=gen)
    args = (g, x.detach(), w.detach(), offsets, True, True, True)
    opcheck(torch.ops.prime_rl.grouped_fp8_gemm_backward.default, args)


# --- fakes -------------------------------------------------------------------------------------


def test_fakes_on_meta():
    x, w = torch.empty(9, 256, device="meta"), torch.empty(128, 256, device="meta")
    assert fp8.fp8_blockwise_mm(x, w).shape == (9, 128)
    gw = torch.empty(4, 256, 384, device="meta")
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    assert fp8.grouped_fp8_gemm(x, gw, offsets).shape == (9, 384)
    gx, gwg = torch.ops.prime_rl.grouped_fp8_gemm_backward(
        torch.empty(9, 384, device="meta"), x, gw, offsets, True, True
    )
    assert gx.shape == x.shape and gwg.shape == gw.shape


def test_fakes_on_fake_cuda_without_deep_gemm(monkeypatch):
    # Autograd on fake CUDA tensors aborts a CPU-only build, so the backward ops are called directly.
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # importing it now fails
    with FakeTensorMode():
        x = torch.empty(9, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
        out = fp8.fp8_blockwise_mm(x, w)
        assert out.shape == (9, 128) and out.device.type == "cuda"
        gx, gw = torch.ops.prime_rl.fp8_blockwise_mm_backward(out, x, w, BLOCK, True, True)
        assert gx.shape == x.shape and gw.shape == w.shape and gw.device.type == "cuda"
        ew = torch.empty(2, 256, 128, device="cuda", dtype=torch.bfloat16)
        offsets = torch.empty(2, dtype=torch.int32, device="cuda")
        out = fp8.grouped_fp8_gemm(x, ew, offsets)
        assert out.shape == (9, 128) and out.dtype == torch.bfloat16
        gx, gw = torch.ops.prime_rl.grouped_fp8_gemm_backward(out, x, ew, offsets, True, True)
        assert gx.shape == x.shape and gw.shape == ew.shape


# --- DeepGEMM adapter --------------------------------------------------------------------------


def _dequantize64(q, scale, block_rows, truncate):
    if truncate:  # SM100: only the exponent of an fp32 scale survives (mantissa truncated)
        scale = torch.ldexp(torch.ones_like(scale), torch.frexp(scale).exponent - 1)
    full = scale.double().repeat_interleave(block_rows, 0).repeat_interleave(128, 1)
    return q.double() * full[: q.shape[0], : q.shape[1]]


def _stand_in_deep_gemm(calls, truncate=False):
    """DeepGEMM's contract: d written in its own dtype (bf16 or fp32); the contiguous grouped
    kernel reads one group index per 128-row block and skips blocks marked -1; with
    ``truncate`` scales are read as UE8M0, as on SM100."""
    module = types.ModuleType("deep_gemm")

    def fp8_gemm_nt(a, b, d):
        calls.append(("fp8_gemm_nt", a, b, d))
        assert d.dtype in (torch.bfloat16, torch.float32)
        lhs = _dequantize64(*a, 1, truncate)
        d.copy_(lhs @ _dequantize64(*b, BLOCK, truncate).T)

    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout):
        calls.append(("m_grouped_fp8_gemm_nt_contiguous", a, b, d, layout))
        assert d.dtype == torch.bfloat16 and layout.shape == (a[0].shape[0],)
        for start in range(0, a[0].shape[0], 128):
            group = int(layout[start])
            if group >= 0:
                rows = slice(start, start + 128)
                lhs = _dequantize64(a[0][rows], a[1][rows], 1, truncate)
                d[rows] = lhs @ _dequantize64(b[0][group], b[1][group], BLOCK, truncate).T

    module.fp8_gemm_nt = fp8_gemm_nt
    module.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
    module.get_mk_alignment_for_contiguous_layout = lambda: 128
    return module


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_deep_gemm_adapter_writes_fp32_directly(monkeypatch, gen, out_dtype):
    calls = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in_deep_gemm(calls))
    monkeypatch.setattr(fp8, "_deep_gemm_arch", lambda device: 10)  # SM100: fp32 d
    a, sa = quantize_blockwise(torch.randn(4, 256, generator=gen), 1)
    b, sb = quantize_blockwise(torch.randn(128, 256, generator=gen), BLOCK)
    out = fp8._deep_gemm_nt(a, sa, b, sb, out_dtype)
    ((name, (ca, csa), (cb, csb), d),) = calls
    assert name == "fp8_gemm_nt" and ca is a and csa is sa and cb is b and csb is sb
    assert d.dtype == (torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
    assert out.dtype == out_dtype
    # Rounded once, from the fp32 accumulator: no bf16 round trip for fp32/fp16 outputs.
    exact = _dequantize64(a, sa, 1, False) @ _dequantize64(b, sb, BLOCK, False).T
    assert torch.equal(out, exact.to(torch.float32).to(out_dtype))


@pytest.mark.parametrize("counts", [(3, 0, 5), (128, 0, 256), (130, 1, 0, 127)])
def test_deep_gemm_grouped_adapter_pads_each_group(monkeypatch, gen, counts):
    calls = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in_deep_gemm(calls))
    monkeypatch.setattr(fp8, "_deep_gemm_arch", lambda device: 10)  # SM100: fp32 d
    a, sa = quantize_blockwise(torch.randn(sum(counts), 128, generator=gen), 1)
    qs = [quantize_blockwise(torch.randn(128, 128, generator=gen), BLOCK) for _ in counts]
    b, sb = torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = fp8._deep_gemm_grouped_nt(a, sa, b, sb, offsets, torch.bfloat16)
    ((name, (ca, _), (cb, _), d, layout),) = calls
    assert name == "m_grouped_fp8_gemm_nt_contiguous" and cb is b
    assert layout.dtype == torch.int32 and ca.shape[0] == layout.shape[0] == d.shape[0]
    assert layout.shape[0] % 128 == 0
    starts = (layout[::128] >= 0).nonzero()[:, 0] * 128  # every used block holds one group
    for s in starts.tolist():
        block = layout[s : s + 128]
        assert torch.all((block == block[0]) | (block == -1))
    ref = fp8.grouped_fp8_gemm_nt(a, sa, b, sb, offsets, torch.bfloat16)  # CPU semantics
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)


def test_deep_gemm_grouped_adapter_fp32_runs_dense_per_group(monkeypatch, gen):
    calls = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in_deep_gemm(calls))
    monkeypatch.setattr(fp8, "_deep_gemm_arch", lambda device: 10)  # SM100: fp32 d
    a, sa = quantize_blockwise(torch.randn(8, 128, generator=gen), 1)
    qs = [quantize_blockwise(torch.randn(128, 128, generator=gen), BLOCK) for _ in range(3)]
    b, sb = torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
    offsets = torch.tensor([3, 3, 8], dtype=torch.int32)
    out = fp8._deep_gemm_grouped_nt(a, sa, b, sb, offsets, torch.float32)
    assert [c[0] for c in calls] == ["fp8_gemm_nt"] * 3 and out.dtype == torch.float32
    assert all(c[3].dtype == torch.float32 for c in calls)
    ref = fp8.grouped_fp8_gemm_nt(a, sa, b, sb, offsets, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)


def test_sm100_reads_power_of_two_scales_exactly(monkeypatch, gen):
    calls = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in_deep_gemm(calls, truncate=True))
    monkeypatch.setattr(fp8, "_deep_gemm_arch", lambda device: 10)  # SM100: fp32 d
    monkeypatch.setattr(fp8, "needs_ue8m0", lambda device: True)
    x, w = torch.randn(4, 256, generator=gen) * 3, torch.randn(128, 256, generator=gen)
    a, sa = quantize_blockwise(x, 1, ue8m0=True)
    b, sb = quantize_blockwise(w, BLOCK, ue8m0=True)
    out = fp8._deep_gemm_nt(a, sa, b, sb, torch.float32)
    ref = _ref_dequantized(x, 1, True) @ _ref_dequantized(w, BLOCK, True).T
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)
    # amax/448 scales would be read up to 2x too small: refused on the device.
    a, sa = quantize_blockwise(x, 1)
    b, sb = quantize_blockwise(w, BLOCK)
    with pytest.raises(RuntimeError, match="power-of-two scales"):
        fp8._deep_gemm_nt(a, sa, b, sb, torch.float32)
    assert fp8._resolve_ue8m0(None, torch.device("cpu")) is True
    with pytest.raises(ValueError, match="ue8m0=False on cpu.*SM100"):
        fp8._resolve_ue8m0(False, torch.device("cpu"))


def test_missing_deep_gemm_gives_the_build_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    a, sa = quantize_blockwise(torch.ones(1, 128), 1)
    b, sb = quantize_blockwise(torch.ones(128, 128), BLOCK)
    with pytest.raises(
        prime_ops.BackendUnavailable, match=r"git clone.*DeepGEMM.*install\.sh"
    ) as e:
        fp8._deep_gemm_nt(a, sa, b, sb, torch.bfloat16)
    assert "prime-ops[" not in str(e.value)  # no extra installs DeepGEMM


# --- bad input ---------------------------------------------------------------------------------


def test_quantized_gemm_rejects_bad_dtypes_and_scales():
    a, sa = quantize_blockwise(torch.ones(4, 256), 1)
    b, sb = quantize_blockwise(torch.ones(128, 256), BLOCK)
    with pytest.raises(TypeError, match=r"a must be torch.float8_e4m3fn.*got torch.bfloat16"):
        fp8.fp8_gemm_nt(a.to(torch.bfloat16), sa, b, sb)
    with pytest.raises(TypeError, match="b must be torch.float8_e4m3fn"):
        fp8.fp8_gemm_nt(a, sa, b.float(), sb)
    with pytest.raises(ValueError, match=r"a_scale has shape \(4, 1\).*needs \(4, 2\)"):
        fp8.fp8_gemm_nt(a, sa[:, :1], b, sb)
    with pytest.raises(ValueError, match=r"b_scale.*128x128 weight.*needs \(1, 2\)"):
        fp8.fp8_gemm_nt(a, sa, b, sa)
    with pytest.raises(TypeError, match="a_scale must be float32"):
        fp8.fp8_gemm_nt(a, sa.double(), b, sb)


def test_dequantize_checks_the_scale_shape():
    """Issue 31: any scale shape used to be accepted (off by up to 445)."""
    q, scale = quantize_blockwise(torch.randn(4, 256), 1)
    ref = q.float() * scale.repeat_interleave(128, 1)  # one fp32 product per element
    assert torch.equal(fp8.dequantize_blockwise(q, scale), ref)
    msg = r"scale has shape \(3, 5\) but q \(4, 256\) needs \(4, 2\) .* or \(1, 2\)"
    with pytest.raises(ValueError, match=msg):
        fp8.dequantize_blockwise(q, torch.ones(3, 5))
    with pytest.raises(TypeError, match="scale must be float32"):
        fp8.dequantize_blockwise(q, scale.double())
    with pytest.raises(TypeError, match="q must be torch.float8_e4m3fn"):
        fp8.dequantize_blockwise(q.float(), scale)


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.float64, torch.float8_e4m3fn])
def test_gemms_refuse_out_dtypes_they_cannot_write_exactly(out_dtype):
    """Issue 31: out_dtype=torch.int32 used to return a truncated int32 product."""
    a, sa = quantize_blockwise(torch.ones(4, 128), 1)
    b, sb = quantize_blockwise(torch.ones(128, 128), BLOCK)
    msg = f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32 .*got {out_dtype}"
    with pytest.raises(TypeError, match=msg):
        fp8.fp8_gemm_nt(a, sa, b, sb, out_dtype=out_dtype)
    offsets = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(TypeError, match=msg):
        fp8.grouped_fp8_gemm_nt(a, sa, b[None], sb[None], offsets, out_dtype)
    with pytest.raises(TypeError, match=msg):
        fp8.fp8_blockwise_mm(torch.ones(4, 128), torch.ones(128, 128), out_dtype=out_dtype)


def test_ops_reject_bad_inputs():
    x, w = torch.randn(4, 256), torch.randn(128, 256)
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32.*fp8_gemm_nt"):
        fp8.fp8_blockwise_mm(x.to(FP8_DTYPE), w)
    with pytest.raises(ValueError, match="K .* is 200, not a multiple of 128"):
        fp8.fp8_blockwise_mm(torch.randn(4, 200), torch.randn(128, 200))
    with pytest.raises(ValueError, match="N .* is 100"):
        fp8.fp8_blockwise_mm(x, torch.randn(100, 256))
    with pytest.raises(ValueError, match="same K"):
        fp8.fp8_blockwise_mm(x, torch.randn(128, 128))


def test_missing_tensors_and_zero_groups_are_named():
    """Issue 37's bad-input sweep: x=None was an AttributeError, 0 groups an IndexError."""
    w = torch.randn(128, 256)
    with pytest.raises(TypeError, match="fp8_blockwise_mm: x must be a tensor, got NoneType"):
        fp8.fp8_blockwise_mm(None, w)
    with pytest.raises(TypeError, match="fp8_blockwise_mm: x must be a tensor, got NoneType"):
        torch.ops.prime_rl.fp8_blockwise_mm(None, w, 128)
    with pytest.raises(TypeError, match="weight must be a tensor, got list"):
        fp8.fp8_blockwise_mm(torch.randn(4, 256), [[1.0]])
    empty = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="weight has 0 groups.*at least one"):
        fp8.grouped_fp8_gemm(torch.randn(4, 128), torch.randn(0, 128, 128), empty)
    a, sa = quantize_blockwise(torch.randn(4, 128), 1)
    b = torch.zeros(0, 128, 128, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="b has 0 groups"):
        fp8.grouped_fp8_gemm_nt(a, sa, b, torch.zeros(0, 1, 1), empty)


def test_ops_refuse_mixed_devices():
    x, w = torch.randn(6, 128), torch.randn(3, 128, 128)
    offsets = torch.tensor([2, 4, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="one device, got x on cpu, weight on cpu, offs on meta"):
        fp8.grouped_fp8_gemm(x, w, offsets.to("meta"))
    with pytest.raises(ValueError, match="one device, got x on cpu, weight on meta"):
        fp8.fp8_blockwise_mm(x, w[0].to("meta"))
    with pytest.raises(ValueError, match="one device"):
        torch.ops.prime_rl.grouped_fp8_gemm_backward(x, x, w, offsets.to("meta"), True, True)


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([4, 2, 6], "non-decreasing"),
        ([2, 4, 5], "finish at the row count of x \\(6\\)"),
        ([2, 4, 7], "finish at the row count"),
    ],
)
def test_grouped_rejects_bad_offsets(offsets, match):
    x, w = torch.randn(6, 128), torch.randn(3, 128, 128)
    with pytest.raises(ValueError, match=match):
        fp8.grouped_fp8_gemm(x, w, torch.tensor(offsets, dtype=torch.int32))


def test_grouped_rejects_bad_offset_tensors():
    x, w = torch.randn(6, 128), torch.randn(3, 128, 128)
    with pytest.raises(ValueError, match="1-D int32 tensor of 3"):
        fp8.grouped_fp8_gemm(x, w, torch.tensor([2, 4, 6]))  # int64
    with pytest.raises(ValueError, match="1-D int32 tensor of 3"):
        fp8.grouped_fp8_gemm(x, w, torch.tensor([6], dtype=torch.int32))


# --- prime_ac ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8_blockwise_mm", "grouped_fp8_gemm"])
def test_prime_ac_keeps_fp8_gemms_in_selective_only(name):
    from torch.utils.checkpoint import CheckpointPolicy

    import prime_ac

    op = getattr(torch.ops.prime_rl, name).default
    assert prime_ac.make_policy("selective")(None, op) == CheckpointPolicy.MUST_SAVE
    assert prime_ac.make_policy("full")(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


class _Block(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(128, 128, generator=gen) / 16)

    def forward(self, x):
        # gelu's backward reads the GEMM's result, so no AC holds it too and selective keeping it
        # holds no more than no AC (prime_ac drops kept results no backward reads only above that)
        return torch.nn.functional.gelu(fp8.fp8_blockwise_mm(x, self.weight))


class _Blocks(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(gen) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(("mode", "gemms"), [("selective", 6), ("full", 8)])
def test_prime_ac_recompute_of_fp8_gemm(monkeypatch, gen, mode, gemms):
    import prime_ac

    model, x = _Blocks(gen), torch.randn(4, 128, generator=gen, requires_grad=True)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    prime_ac.checkpoint_blocks(model, mode=mode, blocks="layers")
    calls = []
    real = fp8.fp8_gemm_nt
    monkeypatch.setattr(fp8, "fp8_gemm_nt", lambda *a: calls.append(1) or real(*a))
    model(x).sum().backward()
    # Per block: one forward GEMM, two backward GEMMs, plus a forward replay in full mode.
    assert len(calls) == gemms
    for p, ref in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, ref)


def test_power_of_two_check_lets_non_finite_scales_through(monkeypatch):
    """On SM100 a block holding inf or NaN has a non-finite scale and gives NaN products; the
    device-side check must not fire on it (a failed CUDA assert leaves the context unusable)."""
    monkeypatch.setattr(fp8, "needs_ue8m0", lambda device: True)
    cpu = torch.device("cpu")  # torch._assert_async raises at once on the CPU
    fp8._check_power_of_two(cpu, torch.tensor([0.5, 2.0**-20, float("inf"), float("nan")]))
    with pytest.raises(RuntimeError, match="power-of-two scales"):
        fp8._check_power_of_two(cpu, torch.tensor([0.75, float("inf")]))
