"""prime_ops' FP8 paths against DeepGEMM's host asserts, on SM90 and SM100, without DeepGEMM.

DeepGEMM (deepseek-ai/DeepGEMM; csrc/apis/gemm.hpp @ 0274ad7b911b, csrc/utils/layout.hpp @
057ca5964aae, sm90_fp8_gemm_1d2d.hpp @ 0fcd03c00404, sm90_fp8_gemm_1d1d.hpp @ 1fab197d601a,
sm100_fp8_fp4_gemm_1d1d.hpp @ 057ca5964aae) has nothing installable, so its asserts are data
(tests/libraries/deepgemm_asserts.py) and a stand-in module enforces them. Each op runs through the
stand-in with the device capability patched and CPU tensors routed to the DeepGEMM adapter; the
result must equal the CPU kernels' (what prime_ops defines) within the output dtype's rounding.
No library is needed: this runs in .venv-test and .venv-libs alike.
"""

from __future__ import annotations

import inspect
import re
import sys

import pytest
import torch

from prime_ops import fp8
from prime_ops.fp8 import BLOCK, quantize_blockwise
from tests.libraries.deepgemm_asserts import ASSERTS, DeepGEMMHostAssert, StandInDeepGEMM

ARCHES = {"sm90": 9, "sm100": 10}
TOLERANCE = {  # the output dtype's rounding (the stand-in sums in float64, the CPU kernel in fp32)
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
    torch.float16: {"rtol": 2e-3, "atol": 1e-3},
    torch.float32: {"rtol": 1e-5, "atol": 1e-4},
}


@pytest.fixture(params=list(ARCHES), ids=list(ARCHES))
def on_gpu(request, monkeypatch):
    """``on_gpu()`` from here on runs prime_ops' DeepGEMM adapter on the stand-in of this arch."""
    arch = ARCHES[request.param]
    stand_in = StandInDeepGEMM(arch)

    def install():
        monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
        monkeypatch.setattr(fp8, "_uses_deep_gemm", lambda device: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (arch, 0))
        return stand_in

    install.arch = arch
    return install


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _dense_case(dtype, seed=0):
    gen = _gen(seed)
    x = torch.randn(3, 5, 256, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(384, 256, generator=gen) / 16).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 384, generator=gen)
    return x, w, grad


def _run_dense(x, w, grad, out_dtype, ue8m0):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = fp8.fp8_blockwise_mm(x, w, ue8m0=ue8m0, out_dtype=out_dtype)
    out.backward(grad.to(out.dtype))
    return out.detach(), x.grad, w.grad


# --- the stand-in enforces what DeepGEMM asserts --------------------------------------------


def test_records_name_file_and_commit():
    """Every record is one of the DeepGEMM files above at a 40-digit commit, and the stand-in
    raises it somewhere (it is not just listed)."""
    source = inspect.getsource(StandInDeepGEMM)
    for key, record in ASSERTS.items():
        file, commit = record.source
        assert file.startswith("csrc/") and file.endswith(".hpp"), key
        assert re.fullmatch(r"[0-9a-f]{40}", commit), key
        assert f'"{key}"' in source, f"{key} is recorded but never enforced"


def _quantized(m=4, n=128, k=256, seed=0):
    gen = _gen(seed)
    a, sa = quantize_blockwise(torch.randn(m, k, generator=gen), 1)
    b, sb = quantize_blockwise(torch.randn(n, k, generator=gen), BLOCK)
    return a, sa, b, sb


