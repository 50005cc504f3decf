"""The CUDA kernels of csrc/ against the CPU kernels (needs CUDA, a CUDA torch and nvcc)."""

from __future__ import annotations

import shutil

import pytest
import torch

from prime_ops import native
from prime_ops.native import build as native_build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or shutil.which("nvcc") is None
        or not native_build.torch_supported(),
        reason="needs a CUDA device, a CUDA build of torch >= 2.10 and nvcc",
    ),
]


@pytest.fixture(scope="module", autouse=True)
def cuda_library():
    return native_build.build(cuda=True)


@pytest.mark.parametrize("alignment", [1, 128])
def test_permute_and_unpermute_match_cpu(alignment):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 256, generator=gen).bfloat16()
    idx = torch.rand(1000, 64, generator=gen).topk(8, dim=1).indices
    idx[::7, 3] = -1
    w = torch.rand(1000, 8, generator=gen)
    cpu = native.moe_permute(x, idx, 64, alignment)
    gpu = native.moe_permute(x.cuda(), idx.cuda(), 64, alignment)
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b.cpu())  # a layout, computed exactly on both
    y = torch.randn(cpu[0].shape, generator=gen, requires_grad=True)
    wc = w.clone().requires_grad_()
    out = native.moe_unpermute(y, cpu[1], wc)
    yg, wg = y.detach().cuda().requires_grad_(), w.cuda().requires_grad_()
    out_g = native.moe_unpermute(yg, gpu[1], wg)
    torch.testing.assert_close(out_g.cpu(), out)
    g = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (y, wc), g)
    grads_g = torch.autograd.grad(out_g, (yg, wg), g.cuda())
    for a, b in zip(grads, grads_g, strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-4)
    # deterministic: a second call gives the same bits
    assert torch.equal(native.moe_unpermute(yg, gpu[1], wg), out_g)


def test_merge_matches_cpu():
    gen = torch.Generator().manual_seed(1)
    states = [torch.randn(300, 8, 128, generator=gen), torch.randn(8, 300, generator=gen)]
    states += [torch.randn(300, 8, 128, generator=gen), torch.randn(8, 300, generator=gen)]
    states[1][0, :10] = float("-inf")
    states[3][0, 5:20] = float("-inf")
    cpu = [t.clone().requires_grad_() for t in states]
    gpu = [t.cuda().requires_grad_() for t in states]
    out, lse = native.merge_attn_states(*cpu)
    out_g, lse_g = native.merge_attn_states(*gpu)
    torch.testing.assert_close(out_g.cpu(), out)
    torch.testing.assert_close(lse_g.cpu(), lse)
    g = torch.randn(out.shape, generator=gen)
    for a, b in zip(
        torch.autograd.grad(out, cpu, g), torch.autograd.grad(out_g, gpu, g.cuda()), strict=True
    ):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_quantize_matches_cpu_bitwise(block_rows, scale_format):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(700, 1000, generator=gen) * 30).bfloat16()
    q, s = native.quantize_fp8_blockwise(x, block_rows, scale_format)
    q_g, s_g = native.quantize_fp8_blockwise(x.cuda(), block_rows, scale_format)
    assert torch.equal(s_g.cpu(), s)
    assert torch.equal(q_g.cpu().view(torch.uint8), q.view(torch.uint8))
