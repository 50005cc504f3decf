"""prime_rl::sparse_mla: reference against a naive float64 loop, Triton (interpreter) against the
reference, the FlashMLA adapter against stand-ins of both of its lse conventions, op checks,
compile and prime_ac."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import prime_ops
from prime_ops.attn import mla, sparse_mla
from prime_ops.attn.mla import BACKENDS, reference_backward, reference_forward

OP = torch.ops.prime_rl.sparse_mla
INF = float("inf")


def _naive(q, kv, indices, scale, d_v):
    """Float64, one query and head at a time, straight from the definition."""
    t_len, hq, _ = q.shape
    s_len, hkv, _ = kv.shape
    group = hq // hkv
    out = torch.zeros(t_len, hq, d_v, dtype=torch.float64)
    lse = torch.full((t_len, hq), -INF, dtype=torch.float64)
    for t in range(t_len):
        for h in range(hq):
            g = h // group
            rows = [int(i) for i in indices[t, g] if 0 <= int(i) < s_len]
            if not rows:
                continue
            keys = kv[rows, g].double()
            scores = keys @ q[t, h].double() * scale
            lse[t, h] = torch.logsumexp(scores, 0)
            out[t, h] = torch.softmax(scores, 0) @ keys[:, :d_v]
    return out, lse


def _inputs(t=5, hq=6, hkv=2, d=72, s=11, topk=21, dtype=torch.float32, seed=0):
    """Random indices with invalid entries (-1, other negatives, >= S), a query whose every index
    is invalid, and a run of duplicates."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g, dtype=dtype)
    kv = torch.randn(s, hkv, d, generator=g, dtype=dtype)
    idx = torch.randint(-2, s + 3, (t, hkv, topk), generator=g, dtype=torch.int32)
    idx[1, 0] = -1
    idx[-1, hkv - 1, :5] = 3
    idx[0, 0, -1] = s  # exactly S is invalid too
    return q, kv, idx


def test_reference_matches_naive_definition():
    q, kv, idx = _inputs(dtype=torch.float64)
    out, lse = sparse_mla(q, kv, idx, 0.3, 40)
    ref_out, ref_lse = _naive(q, kv, idx, 0.3, 40)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse.float())
    assert lse.dtype == torch.float32 and lse[1, :3].isneginf().all()
    assert out[1, :3].eq(0).all()


def test_reference_gathers_in_bounded_blocks(monkeypatch):
    q, kv, idx = _inputs()
    whole = reference_forward(q, kv, idx, 0.3, 40)
    monkeypatch.setattr(mla, "_GATHER_BUDGET", 2 * 21 * 72)  # 1 query/block
    blocked = reference_forward(q, kv, idx, 0.3, 40)
    torch.testing.assert_close(blocked[0], whole[0], atol=0, rtol=0)
    torch.testing.assert_close(blocked[1], whole[1], atol=0, rtol=0)


def test_gradcheck_reference_float64():
    q, kv, idx = _inputs(t=3, hq=4, d=10, s=6, topk=7, dtype=torch.float64)
    idx[0, 1, :3] = 2  # duplicates
    q.requires_grad_()
    kv.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: sparse_mla(a, b, idx, 0.5, 6)[0], (q, kv))


def test_lse_carries_no_gradient():
    q, kv, idx = _inputs()
    q.requires_grad_()
    out, lse = sparse_mla(q, kv, idx, d_v=40)
    assert out.requires_grad and not lse.requires_grad


# --------------------------------------------------------------------------- Triton (interpreter)

TRITON_SHAPES = (
    dict(t=3, hq=6, hkv=2, d=72, s=11, topk=21),  # d and topk not multiples of the blocks
    dict(t=3, hq=4, hkv=1, d=40, s=9, topk=16),
)


def triton_checks() -> None:
    """Triton forward and backward against the reference, fp32 and bf16 (run in a child)."""
    for shape in TRITON_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            q, kv, idx = _inputs(dtype=dtype, **shape)
            d_v = shape["d"] - 8
            out, lse = sparse_mla(q, kv, idx, 0.3, d_v, backend="triton")
            ref_out, ref_lse = sparse_mla(q, kv, idx, 0.3, d_v, backend="reference")
            tol = (
                dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            )
            torch.testing.assert_close(out, ref_out, **tol)
            torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
            assert lse.isneginf().any()
            args = (torch.randn_like(out), q, kv, idx, ref_out, ref_lse, 0.3, d_v)
            grads = torch.ops.prime_rl.sparse_mla_backward(*args, "triton")
            for ours, ref in zip(grads, reference_backward(*args), strict=True):
                assert ours.dtype == dtype
                torch.testing.assert_close(ours, ref, **tol)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.slow