def test_sm90_refuses_an_fp32_d_from_the_128x128_kernel():
    """sm90_fp8_gemm_1d2d.hpp @ 0fcd03c00404: ``not c.has_value() and d == kBFloat16``; the 1d1d
    kernel (1x128 scales for b, recipe (1, 1, 128)) asserts ``c.has_value() and d == kFloat``.
    SM100 takes an fp32 d. This is the call prime_ops made on SM90 before (issue 36)."""
    a, sa, b, sb = _quantized()
    d = torch.empty(4, 128)
    with pytest.raises(DeepGEMMHostAssert, match=r"\[sm90_1d2d_bf16\].*sm90_fp8_gemm_1d2d\.hpp"):
        StandInDeepGEMM(9).fp8_gemm_nt((a, sa), (b, sb), d)
    rows = sb.repeat_interleave(BLOCK, 0)
    with pytest.raises(DeepGEMMHostAssert, match=r"\[sm90_1d1d_accumulates\]"):
        StandInDeepGEMM(9).fp8_gemm_nt((a, sa), (b, rows), d, recipe=(1, 1, 128))
    with pytest.raises(DeepGEMMHostAssert, match=r"\[sm90_1d1d_accumulates\]"):
        StandInDeepGEMM(9).fp8_gemm_nt(
            (a, sa), (b, rows), d.bfloat16(), c=d.bfloat16(), recipe=(1, 1, 128)
        )
    StandInDeepGEMM(10).fp8_gemm_nt((a, sa), (b, sb), d)  # SM100: accepted
    d.zero_()
    StandInDeepGEMM(9).fp8_gemm_nt((a, sa), (b, rows), d, c=d, recipe=(1, 1, 128))
    expected = fp8.fp8_gemm_nt(a, sa, b, sb, torch.float32)  # the CPU kernel
    torch.testing.assert_close(d, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_sm90_adapter_never_asks_1d2d_for_fp32(monkeypatch, out_dtype):
    """Issue 36: prime_ops' adapter asked SM90 for an fp32 d with 128x128 weight scales (every
    fp32 accumulation, fp32 / fp16 backward and out_dtype), which sm90_fp8_gemm_1d2d.hpp @
    0fcd03c00404 refuses. Patches only what the adapter reads (the module and the capability),
    so the same test runs against older prime_ops."""
    stand_in = StandInDeepGEMM(9)
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    a, sa, b, sb = _quantized(m=130, n=256, k=384)
    out = fp8._deep_gemm_nt(a, sa, b, sb, out_dtype)
    assert out.dtype == out_dtype
    torch.testing.assert_close(
        out, fp8.fp8_gemm_nt(a, sa, b, sb, out_dtype), **TOLERANCE[out_dtype]
    )
    assert [c.kernel for c in stand_in.calls] == ["sm90_fp8_gemm_1d1d"]


@pytest.mark.parametrize(
    ("key", "call"),
    [
        ("nt_d_dtype", lambda g, a, sa, b, sb: g.fp8_gemm_nt((a, sa), (b, sb), torch.empty(4, 128).half())),
        ("c_dtype", lambda g, a, sa, b, sb: g.fp8_gemm_nt((a, sa), (b, sb), torch.empty(4, 128), c=torch.empty(4, 128).bfloat16())),
        ("nt_shapes", lambda g, a, sa, b, sb: g.fp8_gemm_nt((a, sa), (b, sb), torch.empty(4, 256).bfloat16())),
        ("sf_mn", lambda g, a, sa, b, sb: g.fp8_gemm_nt((a, sa), (b, sb), torch.empty(4, 128).bfloat16(), recipe=(1, 1, 128))),
        ("sm90_fp32_scales", lambda g, a, sa, b, sb: g.fp8_gemm_nt((a, sa), (b, sb.int()), torch.empty(4, 128).bfloat16())),
        ("cd_n_major", lambda g, a, sa, b, sb: g.fp8_gemm_nt((a, sa), (b, sb), torch.empty(128, 4).bfloat16().T)),
        ("grouped_d_bf16", lambda g, a, sa, b, sb: g.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b[None], sb[None]), torch.empty(4, 128), torch.zeros(4, dtype=torch.int32))),
        ("grouped_sizes", lambda g, a, sa, b, sb: g.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b[None][:0], sb[None][:0]), torch.empty(4, 128).bfloat16(), torch.zeros(4, dtype=torch.int32))),
        ("grouped_layout_rows", lambda g, a, sa, b, sb: g.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b[None], sb[None]), torch.empty(4, 128).bfloat16(), torch.zeros(1, dtype=torch.int32))),
    ],
)  # fmt: skip
def test_stand_in_raises_each_assert(key, call):
    """The stand-in's checks fire as DeepGEMM's (gemm.hpp @ 0274ad7b911b, layout.hpp @
    057ca5964aae), naming the record."""
    with pytest.raises(DeepGEMMHostAssert, match=rf"\[{key}\]"):
        call(StandInDeepGEMM(9), *_quantized())


