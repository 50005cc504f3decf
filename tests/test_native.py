"""Native csrc ops (prime_rl::moe_permute / moe_unpermute, merge_attn_states,
quantize_fp8_blockwise) against plain-PyTorch float64 references, on CPU.

The module builds the library once per session (a cached build; a no-op when up to date), so
the normal test run is what builds it in CI; without a C++ compiler or ninja the tests skip.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

from prime_ops import BackendUnavailable, native
from prime_ops.native import build as native_build

_FP8_MAX = 448.0


_NO_BUILD = {  # what works on a machine that cannot build the library
    "test_fakes_work_without_kernels",
    "test_cuda_sources_compile",
    "test_cache_key_holds_the_instruction_set",
    "test_an_unusable_library_is_never_loaded_and_is_rebuilt_once",
    "test_a_rebuild_that_fails_leaves_the_python_paths",
    "test_the_process_loads_a_sealed_private_copy",
    "test_a_build_publishes_whole_files_by_rename",
    "test_a_compile_prints_when_it_starts_and_ends",
    "test_a_lock_nobody_can_be_holding_is_removed_not_waited_on",
    "test_a_live_lock_is_waited_on_for_a_bounded_time",
    "test_a_call_during_a_build_waits_for_it_and_says_so",
    "test_a_build_that_outlasts_the_wait_is_named_in_the_error",
    "test_a_valid_library_under_a_live_lock_loads_without_waiting",
    "test_an_unbuilt_library_says_how_to_build_it",
}


@pytest.fixture(scope="session")
def native_library():
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("the native ops need a C++ compiler (c++) and ninja to build")
    if not native_build.torch_supported():
        pytest.skip(f"the native ops need torch >= 2.10 (stable ABI), not {torch.__version__}")
    return native_build.build()


@pytest.fixture(autouse=True)
def _kernels(request):
    if request.node.originalname not in _NO_BUILD:
        request.getfixturevalue("native_library")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# --- plain-PyTorch references -------------------------------------------------------------------


def ref_permute(x, topk_idx, num_experts, alignment):
    """Python loops over experts: expert-major, (token, slot) order within, zero padding."""
    tokens, top_k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    row_map = torch.full((tokens * top_k,), -1, dtype=torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64)
    rows, row = [], 0
    for e in range(num_experts):
        slots = (flat == e).nonzero().flatten()
        counts[e] = len(slots)
        row_map[slots] = torch.arange(row, row + len(slots))
        padded = -(-len(slots) // alignment) * alignment
        segment = x.new_zeros(padded, x.shape[1])
        segment[: len(slots)] = x[slots // top_k]
        rows.append(segment)
        row += padded
    x_sorted = torch.cat(rows) if rows else x.new_zeros(0, x.shape[1])
    return x_sorted, row_map.view(tokens, top_k), counts


def ref_unpermute(y, row_map, w):
    kept = (row_map >= 0).unsqueeze(-1)
    gathered = torch.where(kept, y[row_map.clamp(min=0)], 0)
    return (gathered.double() * w.double().unsqueeze(-1)).sum(1)


def ref_merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    finite = torch.where(lse == float("-inf"), 0.0, lse)
    wa = torch.exp(lse_a.double() - finite).T.unsqueeze(-1)
    wb = torch.exp(lse_b.double() - finite).T.unsqueeze(-1)
    return out_a.double() * wa + out_b.double() * wb, lse


def ref_quantize(x, block_rows, scale_format):
    rows, cols = x.shape
    pr, pc = (-rows) % block_rows, (-cols) % 128
    blocks = torch.nn.functional.pad(x.double(), (0, pc, 0, pr))
    blocks = blocks.view((rows + pr) // block_rows, block_rows, (cols + pc) // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12).float().double()
    scale = (amax / _FP8_MAX).float().double()  # fp32 division, as the recipe does it
    if scale_format == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(amax / _FP8_MAX)))
    full = scale.repeat_interleave(block_rows, 0).repeat_interleave(128, 1)[:rows, :cols]
    q = (x.double() / full).float().clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def _routing(gen, tokens, top_k, num_experts, drop=0.2):
    scores = torch.rand(tokens, num_experts, generator=gen)
    idx = scores.topk(top_k, dim=1).indices
    dropped = torch.rand(tokens, top_k, generator=gen) < drop
    return idx.masked_fill(dropped, -1)


# --- moe_permute / moe_unpermute -----------------------------------------------------------------


@pytest.mark.parametrize("alignment", [1, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_permute_matches_reference(gen, alignment, dtype, index_dtype):
    x = torch.randn(37, 24, generator=gen).to(dtype)
    idx = _routing(gen, 37, 3, 6).to(index_dtype)
    got = native.moe_permute(x, idx, 6, alignment)
    want = ref_permute(x, idx, 6, alignment)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert got[0].shape[0] % alignment == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpermute_matches_reference(gen, dtype):
    x = torch.randn(29, 16, generator=gen)
    idx = _routing(gen, 29, 4, 5)
    _, row_map, _ = native.moe_permute(x, idx, 5, 128)
    y = torch.randn(int(row_map.max()) + 3, 16, generator=gen).to(dtype)
    w = torch.rand(29, 4, generator=gen)
    got = native.moe_unpermute(y, row_map, w)
    assert got.dtype == dtype
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got.double(), ref_unpermute(y, row_map, w), **tol)


def test_fp32_equals_the_eager_chain_bitwise(gen):
    """The reference EP layer's chain (sort, gather; scatter back, weight, sum over slots):
    the same bits forward, and for the gradients of x and of the rows (summation orders match);
    only the weights' gradient (a dot product over D) is summed in another order."""
    x = torch.randn(50, 32, generator=gen, requires_grad=True)
    idx = torch.rand(50, 64, generator=gen).topk(8, dim=1).indices
    order = torch.argsort(idx.flatten(), stable=True)
    w = torch.rand(50, 8, generator=gen)
    rows = torch.randn(400, 32, generator=gen, requires_grad=True)
    g_sorted, g_out = torch.randn(400, 32, generator=gen), torch.randn(50, 32, generator=gen)
    slots = torch.empty_like(rows).index_copy(0, order, rows).view(-1, 8, 32)
    chain = (slots * w.unsqueeze(-1)).sum(1)
    x_sorted, row_map, _ = native.moe_permute(x, idx, 64, 1)
    assert torch.equal(x_sorted, x[order // 8])
    out = native.moe_unpermute(rows, row_map, w)
    assert torch.equal(out, chain)
    grad_x = torch.autograd.grad(x_sorted, x, g_sorted)[0]
    assert torch.equal(grad_x, torch.autograd.grad(x[order // 8], x, g_sorted)[0])
    grad_rows = torch.autograd.grad(out, rows, g_out)[0]
    assert torch.equal(grad_rows, torch.autograd.grad(chain, rows, g_out)[0])


def test_permute_edge_cases(gen):
    empty = native.moe_permute(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.long), 4, 128)
    assert empty[0].shape == (0, 8) and empty[1].shape == (0, 2) and empty[2].tolist() == [0] * 4

    x = torch.randn(5, 8, generator=gen)
    dropped = native.moe_permute(x, torch.full((5, 2), -1), 3, 128)
    assert dropped[0].shape == (0, 8) and (dropped[1] == -1).all()
    assert native.moe_unpermute(dropped[0], dropped[1], torch.ones(5, 2)).eq(0).all()

    one = torch.full((5, 1), 2)
    x_sorted, row_map, counts = native.moe_permute(x, one, 3, 128)
    assert counts.tolist() == [0, 0, 5] and x_sorted.shape == (128, 8)
    assert torch.equal(x_sorted[:5], x) and x_sorted[5:].eq(0).all()
    assert row_map.flatten().tolist() == [0, 1, 2, 3, 4]


def test_permute_rejects_bad_input():
    x = torch.zeros(4, 8)
    with pytest.raises(
        RuntimeError, match=r"topk_idx\[0, 0\] = 7 is outside \[-1, num_experts=4\)"
    ):
        native.moe_permute(x, torch.full((4, 2), 7), 4, 1)
    with pytest.raises(ValueError, match="same T"):
        native.moe_permute(x, torch.zeros(3, 2, dtype=torch.long), 4, 1)
    with pytest.raises(ValueError, match="alignment"):
        native.moe_permute(x, torch.zeros(4, 2, dtype=torch.long), 4, 0)
    with pytest.raises(TypeError, match="topk_idx"):
        native.moe_permute(x, torch.zeros(4, 2), 4, 1)
    with pytest.raises(ValueError, match=r"topk_weights must have shape \[T, K\]"):
        native.moe_unpermute(x, torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 3))


def test_permute_and_unpermute_are_adjoints(gen):
    """<P x, g> == <x, P^T g> with P^T = unpermute with unit weights, and the autograd of each
    is the other: moe_permute's backward sums rows back, moe_unpermute's scatters them."""
    x = torch.randn(23, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    idx = _routing(gen, 23, 3, 4)
    x_sorted, row_map, _ = native.moe_permute(x, idx, 4, 128)
    g = torch.randn(x_sorted.shape, dtype=torch.float64, generator=gen)
    back = native.moe_unpermute(g, row_map, torch.ones(23, 3, dtype=torch.float64))
    torch.testing.assert_close((x_sorted * g).sum(), (x * back).sum())
    (grad_x,) = torch.autograd.grad(x_sorted, x, g)
    torch.testing.assert_close(grad_x, back)  # the same terms, summed in row vs slot order


def test_gradcheck_permute_and_unpermute(gen):
    idx = _routing(gen, 9, 3, 4)
    x = torch.randn(9, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: native.moe_permute(x, idx, 4, 4)[0], (x,))
    _, row_map, _ = native.moe_permute(x.detach(), idx, 4, 4)
    y = torch.randn(int(row_map.max()) + 2, 5, dtype=torch.float64, generator=gen)
    w = torch.rand(9, 3, dtype=torch.float64, generator=gen)
    y.requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(lambda y, w: native.moe_unpermute(y, row_map, w), (y, w))


def test_unpermute_gradients_match_reference(gen):
    """Including the padding rows (zero gradient) and the float32 weights of a bf16 layer."""
    idx = _routing(gen, 17, 2, 3)
    _, row_map, _ = native.moe_permute(torch.zeros(17, 4), idx, 3, 8)
    y = torch.randn(int(row_map.max()) + 4, 12, generator=gen, requires_grad=True)
    w = torch.rand(17, 2, generator=gen, requires_grad=True)
    g = torch.randn(17, 12, generator=gen)
    got = torch.autograd.grad(native.moe_unpermute(y, row_map, w), (y, w), g)
    y64, w64 = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.autograd.grad(ref_unpermute(y64, row_map, w64), (y64, w64), g.double())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(
    tokens=st.integers(0, 24),
    top_k=st.integers(1, 4),
    num_experts=st.integers(1, 6),
    dim=st.integers(1, 9),
    alignment=st.sampled_from([1, 3, 128]),
    drop=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_permute_round_trip_property(tokens, top_k, num_experts, dim, alignment, drop, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, dtype=torch.float64, generator=gen)
    idx = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    idx = idx.masked_fill(torch.rand(tokens, top_k, generator=gen) < drop, -1)
    got = native.moe_permute(x, idx, num_experts, alignment)
    for g, w in zip(got, ref_permute(x, idx, num_experts, alignment), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    w = torch.rand(tokens, top_k, dtype=torch.float64, generator=gen)
    out = native.moe_unpermute(got[0], got[1], w)
    want = (x.unsqueeze(1) * (w * (idx >= 0)).unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out, want)


# --- merge_attn_states --------------------------------------------------------------------------


def _states(gen, tokens=11, heads=3, dim=16, dtype=torch.float32):
    out_a, out_b = (torch.randn(tokens, heads, dim, generator=gen).to(dtype) for _ in range(2))
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse_a, lse_b = (torch.randn(heads, tokens, generator=gen).to(lse_dtype) * 3 for _ in range(2))
    lse_a[0, :3] = float("-inf")  # partly masked rows...
    lse_b[0, 1:5] = float("-inf")  # ... and two rows with no key at all
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_matches_reference(gen, dtype):
    states = _states(gen, dtype=dtype)
    out, lse = native.merge_attn_states(*states)
    want_out, want_lse = ref_merge(*states)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6  # fp32 arithmetic vs a float64 reference
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert out[1:3, 0].eq(0).all() and lse[0, 1:3].eq(float("-inf")).all()


def test_merge_gradcheck(gen):
    """Rows masked on one side only: finite differences cannot step an lse = -inf output."""
    out_a, lse_a, out_b, lse_b = _states(gen, 5, 2, 4, torch.float64)
    lse_b[0, 1:3] = 0.5
    states = [t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    assert torch.autograd.gradcheck(native.merge_attn_states, states)


def test_merge_gradients_match_reference(gen):
    """Only out feeds the loss (grad_lse is None), then both outputs do; -inf rows get 0."""
    states = [t.requires_grad_() for t in _states(gen)]
    ref_states = [t.detach().double().requires_grad_() for t in states]
    g = torch.randn(11, 3, 16, generator=gen)
    g_lse = torch.randn(3, 11, generator=gen)
    for with_lse in (False, True):
        out, lse = native.merge_attn_states(*states)
        want_out, want_lse = ref_merge(*ref_states)
        loss = (out * g).sum() + (lse.masked_fill(lse.isinf(), 0) * g_lse).sum() * with_lse
        want = (want_out * g.double()).sum()
        want = want + (want_lse.masked_fill(want_lse.isinf(), 0) * g_lse.double()).sum() * with_lse
        got = torch.autograd.grad(loss, states)
        for a, b in zip(got, torch.autograd.grad(want, ref_states), strict=True):
            # torch.logaddexp's backward is nan where both inputs are -inf; the op's is 0.
            undefined = b.isnan()
            assert a[undefined].eq(0).all()
            torch.testing.assert_close(a.double()[~undefined], b[~undefined], rtol=1e-5, atol=1e-5)
        assert got[1][0, 1:3].eq(0).all() and got[3][0, 1:3].eq(0).all()


def test_merge_rejects_bad_input(gen):
    out_a, lse_a, out_b, lse_b = _states(gen)
    with pytest.raises(ValueError, match=r"lse_a must have shape \[H, T\]"):
        native.merge_attn_states(out_a, lse_a.T.contiguous(), out_b, lse_b)
    with pytest.raises(TypeError, match="out_b must be torch.float32, got torch.float64"):
        native.merge_attn_states(out_a, lse_a, out_b.double(), lse_b)


def test_merge_empty():
    out, lse = native.merge_attn_states(
        torch.zeros(0, 2, 4), torch.zeros(2, 0), torch.zeros(0, 2, 4), torch.zeros(2, 0)
    )
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)


# --- quantize_fp8_blockwise ---------------------------------------------------------------------


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_reference(gen, block_rows, scale_format, dtype):
    x = (torch.randn(200, 300, generator=gen) * torch.logspace(-3, 3, 300)).to(dtype)
    x[150:, :128] = 0  # an all-zero block: amax clamps to 1e-12
    q, scale = native.quantize_fp8_blockwise(x, block_rows, scale_format)
    want_q, want_scale = ref_quantize(x, block_rows, scale_format)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (-(-200 // block_rows), 3)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_ue8m0_scales_are_powers_of_two_that_never_overflow(gen):
    x = torch.randn(64, 512, generator=gen) * 10
    x[0, 0] = 448 * 2.0**-3  # amax / 448 exactly a power of two: kept, not doubled
    q, scale = native.quantize_fp8_blockwise(x, 1, "ue8m0")
    mantissa, _ = torch.frexp(scale)
    assert mantissa.eq(0.5).all()
    assert scale[0, 0] == 2.0**-3
    blocks = x.view(64, 4, 128)
    assert (blocks.abs().amax(-1) / scale <= _FP8_MAX).all()
    assert (blocks.abs().amax(-1) / scale > _FP8_MAX / 2).all()  # the smallest such power


def test_quantize_rounds_like_torch_on_every_fp8_step():
    """scale = 1 (each 128-block holds 448), so q is x converted: compare with torch's cast on
    a dense sweep of float32 bit patterns over [-448, 448], denormals included."""
    bits = torch.arange(0, 0x43E00001, 4093, dtype=torch.int64).to(torch.int32)
    values = torch.cat([bits.view(torch.float32), -bits.view(torch.float32)])
    values = torch.nn.functional.pad(values, (0, (-values.numel()) % 127)).view(-1, 127)
    x = torch.cat([torch.full((values.shape[0], 1), 448.0), values], dim=1)
    q, scale = native.quantize_fp8_blockwise(x, 1)
    assert scale.eq(1).all()
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_quantize_equals_prime_ops_fp8_recipe(gen, scale_format, monkeypatch):
    """Bitwise what prime_ops.fp8.quantize_blockwise's eager chain produces (the FP8 GEMM ops
    call the native op instead when it is built)."""
    from prime_ops.fp8 import quantize_blockwise

    monkeypatch.setattr(native, "has_kernel", lambda name, device: False)
    for block_rows in (1, 128):
        x = torch.randn(130, 260, generator=gen, dtype=torch.bfloat16) * 100
        if scale_format == "fp32":  # a NaN block: NaN scale and codes (the chain's UE8M0
            x[3, 7] = float("nan")  # rounding turns a NaN scale into a number; ours keeps NaN)
        q, s = native.quantize_fp8_blockwise(x, block_rows, scale_format)
        want_q, want_s = quantize_blockwise(x, block_rows, ue8m0=scale_format == "ue8m0")
        torch.testing.assert_close(s, want_s, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_edge_cases_and_errors():
    q, scale = native.quantize_fp8_blockwise(torch.zeros(0, 256), 128)
    assert q.shape == (0, 256) and scale.shape == (0, 2)
    with pytest.raises(ValueError, match="block_rows must be 1"):
        native.quantize_fp8_blockwise(torch.zeros(4, 4), 64)
    with pytest.raises(ValueError, match="scale_format"):
        native.quantize_fp8_blockwise(torch.zeros(4, 4), 1, "e8m0")
    x = torch.ones(2, 128, requires_grad=True)
    q, scale = native.quantize_fp8_blockwise(x)
    assert not q.requires_grad and not scale.requires_grad


# --- the callers: reference EP layer, ring attention's merge, FP8 quantisation -------------------


def _eager_chains(monkeypatch):
    monkeypatch.setattr(native, "has_kernel", lambda name, device: False)


def test_expert_parallel_layer_matches_its_eager_chain(monkeypatch):
    """Same forward bits and expert-weight gradients in fp32; the router's gradient goes through
    the topk_weights dot product, summed in another order (last bits)."""
    from prime_ops.expert_parallel import ExpertParallelMoE

    torch.manual_seed(0)
    moe = ExpertParallelMoE(16, 24, 6, 2)
    x = torch.randn(3, 10, 16, requires_grad=True)
    seen = []

    def run():
        out = moe(x)
        return (out, *torch.autograd.grad(out.square().sum(), [x, *moe.parameters()]))

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.name())
            return func(*args, **(kwargs or {}))

    with Record():
        fused = run()
    assert "prime_rl::moe_permute" in seen and "prime_rl::moe_unpermute" in seen
    _eager_chains(monkeypatch)
    chain = run()
    names = ["out", "x", *(n for n, _ in moe.named_parameters())]
    for name, a, b in zip(names, fused, chain, strict=True):
        if name in ("out", "w_gate", "w_up", "w_down"):
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_ring_merge_matches_its_eager_chain(gen, monkeypatch):
    from prime_ops.attn.ring import merge_partial

    out_a, lse_a, out_b, lse_b = _states(gen)
    fused = merge_partial(out_a, lse_a, out_b.bfloat16(), lse_b)
    _eager_chains(monkeypatch)
    chain = merge_partial(out_a, lse_a, out_b.bfloat16(), lse_b)
    for a, b in zip(fused, chain, strict=True):  # libm's exp/log1p vs torch's vectorised ones
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert fused[1][0, 1:3].eq(float("-inf")).all() and fused[0][1:3, 0].eq(0).all()


# --- op contract: opcheck, one operator per op, a missing build ----------------------------------


def _opcheck_cases():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    idx = _routing(gen, 13, 2, 3)
    x_sorted, row_map, _ = native.moe_permute(x.detach(), idx, 3, 4)
    y = torch.randn(x_sorted.shape, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(13, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(13, 8, dtype=torch.float64, generator=gen)
    states = [t.requires_grad_() for t in _states(gen, 6, 2, 8, torch.float64)]
    return {
        "moe_permute": (x, idx, 3, 4),
        "moe_permute_backward": (y.detach(), row_map),
        "moe_unpermute": (y, row_map, w),
        "moe_unpermute_backward": (g, y.detach(), row_map, w.detach()),
        "merge_attn_states": tuple(states),
        "merge_attn_states_backward": (
            torch.randn(6, 2, 8, dtype=torch.float64),
            None,
            *[s.detach() for s in states],
        ),
        "quantize_fp8_blockwise": (torch.randn(130, 200, generator=gen), 128, "ue8m0"),
    }


@pytest.mark.parametrize("name", list(native._SCHEMAS))
def test_opcheck(name):
    opcheck(getattr(torch.ops.prime_rl, name), _opcheck_cases()[name])


class _OpNames(TorchDispatchMode):
    """The name of every operator dispatched inside it (forward and autograd's backward)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _benchmark(name: str):
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_rows_time_pytorch_chains_against_the_native_ops():
    """benchmarks/native_ops.py compares like with like: each row's PyTorch side dispatches no
    prime_rl op (before, the quantize rows' 'chain' was fp8.quantize_blockwise, which runs the
    native kernel whenever it is built: native against itself), its native side dispatches the
    op it names, and both sides compute the same layouts and codes."""
    bench = _benchmark("native_ops")
    rows = bench.rows(bench.inputs(tokens=32, dim=256, top_k=2, experts=4, heads=2), experts=4)
    assert len(rows) == 9
    for name, row in rows.items():
        with _OpNames() as pytorch:
            pytorch_out = row.pytorch()
        with _OpNames() as fused:
            native_out = row.native()
        assert not [n for n in pytorch.names if n.startswith("prime_rl")], name
        assert row.native_side.split()[0] in fused.names, name
        if name.startswith(("quantize", "moe_permute (")):
            pair = (pytorch_out[0], native_out[0])
            if pair[0].dtype == torch.float8_e4m3fn:  # compare the codes
                pair = tuple(t.view(torch.uint8) for t in pair)
            assert torch.equal(*pair), name
        if name.startswith("quantize"):
            assert torch.equal(pytorch_out[1], native_out[1]), name


def test_attention_benchmark_rows_name_both_sides_and_compute_the_same():
    """benchmarks/attention.py compares like with like: each row's baseline dispatches no
    prime_rl or prime_rl_attn op (with the native library built, so a merge through it would
    show), its op side dispatches the op it names, and both sides return the same attention."""
    bench = _benchmark("attention")
    rows = bench.cpu_rows(lengths=[5, 3, 7], heads=2, head_dim=8)
    assert len(rows) == 3
    for name, row in rows.items():
        with torch.no_grad(), _OpNames() as baseline:
            baseline_out = row.baseline()
        with torch.no_grad(), _OpNames() as through_op:
            op_out, _ = row.op()
        assert baseline.names and not [n for n in baseline.names if n.startswith("prime_rl")], name
        assert row.op_side.split(",")[0] in through_op.names, name
        if isinstance(baseline_out, tuple):  # the kernel's (out, lse)
            baseline_out = baseline_out[0]
        torch.testing.assert_close(baseline_out, op_out, msg=name)


def test_each_op_is_one_operator(gen):
    """What a prime_ac policy sees: one prime_rl operator per call, not a chain of aten ops."""

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 4, generator=gen)
    idx = _routing(gen, 8, 2, 3)
    with Record() as seen:
        x_sorted, row_map, _ = native.moe_permute(x, idx, 3, 1)
        native.moe_unpermute(x_sorted, row_map, torch.ones(8, 2))
        native.merge_attn_states(*_states(gen))
        native.quantize_fp8_blockwise(x)
    names = [n for n in seen.names if not n.startswith("aten::")]
    assert names == [
        "prime_rl::moe_permute",
        "prime_rl::moe_unpermute",
        "prime_rl::merge_attn_states",
        "prime_rl::quantize_fp8_blockwise",
    ]


def test_has_kernel_names_the_devices_built():
    assert native.has_kernel("moe_permute", torch.device("cpu"))
    assert not native.has_kernel("moe_permute", torch.device("meta"))
    cuda_built = torch._C._dispatch_has_kernel_for_dispatch_key("prime_rl::moe_permute", "CUDA")
    assert native.has_kernel("moe_permute", torch.device("cuda")) == cuda_built


def test_fakes_work_without_kernels():
    """Meta tensors (and so torch.compile's tracing) never need the built library."""
    x = torch.empty(16, 256, device="meta")
    q, scale = native.quantize_fp8_blockwise(x, 128, "ue8m0")
    assert q.shape == (16, 256) and scale.shape == (1, 2)
    out, lse = native.merge_attn_states(
        torch.empty(4, 2, 8, device="meta"),
        torch.empty(2, 4, device="meta"),
        torch.empty(4, 2, 8, device="meta"),
        torch.empty(2, 4, device="meta"),
    )
    assert out.shape == (4, 2, 8) and lse.shape == (2, 4)


@pytest.mark.slow
def test_compiles_in_one_graph(gen):
    def layer(x, idx, w):
        x_sorted, row_map, _ = native.moe_permute(x, idx, 4, 1)
        return native.moe_unpermute(torch.tanh(x_sorted), row_map, w)

    x = torch.randn(12, 8, generator=gen, requires_grad=True)
    idx, w = _routing(gen, 12, 2, 4), torch.rand(12, 2, generator=gen)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, idx, w), layer(x, idx, w), rtol=0, atol=0)
    grad = torch.autograd.grad(compiled(x, idx, w).sum(), x)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(layer(x, idx, w).sum(), x)[0])


@pytest.mark.slow
def test_cuda_sources_compile(tmp_path):
    """nvcc -c of every csrc/cuda file against torch's headers: no GPU or CUDA torch needed."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on the PATH")
    if not native_build.torch_supported():
        pytest.skip(f"the native ops need torch >= 2.10 (stable ABI), not {torch.__version__}")
    objects = native_build.check_cuda_sources(tmp_path)
    assert len(objects) == 3 and all(o.stat().st_size > 0 for o in objects)


def test_a_process_that_found_no_build_keeps_the_python_paths(tmp_path, monkeypatch):
    """A library another process finishes later must not switch ops over mid-run (the native
    kernels differ from the chains in the last bits): the first load decides."""
    monkeypatch.setenv("PRIME_OPS_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", None)
    monkeypatch.setattr(native_build, "_found_none", False)
    if not native_build.torch_supported():
        assert native_build.load() is False
        return
    assert native_build.load() is False
    out = native_build.cache_dir(False)
    out.mkdir(parents=True)
    (out / f"{native_build.LIBRARY}.so").write_bytes(b"finished meanwhile by another process")
    assert native_build.load() is False  # loading it would raise: not even tried


# --- the build cache: instruction set in the key, verified libraries, owned locks --------------


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory and a process state that has loaded nothing; libraries are
    'loaded' by a recorder of the bytes handed to dlopen (loading a second copy of the real
    library would register its ops twice)."""
    monkeypatch.setenv("PRIME_OPS_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", None)
    monkeypatch.setattr(native_build, "_found_none", False)
    monkeypatch.setattr(native_build, "_why", "")
    monkeypatch.setattr(native_build, "torch_supported", lambda: True)
    loaded = []
    monkeypatch.setattr(native_build, "_dlopen", lambda p: loaded.append(Path(p).read_bytes()))
    return loaded


def _elf() -> bytes:
    """A small, whole shared library that a linker wrote (torch's own extension module)."""
    return Path(torch._C.__file__).read_bytes()


def _cached(data: bytes, record: bytes | None = None) -> Path:
    """A library in the (fresh) CPU cache directory with a finished build's record of ``record``
    (default: of ``data``)."""
    out = native_build.cache_dir(False)
    out.mkdir(parents=True, exist_ok=True)
    library = native_build._library(out)
    library.write_bytes(data)
    native_build._stamp(library).write_text(native_build._record(record or data))
    return library


def _fake_compile(monkeypatch):
    """Replace the compiler: publish a whole library as a finished build does."""
    compiled = []

    def compile_(out, cuda, verbose):
        compiled.append(out)
        library = _cached(_elf())
        native_build._loaded = library

    monkeypatch.setattr(native_build, "_compile", compile_)
    return compiled


def _lock(**changes) -> Path:
    """A build lock in the CPU cache directory naming a live process (this test's parent),
    with ``changes`` to its record."""
    out = native_build.cache_dir(False)
    out.mkdir(parents=True, exist_ok=True)
    owner = native_build._owner_record(os.getppid()) | changes
    (out / native_build.LOCK).write_text(json.dumps(owner))
    return out / native_build.LOCK


def test_cache_key_holds_the_instruction_set(monkeypatch):
    """A home directory shared by nodes of different CPUs: one library per instruction set
    (before, an AVX-512 build was loaded on an AVX2 node: illegal instruction)."""
    assert native_build._isa()  # this machine's, from /proc/cpuinfo or the compiler
    monkeypatch.setattr(native_build, "_isa", lambda: "x86_64: avx avx2 fma")
    avx2 = native_build.cache_dir(False)
    monkeypatch.setattr(native_build, "_isa", lambda: "x86_64: avx avx2 avx512f fma")
    assert native_build.cache_dir(False) != avx2
    assert native_build.cache_dir(False).parent == avx2.parent


def test_the_built_library_verifies_and_a_cut_copy_does_not(native_library):
    """The real build passes every check; the same bytes cut short fail the ELF check even
    with a record written for the cut bytes (the checksum alone let that through: SIGBUS)."""
    data, problem = native_build._read_verified(native_library)
    assert problem is None and data == native_library.read_bytes()
    for keep in (len(data) - 1, len(data) // 2, 4096):
        assert "truncated" in native_build._elf_problem(data[:keep])
    assert native_build._elf_problem(b"\x7fELF" + bytes(60)) is not None  # 32-bit / empty


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


DAMAGE = {  # what was done to a cached library, and the reason its load refuses it
    "cut, record of the whole": ("holds", lambda d: (d[: len(d) // 2], d)),
    "cut, record of the cut bytes": ("truncated", lambda d: (d[: len(d) // 2], d[: len(d) // 2])),
    # a byte mid-file (past the ELF and program headers, whose extents are checked first)
    "same size, other bytes": ("differ", lambda d: (_flip(d, len(d) // 2), d)),
    "not an ELF file": ("not a 64-bit ELF", lambda d: (b"garbage", b"garbage")),
    "no record": ("is missing", lambda d: (d, None)),
}


@pytest.mark.parametrize("damage", [*DAMAGE, "does not load"])
def test_an_unusable_library_is_never_loaded_and_is_rebuilt_once(
    damage, fresh_cache, monkeypatch, capsys
):
    """Before, a truncated library whose checksum record matched its cut bytes was handed to
    dlopen (bus error)."""
    if damage in DAMAGE:
        reason, make = DAMAGE[damage]
        data, record = make(_elf())
        library = _cached(data, record)
        if record is None:
            native_build._stamp(library).unlink()
    else:
        reason, data = "undefined symbol", _elf()
        library = _cached(data)
        failures = iter([OSError("undefined symbol: aoti_torch_foo")])

        def dlopen(path):
            if next(failures, None) is not None:
                raise OSError("undefined symbol: aoti_torch_foo")
            fresh_cache.append(Path(path).read_bytes())

        monkeypatch.setattr(native_build, "_dlopen", dlopen)
    compiled = _fake_compile(monkeypatch)
    assert native_build.load() is True
    assert compiled == [library.parent]
    assert data not in fresh_cache or damage == "does not load"  # never handed to dlopen
    err = capsys.readouterr().err
    assert "unusable" in err and reason in err and "rebuilding it once" in err


def test_a_rebuild_that_fails_leaves_the_python_paths(fresh_cache, monkeypatch, capsys):
    _cached(b"garbage")

    def no_compiler(out, cuda, verbose):
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(native_build, "_compile", no_compiler)
    assert native_build.load() is False and native_build.load() is False  # tried once only
    err = capsys.readouterr().err
    assert err.count("rebuilding it once") == 1 and "c++: command not found" in err
    assert "c++: command not found" in native_build.why_not_loaded()


def test_the_process_loads_a_sealed_private_copy(fresh_cache, monkeypatch):
    """What it can protect against after the load (a writer that truncates the cached file in
    place): the process mapped a sealed in-memory copy, which no write can reach."""
    seen = []

    def dlopen(path):
        with open(path, "rb") as f:
            seen.append(f.read())
        with pytest.raises(PermissionError), open(path, "r+b") as f:  # sealed: F_SEAL_WRITE
            f.write(b"\0")
        assert not Path(path).resolve().is_relative_to(native_build.cache_dir(False))

    monkeypatch.setattr(native_build, "_dlopen", dlopen)
    library = _cached(_elf())
    assert native_build.load() is True and seen == [_elf()]
    assert str(library) in torch.ops.loaded_libraries
    torch.ops.loaded_libraries.discard(str(library))


def test_a_build_publishes_whole_files_by_rename(fresh_cache, monkeypatch, capsys):
    """A compile runs in a staging directory; the cached name only ever gets a whole file, by
    rename, so a process that mapped the old one keeps its bytes (never rewritten in place)."""
    from torch.utils import cpp_extension

    def load(name, build_directory, **kwargs):
        (Path(build_directory) / f"{name}.so").write_bytes(_elf())

    monkeypatch.setattr(cpp_extension, "load", load)
    damaged = _elf()[:99] + bytes([_elf()[99] ^ 1]) + _elf()[100:]
    old = _cached(damaged, _elf())  # held open by a reader, as a process that mapped it
    with open(old, "rb") as reader:
        assert native_build.load() is True
        assert reader.read() == damaged  # its file was replaced, not written to
    assert native_build._read_verified(old)[1] is None
    assert sorted(p.name for p in old.parent.iterdir()) == [old.name, old.name + ".sha256"]
    assert "built" in capsys.readouterr().err

    def broken_linker(name, build_directory, **kwargs):
        (Path(build_directory) / f"{name}.so").write_bytes(_elf()[:100])

    monkeypatch.setattr(cpp_extension, "load", broken_linker)
    with pytest.raises(RuntimeError, match="the linker wrote an unusable library"):
        native_build._compile(old.parent, False, False)
    assert native_build._read_verified(old)[1] is None  # the published library is untouched
    assert not list(old.parent.glob(native_build.STAGING + "*"))


def test_a_compile_prints_when_it_starts_and_ends(fresh_cache, monkeypatch, capsys):
    from torch.utils import cpp_extension

    def load(name, build_directory, **kwargs):
        (Path(build_directory) / f"{name}.so").write_bytes(_elf())

    monkeypatch.setattr(cpp_extension, "load", load)
    path = native_build.build(cuda=False)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "building the CPU kernels" in lines[0] and "built" in lines[1]
    native_build._loaded = None
    assert native_build.build(cuda=False) == path  # a finished build: no compile, no output
    assert capsys.readouterr().err == "" and fresh_cache == [_elf()]


def _dead_pid() -> int:
    import subprocess

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


@pytest.mark.parametrize(
    ("owner", "reason"),
    [
        ("dead", "no longer runs"),
        ("this process", "this process's own PID"),
        ("another boot", "before this machine's last boot"),
        ("another container", "in another container"),
        ("a reused PID", "its PID was reused"),
        ("unreadable, old", "names no owner"),
        # issue 37: kill(0, 0) and kill(-1, 0) succeed (process groups): waited 900 s; a PID
        # beyond C's pid_t let an OverflowError out
        ("PID 0", "it names PID 0, which is no single process"),
        ("PID -1", "it names PID -1, which is no single process"),
        ("PID 2**40", f"process {2**40} no longer runs"),
    ],
)
def test_a_lock_nobody_can_be_holding_is_removed_not_waited_on(
    owner, reason, fresh_cache, monkeypatch, capsys
):
    """Before, a lock naming the caller's own PID (PID reuse in a fresh container) was waited
    on for 900 s."""
    changes = {
        "dead": {"pid": _dead_pid()},
        "this process": native_build._owner_record(os.getpid()),
        "another boot": {"boot": "0f0f0f0f-dead-beef-0000-000000000000"},
        "another container": {"pid_namespace": "pid:[1]"},
        "a reused PID": {"start": "1"},
        "PID 0": {"pid": 0},
        "PID -1": {"pid": -1},
        "PID 2**40": {"pid": 2**40},
    }
    lock = _lock(**changes.get(owner, {}))
    if owner == "unreadable, old":
        lock.write_text("")
        os.utime(lock, (time.time() - 60,) * 2)
    monkeypatch.setattr(native_build, "LOCK_WAIT", 0.0)  # waiting at all would raise
    compiled = _fake_compile(monkeypatch)
    native_build.build(cuda=False)
    assert compiled == [lock.parent] and not lock.exists()
    err = capsys.readouterr().err
    assert f"removing the stale build lock {lock}" in err and reason in err


@pytest.mark.parametrize("where", ["library", "record", "both"])
def test_a_directory_where_a_file_of_the_build_belongs_is_rebuilt_over(
    where, fresh_cache, monkeypatch, capsys
):
    """Issue 37: a directory at the library's or its record's name raised IsADirectoryError
    from load() and build() instead of rebuilding."""
    from torch.utils import cpp_extension

    def load(name, build_directory, **kwargs):
        (Path(build_directory) / f"{name}.so").write_bytes(_elf())

    monkeypatch.setattr(cpp_extension, "load", load)
    library = _cached(_elf())
    paths = {"library": [library], "record": [native_build._stamp(library)]}
    for path in paths.get(where, [library, native_build._stamp(library)]):
        path.unlink()
        (path / "inside").mkdir(parents=True)
    assert native_build.load() is True
    assert native_build._read_verified(library)[1] is None and native_build._loaded == library
    err = capsys.readouterr().err
    assert "a directory stands where" in err and "rebuilding it once" in err
    assert sorted(p.name for p in library.parent.iterdir()) == [
        library.name,
        library.name + ".sha256",
    ]
    native_build._loaded = None
    library.unlink()
    library.mkdir()
    assert native_build.build(cuda=False) == library and library.is_file()


def test_a_live_lock_is_waited_on_for_a_bounded_time(fresh_cache, monkeypatch, capsys):
    lock = _lock()
    monkeypatch.setattr(native_build, "LOCK_WAIT", 0.3)
    _fake_compile(monkeypatch)
    with pytest.raises(TimeoutError, match=f"held for over 0.3 s by process {os.getppid()}"):
        native_build.build(cuda=False)
    err = capsys.readouterr().err
    assert f"waiting up to 0.3 s for process {os.getppid()}" in err and lock.exists()


def test_a_call_during_a_build_waits_for_it_and_says_so(fresh_cache, monkeypatch, capsys):
    """Before, a native call while another process built raised 'not built on this machine.
    Build them once with: ...', which, if followed, waited 900 s."""
    lock = _lock()

    def builder_finishes(seconds):  # the other process publishes its library, then unlocks
        _cached(_elf())
        lock.unlink()

    monkeypatch.setattr(native_build.time, "sleep", builder_finishes)
    kernel = native._unavailable("moe_permute")
    monkeypatch.setattr(native, "has_kernel", lambda name, device: True)
    monkeypatch.setattr(torch.ops.prime_rl, "moe_permute", lambda *args: "the native kernel")
    args = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), 2, 1
    assert kernel(*args) == "the native kernel"
    assert f"waiting up to 900 s for process {os.getppid()}" in capsys.readouterr().err
    assert fresh_cache == [_elf()]


def test_a_build_that_outlasts_the_wait_is_named_in_the_error(fresh_cache, monkeypatch):
    _lock()
    monkeypatch.setattr(native_build, "LOCK_WAIT", 0.0)
    kernel = native._unavailable("moe_permute")
    held = f"held for over 0 s by process {os.getppid()}"
    with pytest.raises(BackendUnavailable, match=held) as e:
        kernel(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), 2, 1)
    assert "not built on this machine" not in str(e.value)


def test_a_valid_library_under_a_live_lock_loads_without_waiting(fresh_cache, monkeypatch, capsys):
    _cached(_elf())
    _lock()

    def no_waiting(seconds):
        raise AssertionError("waited for the lock")

    monkeypatch.setattr(native_build.time, "sleep", no_waiting)
    assert native_build.load() is True and fresh_cache == [_elf()]
    assert native_build.build(cuda=False) == native_build._loaded
    assert capsys.readouterr().err == ""


def test_an_unbuilt_library_says_how_to_build_it(fresh_cache):
    assert native_build.load() is False
    kernel = native._unavailable("moe_permute")
    with pytest.raises(BackendUnavailable, match="not built on this machine.*python -m prime_ops"):
        kernel(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), 2, 1)


@pytest.mark.slow
def test_a_library_cut_in_place_after_the_load_does_not_crash_the_process(native_library, tmp_path):
    """End to end, in a child process: load a copy of the real build, cut the cached file in
    place (an outside writer), then run native ops. Before, the process had mapped that file:
    bus error (SIGBUS) at the first call that touched a page past the cut."""
    import subprocess

    out = tmp_path / native_library.parent.name
    out.mkdir()
    for path in (native_library, native_build._stamp(native_library)):
        shutil.copy(path, out / path.name)
    child = """
import torch
from prime_ops import native
from prime_ops.native import build

assert native.is_available(), build.why_not_loaded()
with open(build._loaded, "r+b") as f:
    f.truncate(4096)
x = torch.randn(300, 512)
q, scale = native.quantize_fp8_blockwise(x, 128, "ue8m0")
x_sorted, row_map, counts = native.moe_permute(x, torch.randint(0, 4, (300, 2)), 4, 128)
print(build._loaded, q.shape, int(counts.sum()))
"""
    env = {**os.environ, "PRIME_OPS_NATIVE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == str(out / native_library.name)
    assert done.stdout.split()[-1] == "600" and (out / native_library.name).stat().st_size == 4096
