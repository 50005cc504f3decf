"""Real DeepGEMM, QuACK and DeepEP against the CPU reference semantics (needs CUDA)."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch
from libraries import cases as library_cases

from prime_ops import deepep, fp8, quack

pytestmark = pytest.mark.gpu


def _needs(module: str, devices: int = 1):
    missing = importlib.util.find_spec(module.split(".")[0]) is None
    few = torch.cuda.device_count() < devices
    return pytest.mark.skipif(missing or few, reason=f"needs {module} and {devices} CUDA device(s)")


def _close(got, ref, rel):
    """Relative max-error check: FP8 and bf16 outputs differ from the CPU kernel by rounding."""
    err = (got.float().cpu() - ref.float()).abs().max()
    assert err <= rel * ref.float().abs().max(), f"max error {err}"


@_needs("deep_gemm")
def test_deep_gemm_matches_cpu_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(384, 512, generator=gen).bfloat16().requires_grad_()
    xc, wc = (t.detach().cuda().requires_grad_() for t in (x, w))
    g = torch.randn(256, 384, generator=gen).bfloat16()
    ue8m0 = fp8.needs_ue8m0(torch.device("cuda"))  # SM100 semantics on CPU when the GPU is SM100
    fp8.fp8_blockwise_mm(x, w, ue8m0=ue8m0).backward(g)
    out = fp8.fp8_blockwise_mm(xc, wc)
    out.backward(g.cuda())
    _close(out, fp8.fp8_blockwise_mm(x, w, ue8m0=ue8m0).detach(), 0.02)
    _close(xc.grad, x.grad, 0.02)
    _close(wc.grad, w.grad, 0.02)


@_needs("deep_gemm")
def test_deep_gemm_grouped_matches_cpu_reference():
    gen = torch.Generator().manual_seed(0)
    counts = (3, 0, 261)  # any lengths: the adapter pads each group to DeepGEMM's 128 rows
    x = torch.randn(sum(counts), 256, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(3, 256, 128, generator=gen).bfloat16().requires_grad_()  # [G, K, N]
    offsets = torch.tensor(counts).cumsum(0).int()
    xc, wc = (t.detach().cuda().requires_grad_() for t in (x, w))
    g = torch.randn(sum(counts), 128, generator=gen).bfloat16()
    ref = fp8.grouped_fp8_gemm(x, w, offsets, ue8m0=fp8.needs_ue8m0(torch.device("cuda")))
    ref.backward(g)
    out = fp8.grouped_fp8_gemm(xc, wc, offsets.cuda())
    out.backward(g.cuda())
    _close(out, ref.detach(), 0.02)
    _close(xc.grad, x.grad, 0.02)
    _close(wc.grad, w.grad, 0.02)


@_needs("deep_gemm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_deep_gemm_fp32_and_fp16_paths_match_cpu_reference(dtype):
    """Issue 36: the outputs SM90's 1d2d kernel refuses (fp32 / fp16 forward and backward, the
    fp32 weight-gradient accumulation, the grouped GEMM per group), the same cases as
    tests/libraries/test_deepgemm_host.py, with real kernels."""
    gen = torch.Generator().manual_seed(1)
    ue8m0 = fp8.needs_ue8m0(torch.device("cuda"))
    x = torch.randn(130, 256, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(384, 256, generator=gen) / 16).to(dtype).requires_grad_()
    g = torch.randn(130, 384, generator=gen).to(dtype)
    xc, wc = (t.detach().cuda().requires_grad_() for t in (x, w))
    ref = fp8.fp8_blockwise_mm(x, w, ue8m0=ue8m0)
    ref.backward(g)
    out = fp8.fp8_blockwise_mm(xc, wc)
    out.backward(g.cuda())
    assert out.dtype == dtype and wc.grad.dtype == dtype
    _close(out, ref.detach(), 0.02)
    _close(xc.grad, x.grad, 0.02)
    _close(wc.grad, w.grad, 0.02)
    buffers = [torch.zeros(w.shape), torch.zeros(w.shape, device="cuda")]
    for buf, (xi, wi, gi) in zip(buffers, ((x, w, g), (xc, wc, g.cuda())), strict=True):
        fp8.accumulate_wgrad_fp32(id(buf), lambda b=buf: b)
        try:
            for _ in range(2):
                out = fp8.fp8_blockwise_mm(
                    xi.detach(), wi.detach().requires_grad_(), wgrad_key=id(buf),
                    ue8m0=ue8m0 if buf.device.type == "cpu" else None,
                )  # fmt: skip
                out.backward(gi)
        finally:
            fp8.accumulate_wgrad_fp32(id(buf), None)
    _close(buffers[1], buffers[0], 0.02)
    counts = (3, 0, 133)
    xg = torch.randn(sum(counts), 128, generator=gen).to(dtype)
    wg = torch.randn(3, 128, 256, generator=gen).to(dtype)
    offs = torch.tensor(counts).cumsum(0).int()
    ref = fp8.grouped_fp8_gemm(xg, wg, offs, ue8m0=ue8m0)
    _close(fp8.grouped_fp8_gemm(xg.cuda(), wg.cuda(), offs.cuda()), ref, 0.02)


@_needs("quack.gemm_interface")
@pytest.mark.parametrize("grouped", [False, True])
def test_quack_gated_mlp_matches_cpu_reference(grouped):
    gen = torch.Generator().manual_seed(0)
    lead = (3,) if grouped else ()
    x = torch.randn(384, 256, generator=gen).bfloat16()
    w_gate_up = torch.randn(*lead, 512, 256, generator=gen).bfloat16() / 16
    w_down = torch.randn(*lead, 256, 256, generator=gen).bfloat16() / 16
    offsets = torch.tensor([128, 128, 384], dtype=torch.int32) if grouped else None
    cpu = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down)]
    cuda = [t.cuda().requires_grad_() for t in (x, w_gate_up, w_down)]
    ref = quack.gated_mlp(*cpu, offsets)
    out = quack.gated_mlp(*cuda, None if offsets is None else offsets.cuda())
    g = torch.randn(ref.shape, generator=gen).bfloat16()
    ref.backward(g)
    out.backward(g.cuda())
    _close(out, ref.detach(), 0.02)
    for got, want in zip(cuda, cpu, strict=True):
        _close(got.grad, want.grad, 0.02)


@_needs("quack.gemm_interface")
@pytest.mark.parametrize("name", sorted(library_cases.QUACK_CASES))
def test_quack_library_case_matches_cpu_reference(name):
    """The GEMMs tests/libraries drives through QuACK's host checks, run by QuACK's kernels."""
    case = library_cases.QUACK_CASES[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.m, case.k, generator=gen).bfloat16()
    lead = (len(case.counts),) if case.counts else ()
    w = (torch.randn(*lead, case.n, case.k, generator=gen) / 16).bfloat16()
    tensors = [x, w]
    if case.bias:
        tensors.append(torch.randn(case.n, generator=gen).bfloat16())
    cpu = [t.clone().requires_grad_() for t in tensors]
    cuda = [t.cuda().requires_grad_() for t in tensors]
    if case.counts:
        offsets = torch.tensor(case.counts).cumsum(0).int()
        ref = quack.grouped_linear(*cpu, offsets)
        out = quack.grouped_linear(*cuda, offsets.cuda())
    else:
        ref, out = quack.linear(*cpu), quack.linear(*cuda)
    g = torch.randn(ref.shape, generator=gen).bfloat16()
    ref.backward(g)
    out.backward(g.cuda())
    _close(out, ref.detach(), 0.02)
    for got, want in zip(cuda, cpu, strict=True):
        _close(got.grad, want.grad, 0.02)


def _deepep_rank(rank, world, init_file):
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        group = torch.distributed.group.WORLD
        experts, hidden = 4 * world, 256
        dispatcher = deepep.Dispatcher(group, num_experts=experts, hidden=hidden)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(64, hidden, generator=gen).bfloat16().cuda().requires_grad_()
        weights, idx = torch.topk(torch.randn(64, experts, generator=gen).softmax(-1).cuda(), 2)
        before = deepep.live_handles()
        d = dispatcher.dispatch(x, idx, weights)
        assert int(d.tokens_per_expert.sum()) == int((d.topk_idx >= 0).sum())
        # Each token comes back once per destination rank: combining ones counts those ranks.
        out = dispatcher.combine(d.x, d)
        ranks = torch.stack([((idx // 4) == r).any(-1) for r in range(world)]).sum(0)
        torch.testing.assert_close(out.float(), x.detach().float() * ranks[:, None].float())
        out.float().sum().backward()
        torch.testing.assert_close(x.grad.float(), ranks[:, None].float().expand_as(x))
        # The reference backend over nccl gives the same results (DeepEP's own semantics).
        reference = deepep.Dispatcher(
            group, num_experts=experts, hidden=hidden, backend="reference"
        )
        r = reference.dispatch(x.detach(), idx, weights)
        assert torch.equal(r.x, d.x) and torch.equal(r.topk_idx, d.topk_idx)
        assert torch.equal(r.topk_weights, d.topk_weights)
        assert torch.equal(r.tokens_per_expert, d.tokens_per_expert)
        assert torch.equal(reference.combine(r.x, r), dispatcher.combine(d.x, d))
        del d, out, r
        assert deepep.live_handles() == before
    finally:
        torch.distributed.destroy_process_group()


@_needs("deep_ep", devices=2)
def test_deep_ep_round_trip_on_two_gpus():
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        torch.multiprocessing.spawn(
            _deepep_rank, args=(2, os.path.join(tmp, "store")), nprocs=2, join=True
        )