def test_triton_matches_reference_under_interpreter():
    """Triton reads TRITON_INTERPRET when ``triton`` itself is imported, which another test may
    already have done in this process: the kernels run in a child that sets it first."""
    triton = pytest.importorskip("triton")
    numpy = pytest.importorskip("numpy")
    if _version(triton.__version__) < (3, 8) and _version(numpy.__version__) >= (2, 4):
        # triton-lang/triton#9171: older interpreters turn a runtime loop bound into an int with
        # int() of a 1-element array, which numpy 2.4 refuses; 3.8 is the first release seen to pass
        pytest.skip("triton < 3.8's interpreter fails on numpy >= 2.4 (triton-lang/triton#9171)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    code = "import test_sparse_mla; test_sparse_mla.triton_checks()"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, kv, idx = _inputs()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        sparse_mla(q, kv, idx, d_v=40, backend="triton")


# --------------------------------------------------------------------------- FlashMLA adapter


def _flashmla_standin(calls, natural_lse: bool):
    """flash_mla.flash_mla_sparse_fwd in one of its two released forms.

    Sept. 2025: (q, kv, indices, sm_scale, d_v=512), lse base 2 and -inf for a lonely query.
    Jan. 2026+: adds attn_sink / topk_length, lse natural log and +inf for a lonely query."""

    def compute(q, kv, indices, sm_scale, d_v):
        out, lse = _naive(q, kv, indices, sm_scale, d_v)
        return out.to(q.dtype), lse.float()

    if natural_lse:

        def flash_mla_sparse_fwd(
            q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None
        ):
            calls.append(dict(locals()))
            out, lse = compute(q, kv, indices, sm_scale, d_v)
            return out, lse.clone(), lse.masked_fill(lse == -INF, INF)

    else:

        def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512):
            calls.append(dict(locals()))
            out, lse = compute(q, kv, indices, sm_scale, d_v)
            return out, lse / math.log(2), lse / math.log(2)

    module = types.ModuleType("flash_mla")
    module.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    return module


@pytest.mark.parametrize("natural_lse", [False, True])
def test_flashmla_adapter_exact_call_and_lse_conversion(monkeypatch, natural_lse):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_mla", _flashmla_standin(calls, natural_lse))
    q, kv, idx = _inputs(hkv=1, hq=4, d=24, s=9, topk=6)
    idx[1, 0] = -1
    out, lse = BACKENDS["flashmla"].forward(q, kv, idx, 0.25, 16)
    (call,) = calls
    assert call["q"] is q and call["kv"] is kv and call["indices"] is idx
    assert call["sm_scale"] == 0.25 and call["d_v"] == 16
    assert natural_lse is ("attn_sink" in call) and call.get("topk_length") is None
    ref_out, ref_lse = _naive(q, kv, idx, 0.25, 16)
    torch.testing.assert_close(out, ref_out.float())
    torch.testing.assert_close(lse, ref_lse.float())
    assert lse[1].isneginf().all() and not lse.isposinf().any()


def test_flashmla_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    q, kv, idx = _inputs(hkv=1)
    with pytest.raises(prime_ops.BackendUnavailable, match="FlashMLA is built from source"):
        BACKENDS["flashmla"].forward(q, kv, idx, 0.25, 16)


def test_flashmla_front_under_fake_cuda_never_imports_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # importing it would raise
    with FakeTensorMode():
        q = torch.empty(7, 64, 576, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(30, 1, 576, dtype=torch.bfloat16, device="cuda")
        idx = torch.empty(7, 1, 2048, dtype=torch.int32, device="cuda")
        out, lse = sparse_mla(q, kv, idx, backend="flashmla")
        assert out.shape == (7, 64, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (7, 64) and lse.dtype == torch.float32
        small_q = torch.empty(7, 64, 128, dtype=torch.bfloat16, device="cuda")
        small_kv = torch.empty(30, 1, 128, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="d_qk 512 or 576"):
            sparse_mla(small_q, small_kv, idx, d_v=64, backend="flashmla")
        few_heads = torch.empty(7, 8, 576, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="64 or 128 query heads"):
            sparse_mla(few_heads, kv, idx, backend="flashmla")
        ragged = torch.empty(7, 1, 100, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match="multiple of 128"):
            sparse_mla(q, kv, ragged, backend="flashmla")


# --------------------------------------------------------------------------- checks and op tests


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=torch.randn(5, 6)), r"q must be \[tokens, heads, d_qk\]"),
        (dict(kv=torch.randn(11, 2, 64)), "same head dim d_qk"),
        (dict(kv=torch.randn(11, 4, 72)), "multiple of kv's heads"),
        (dict(indices=torch.zeros(5, 1, 3, dtype=torch.int32)), "indices must be"),
        (dict(indices=torch.zeros(5, 2, 3, dtype=torch.int64)), "must be int32"),
        (dict(d_v=80), "d_v must be in"),
        (dict(softmax_scale=float("nan")), "softmax_scale must be finite"),
        (dict(q=torch.randn(5, 6, 72, dtype=torch.float64)), "share a dtype"),
        (dict(backend="flash"), "not a sparse_mla backend"),
        (dict(backend="flashmla"), "runs on cuda tensors"),
    ],
)
def test_invalid_arguments_raise(change, message):
    q, kv, idx = _inputs()
    args = dict(q=q, kv=kv, indices=idx, softmax_scale=0.3, d_v=40, backend="reference")
    args.update(change)
    with pytest.raises(ValueError, match=message):
        sparse_mla(**args)


