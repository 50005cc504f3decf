"""Sparse MLA (Triton, FlashMLA) and the torchao MXFP8 cast on CUDA against the CPU references."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from prime_ops.attn import sparse_mla
from prime_ops.mxfp8 import _torchao_quantize, quantize_mx

pytestmark = pytest.mark.gpu


def _needs(module: str, min_capability: tuple[int, int] = (8, 0)):
    missing = importlib.util.find_spec(module.split(".")[0]) is None
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability() >= min_capability
    return pytest.mark.skipif(missing or not ok, reason=f"needs {module} on sm{min_capability}")


def _inputs(t, hq, d, s, topk, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g).to(dtype) / 4
    kv = torch.randn(s, 1, d, generator=g).to(dtype) / 4
    idx = torch.randint(-1, s + 2, (t, 1, topk), generator=g, dtype=torch.int32)
    idx[0] = -1  # a query with no valid index
    idx[1, 0, : topk // 2] = 5  # duplicates
    return q, kv, idx


def _close(got, ref, rel):
    err = (got.float().cpu() - ref.float()).abs().max()
    assert err <= rel * ref.float().abs().max(), f"max error {err}"


def _run(backend, q, kv, idx, d_v, dout):
    q, kv = (t.detach().clone().requires_grad_() for t in (q, kv))
    out, lse = sparse_mla(q, kv, idx, d_v=d_v, backend=backend)
    out.backward(dout)
    return out, lse, q.grad, kv.grad


@pytest.mark.parametrize(
    "backend", ["triton", pytest.param("flashmla", marks=_needs("flash_mla", (9, 0)))]
)
@_needs("triton")
def test_sparse_mla_cuda_matches_reference(backend):
    q, kv, idx = _inputs(t=70, hq=64, d=576, s=300, topk=256)
    dout = torch.randn(70, 64, 512).bfloat16()
    ref = _run("reference", q.float(), kv.float(), idx, 512, dout.float())
    got = _run(backend, q.cuda(), kv.cuda(), idx.cuda(), 512, dout.cuda())
    _close(got[0], ref[0], 0.02)
    lse, ref_lse = got[1].cpu(), ref[1]
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())  # -inf for the lonely query
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-3)
    for g, r in zip(got[2:], ref[2:], strict=True):
        _close(g, r, 0.03)


@_needs("torchao", (8, 9))  # fp8 conversions need sm89+
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_torchao_cast_matches_reference_bitwise(rule):
    if rule == "rceil" and torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("torchao's rceil cast uses an sm100 conversion instruction")
    x = (torch.randn(512, 1024) * torch.logspace(-4, 4, 512)[:, None]).bfloat16()
    data, scale = _torchao_quantize(x.cuda(), rule)
    ref_data, ref_scale = quantize_mx(x, rule)
    assert torch.equal(scale.cpu().view(torch.uint8), ref_scale.view(torch.uint8))
    assert torch.equal(data.cpu().view(torch.uint8), ref_data.view(torch.uint8))
