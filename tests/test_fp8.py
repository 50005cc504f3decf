"""prime_rl::fp8_blockwise_mm and prime_rl::grouped_fp8_gemm: CPU kernels, fakes, DeepGEMM adapter."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import prime_ops
from prime_ops import fp8
from prime_ops.fp8 import BLOCK, FP8_DTYPE, dequantize_blockwise, quantize_blockwise


def _dq(t, block_rows):
    return dequantize_blockwise(*quantize_blockwise(t, block_rows))


def _pad_rows(t):
    return torch.nn.functional.pad(t, (0, 0, 0, (-t.shape[0]) % BLOCK))


def _fp8_mm_reference(a, b):
    """a @ b.T with a quantized 1x128 and b 128x128, dequantized, in fp32."""
    return _dq(a, 1) @ _dq(b, BLOCK).T


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# --- quantization ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_rows", [1, BLOCK])
def test_quantize_layout_and_round_trip(gen, block_rows):
    t = torch.randn(130, 300, generator=gen) * 5
    q, scale = quantize_blockwise(t, block_rows)
    assert q.dtype == FP8_DTYPE and q.shape == t.shape
    rows = 130 if block_rows == 1 else 2
    assert scale.shape == (rows, 3) and scale.dtype == torch.float32
    # The largest magnitude of each block maps to the top of the e4m3 range.
    assert torch.allclose(q.float().abs().amax(), torch.tensor(448.0))
    back = dequantize_blockwise(q, scale)
    assert (back - t).abs().max() <= 0.07 * t.abs().max()


def test_quantize_rejects_bad_block():
    with pytest.raises(ValueError, match="block_rows must be 1 or 128"):
        quantize_blockwise(torch.ones(4, 128), 64)


# --- dense op ----------------------------------------------------------------------------------


def test_forward_is_the_dequantized_product(gen):
    x, w = torch.randn(7, 256, generator=gen), torch.randn(384, 256, generator=gen)
    out = fp8.fp8_blockwise_mm(x, w)
    torch.testing.assert_close(out, _fp8_mm_reference(x, w), rtol=1e-5, atol=1e-5)
    assert (out - x @ w.T).abs().max() < 0.1 * (x @ w.T).abs().max()


def test_front_keeps_leading_dims(gen):
    x, w = torch.randn(2, 3, 128, generator=gen), torch.randn(128, 128, generator=gen)
    out = fp8.fp8_blockwise_mm(x, w)
    assert out.shape == (2, 3, 128)
    torch.testing.assert_close(out.view(6, 128), fp8.fp8_blockwise_mm(x.view(6, 128), w))


def test_backward_quantizes_each_product(gen):
    x = torch.randn(5, 256, generator=gen, requires_grad=True)
    w = torch.randn(128, 256, generator=gen, requires_grad=True)
    g = torch.randn(5, 128, generator=gen)
    fp8.fp8_blockwise_mm(x, w).backward(g)
    grad_x = _fp8_mm_reference(g, w.detach().T.contiguous())
    grad_w = _fp8_mm_reference(_pad_rows(g).T.contiguous(), _pad_rows(x.detach()).T.contiguous())
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, grad_w, rtol=1e-5, atol=1e-5)
    # ... and they stay close to the exact gradients.
    assert (x.grad - g @ w.detach()).abs().max() < 0.1 * (g @ w.detach()).abs().max()
    exact_w = g.T @ x.detach()
    assert (w.grad - exact_w).abs().max() < 0.1 * exact_w.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_dense(gen, dtype):
    x = torch.randn(3, 128, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(256, 128, generator=gen).to(dtype).requires_grad_()
    opcheck(torch.ops.prime_rl.fp8_blockwise_mm.default, (x, w))
    g = torch.randn(3, 256, generator=gen).to(dtype)
    opcheck(torch.ops.prime_rl.fp8_blockwise_mm_backward.default, (g, x.detach(), w.detach()))


# --- grouped op --------------------------------------------------------------------------------


def _grouped_case(gen, counts=(3, 0, 5)):
    x = torch.randn(sum(counts), 128, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), 256, 128, generator=gen, requires_grad=True)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return x, w, offsets


def test_grouped_matches_per_group_dense(gen):
    x, w, offsets = _grouped_case(gen)
    g = torch.randn(8, 256, generator=gen)
    fp8.grouped_fp8_gemm(x, w, offsets).backward(g)
    ref_x = x.detach().clone().requires_grad_()
    ref_w = w.detach().clone().requires_grad_()
    parts, start = [], 0
    for i, end in enumerate(offsets.tolist()):
        parts.append(fp8.fp8_blockwise_mm(ref_x[start:end], ref_w[i]))
        start = end
    torch.cat(parts).backward(g)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-5, atol=1e-5)
    assert torch.all(w.grad[1] == 0)  # the empty group gets no gradient


def test_opcheck_grouped(gen):
    x, w, offsets = _grouped_case(gen)
    opcheck(torch.ops.prime_rl.grouped_fp8_gemm.default, (x, w, offsets))
    g = torch.randn(8, 256, generator=gen)
    args = (g, x.detach(), w.detach(), offsets)
    opcheck(torch.ops.prime_rl.grouped_fp8_gemm_backward.default, args)


# --- fakes -------------------------------------------------------------------------------------


def test_fakes_on_meta():
    x, w = torch.empty(9, 256, device="meta"), torch.empty(128, 256, device="meta")
    assert fp8.fp8_blockwise_mm(x, w).shape == (9, 128)
    gw = torch.empty(4, 384, 256, device="meta")
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    assert fp8.grouped_fp8_gemm(x, gw, offsets).shape == (9, 384)
    gx, gwg = torch.ops.prime_rl.grouped_fp8_gemm_backward(
        torch.empty(9, 384, device="meta"), x, gw, offsets
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
        gx, gw = torch.ops.prime_rl.fp8_blockwise_mm_backward(out, x, w)
        assert gx.shape == x.shape and gw.shape == w.shape and gw.device.type == "cuda"
        ew = torch.empty(2, 128, 256, device="cuda", dtype=torch.bfloat16)
        offsets = torch.empty(2, dtype=torch.int32, device="cuda")
        out = fp8.grouped_fp8_gemm(x, ew, offsets)
        assert out.shape == (9, 128) and out.dtype == torch.bfloat16
        gx, gw = torch.ops.prime_rl.grouped_fp8_gemm_backward(out, x, ew, offsets)
        assert gx.shape == x.shape and gw.shape == ew.shape


# --- DeepGEMM adapter --------------------------------------------------------------------------


def _stand_in_deep_gemm(calls):
    """Records each call and writes the reference result into ``d``, as DeepGEMM would."""
    module = types.ModuleType("deep_gemm")

    def fp8_gemm_nt(a, b, d):
        calls.append(("fp8_gemm_nt", a, b, d))
        d.copy_(dequantize_blockwise(*a) @ dequantize_blockwise(*b).T)

    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout):
        calls.append(("m_grouped_fp8_gemm_nt_contiguous", a, b, d, layout))
        for row, group in enumerate(layout.tolist()):
            lhs = dequantize_blockwise(a[0][row : row + 1], a[1][row : row + 1])
            d[row] = (lhs @ dequantize_blockwise(b[0][group], b[1][group]).T)[0]

    module.fp8_gemm_nt = fp8_gemm_nt
    module.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
    return module


def test_deep_gemm_adapter_exact_call(monkeypatch, gen):
    calls = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in_deep_gemm(calls))
    a, sa = quantize_blockwise(torch.randn(4, 256, generator=gen), 1)
    b, sb = quantize_blockwise(torch.randn(128, 256, generator=gen), BLOCK)
    out = fp8._deep_gemm_nt(a, sa, b, sb, torch.float32)
    ((name, (ca, csa), (cb, csb), d),) = calls
    assert name == "fp8_gemm_nt"
    assert ca is a and csa is sa and cb is b and csb is sb
    assert d.shape == (4, 128) and d.dtype == torch.bfloat16
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, d.float())


def test_deep_gemm_grouped_adapter_exact_call(monkeypatch, gen):
    calls = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in_deep_gemm(calls))
    a, sa = quantize_blockwise(torch.randn(6, 128, generator=gen), 1)
    qs = [quantize_blockwise(torch.randn(128, 128, generator=gen), BLOCK) for _ in range(3)]
    b, sb = torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32)
    out = fp8._deep_gemm_grouped_nt(a, sa, b, sb, offsets, torch.bfloat16)
    ((name, (ca, _), (cb, _), d, layout),) = calls
    assert name == "m_grouped_fp8_gemm_nt_contiguous" and ca is a and cb is b
    assert layout.dtype == torch.int32 and layout.tolist() == [0, 0, 2, 2, 2, 2]
    assert d.shape == (6, 128) and d.dtype == torch.bfloat16
    ref = fp8.grouped_fp8_gemm_nt(a, sa, b, sb, offsets, torch.bfloat16)
    torch.testing.assert_close(out, ref)


def test_missing_deep_gemm_names_extra_and_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    a, sa = quantize_blockwise(torch.ones(1, 128), 1)
    b, sb = quantize_blockwise(torch.ones(128, 128), BLOCK)
    with pytest.raises(prime_ops.BackendUnavailable, match=r"prime-ops\[deepgemm\].*install\.sh"):
        fp8._deep_gemm_nt(a, sa, b, sb, torch.bfloat16)


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
        return torch.relu(fp8.fp8_blockwise_mm(x, self.weight))


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