# --- prime_ops' paths on each architecture ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_dense_forward_and_backward(on_gpu, dtype, out_dtype):
    """fp8_blockwise_mm(out_dtype=...) and its backward for bf16 / fp16 / fp32 inputs: every
    DeepGEMM call passes the recorded asserts (SM90: gemm.hpp @ 0274ad7b911b dispatch,
    sm90_fp8_gemm_1d2d.hpp @ 0fcd03c00404, sm90_fp8_gemm_1d1d.hpp @ 1fab197d601a; SM100:
    sm100_fp8_fp4_gemm_1d1d.hpp @ 057ca5964aae) and the results are the CPU kernels'."""
    ue8m0 = on_gpu.arch >= 10
    x, w, grad = _dense_case(dtype)
    expected = _run_dense(x, w, grad, out_dtype, ue8m0)  # CPU kernels: prime_ops' semantics
    stand_in = on_gpu()
    got = _run_dense(x, w, grad, out_dtype, None)  # ue8m0=None: what the device needs
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, **TOLERANCE[g.dtype])
    fp32_writes = [c for c in stand_in.calls if c.d_dtype == torch.float32]
    if on_gpu.arch == 9:  # fp32 only from the accumulating kernel
        assert all(c.kernel == "sm90_fp8_gemm_1d1d" and c.accumulates for c in fp32_writes)
    wants_fp32 = dtype != torch.bfloat16 or out_dtype not in (None, torch.bfloat16)
    assert bool(fp32_writes) == wants_fp32


def test_sm90_and_sm100_agree_within_fp8_rounding(monkeypatch):
    """The same call on both architectures: each within FP8's error of the exact product, and
    the SM90 fp32 result equals the CPU kernel's fp32 result (the 1x128-expanded weight scales
    are the 128x128 ones)."""
    x, w, grad = _dense_case(torch.float32, seed=3)
    exact = x.detach().double().flatten(0, 1) @ w.detach().double().T
    results = {}
    for name, arch in ARCHES.items():
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "deep_gemm", StandInDeepGEMM(arch))
            m.setattr(fp8, "_uses_deep_gemm", lambda device: True)
            m.setattr(torch.cuda, "get_device_capability", lambda device=None, a=arch: (a, 0))
            results[name] = fp8.fp8_blockwise_mm(x.detach(), w.detach()).flatten(0, 1)
    for out in results.values():
        assert ((out.double() - exact).norm() / exact.norm()).item() < 0.05
    cpu = fp8.fp8_blockwise_mm(x.detach(), w.detach()).flatten(0, 1)
    torch.testing.assert_close(results["sm90"], cpu, **TOLERANCE[torch.float32])