def test_fake_on_meta_gives_shapes_and_dtypes():
    q, kv, idx = (t.to("meta") for t in _inputs(dtype=torch.bfloat16))
    out, lse = sparse_mla(q, kv, idx, d_v=40)
    assert out.shape == (5, 6, 40) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert lse.shape == (5, 6) and lse.dtype == torch.float32


@pytest.mark.slow
def test_opcheck_forward_and_backward():
    q, kv, idx = _inputs(t=3, hq=4, d=16, s=6, topk=5)
    q.requires_grad_()
    kv.requires_grad_()
    torch.library.opcheck(OP.default, (q, kv, idx, 0.3, 8, "reference"))
    out, lse = reference_forward(q.detach(), kv.detach(), idx, 0.3, 8)
    args = (torch.randn_like(out), q.detach(), kv.detach(), idx, out, lse, 0.3, 8, "reference")
    torch.library.opcheck(torch.ops.prime_rl.sparse_mla_backward.default, args)


# --------------------------------------------------------------------------- compile + prime_ac


class SparseBlock(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim // heads)
        self.proj = nn.Linear(heads * 4, dim)

    def forward(self, x, indices):
        q = self.q(x).view(x.shape[0], self.heads, -1)
        kv = self.kv(x).view(x.shape[0], 1, -1)
        out, _ = sparse_mla(q, kv, indices, d_v=4)
        return x + self.proj(out.flatten(1))


class SparseModel(nn.Module):
    def __init__(self, n_blocks=2):
        super().__init__()
        self.layers = nn.ModuleList(SparseBlock() for _ in range(n_blocks))

    def forward(self, x, indices):
        for layer in self.layers:
            x = layer(x, indices)
        return x.square().mean()


@pytest.fixture
def count_forwards(monkeypatch):
    """Swap a counting reference forward into the registry; run forward+backward, return calls."""
    calls = []
    spec = BACKENDS["reference"]

    def counting(*args):
        calls.append(1)
        return spec.forward(*args)

    monkeypatch.setitem(BACKENDS, "reference", dataclasses.replace(spec, forward=counting))

    def run(model, *inputs):
        calls.clear()
        model(*inputs).backward()
        return len(calls)

    return run


def _model_inputs():
    torch.manual_seed(0)
    x = torch.randn(6, 32)
    causal = torch.arange(6)[:, None] - torch.arange(3)[None, :]  # rows t, t-1, t-2 (or -1, -2)
    return x, causal.to(torch.int32).view(6, 1, 3)


def test_prime_ac_selective_keeps_sparse_mla_by_name(count_forwards):
    prime_ac = pytest.importorskip("prime_ac")
    x, idx = _model_inputs()
    reference = SparseModel()
    full, selective = SparseModel(), SparseModel()
    full.load_state_dict(reference.state_dict())
    selective.load_state_dict(reference.state_dict())
    assert count_forwards(reference, x, idx) == 2
    prime_ac.checkpoint_blocks(full, mode="full")
    assert count_forwards(full, x, idx) == 4  # replayed in each block's backward
    prime_ac.checkpoint_blocks(selective, mode="selective", targets=["prime_rl::sparse_mla"])
    assert count_forwards(selective, x, idx) == 2  # kept
    for model in (full, selective):
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours.grad, theirs.grad, atol=0, rtol=0)


@pytest.mark.slow
def test_compile_fullgraph_matches_eager():
    x, idx = _model_inputs()
    eager, compiled = SparseModel(n_blocks=1), SparseModel(n_blocks=1)
    compiled.load_state_dict(eager.state_dict())
    eager(x, idx).backward()
    torch._dynamo.reset()
    # aot_eager traces through the fakes and the registered autograd like inductor does,
    # without its code generation; fullgraph=True raises on a graph break.
    torch.compile(compiled, fullgraph=True, backend="aot_eager")(x, idx).backward()
    for ours, theirs in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4)