def test_fp32_weight_gradient_accumulation(on_gpu):
    """accumulate_wgrad_fp32 on each architecture; on SM90 the weight gradient is added in the
    kernel, DeepGEMM's own wgrad recipe: fp8_gemm_nt(..., d=buffer, c=buffer, recipe=(1, 1, 128))
    (sm90_fp8_gemm_1d1d.hpp @ 1fab197d601a), never an fp32 d from the 1d2d kernel."""
    ue8m0 = on_gpu.arch >= 10
    x, w, grad = _dense_case(torch.bfloat16, seed=1)
    buffers = []
    for install in (lambda: None, on_gpu):
        stand_in = install()
        buffer = torch.zeros(w.shape)
        key = id(buffer)
        fp8.accumulate_wgrad_fp32(key, lambda b=buffer: b)
        try:
            for _ in range(2):  # two micro-batches
                wi = w.detach().requires_grad_()
                out = fp8.fp8_blockwise_mm(x.detach(), wi, wgrad_key=key, ue8m0=ue8m0)
                out.backward(grad.bfloat16())
                assert wi.grad is None
        finally:
            fp8.accumulate_wgrad_fp32(key, None)
        buffers.append(buffer)
    cpu, gpu = buffers
    assert cpu.abs().sum() > 0
    torch.testing.assert_close(gpu, cpu, **TOLERANCE[torch.float32])
    if on_gpu.arch == 9:
        accumulating = [c for c in stand_in.calls if c.accumulates]
        assert len(accumulating) == 2 and all(c.recipe == (1, 1, 128) for c in accumulating)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_forward_and_backward(on_gpu, dtype):
    """grouped_fp8_gemm with bf16 inputs uses m_grouped_fp8_gemm_nt_contiguous (bf16 d only,
    gemm.hpp @ 0274ad7b911b); other dtypes run one fp8_gemm_nt per group, which on SM90 writes
    fp32 through the 1d1d kernel. Empty groups included."""
    ue8m0 = on_gpu.arch >= 10
    gen = _gen(2)
    counts = (130, 0, 5)
    x = torch.randn(sum(counts), 128, generator=gen).to(dtype)
    w = (torch.randn(3, 128, 256, generator=gen) / 8).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    grad = torch.randn(sum(counts), 256, generator=gen).to(dtype)

    def run(ue8m0):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fp8.grouped_fp8_gemm(xi, wi, offs, ue8m0=ue8m0)
        out.backward(grad)
        return out.detach(), xi.grad, wi.grad

    expected = run(ue8m0)
    stand_in = on_gpu()
    got = run(None)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype == dtype
        torch.testing.assert_close(g, e, **TOLERANCE[dtype])
    apis = {c.api for c in stand_in.calls}
    assert ("m_grouped_fp8_gemm_nt_contiguous" in apis) == (dtype == torch.bfloat16)


def test_architecture_is_read_from_the_tensors_device(monkeypatch):
    """The capability asked for is that of the tensor's own device, not the current device."""
    asked = []
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0)
    )
    device = torch.device("cuda", 3)
    assert fp8._deep_gemm_arch(device) == 9 and asked == [device]
    assert not fp8.needs_ue8m0(device) and not fp8.needs_ue8m0(torch.device("cpu"))


def test_fused_swiglu_mlp_backward(on_gpu):
    """prime_rl::fp8_gate_up_clamped_swiglu_backward with an fp32 accumulator on the gate weight
    and a bf16 gradient for the up weight: on SM90 the accumulation is the 1d1d kernel's
    (sm90_fp8_gemm_1d1d.hpp @ 1fab197d601a), the bf16 products the 1d2d kernel's."""
    ue8m0 = on_gpu.arch >= 10
    gen = _gen(4)
    x = torch.randn(7, 256, generator=gen).bfloat16()
    gate, up = ((torch.randn(128, 256, generator=gen) / 8).bfloat16() for _ in "gu")
    gate_up = torch.ops.prime_rl.fp8_gate_up_mm(x, gate, up, BLOCK, ue8m0)
    grad_h = torch.randn(7, 128, generator=gen).bfloat16()
    results = []
    for install, scales in ((lambda: None, ue8m0), (on_gpu, None)):  # None: the device's
        stand_in = install()
        buffer = torch.zeros(gate.shape)
        fp8.accumulate_wgrad_fp32(id(buffer), lambda b=buffer: b)
        try:
            grad_x, grad_gate, grad_up = torch.ops.prime_rl.fp8_gate_up_clamped_swiglu_backward(
                grad_h, x, gate, up, gate_up, 1.0, BLOCK, True, True, id(buffer), 0, scales
            )
        finally:
            fp8.accumulate_wgrad_fp32(id(buffer), None)
        assert grad_gate.numel() == 0
        results.append((grad_x, grad_up, buffer))
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, **TOLERANCE[got.dtype])
    if on_gpu.arch == 9:
        assert [c.kernel for c in stand_in.calls if c.accumulates] == ["sm90_fp8_gemm_1d1d"]
