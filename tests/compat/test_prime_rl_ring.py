"""prime-rl's context-parallel ``prime_rl_ring::attention``, called as prime-rl calls it.

Mirrors prime-rl ``src/prime_rl/trainer/models/layers/ring_attn.py`` (index id 59226315194):
``ring_varlen_attention`` calls the op with every argument by keyword, from
``substitute_ring_attn``'s ``_ring_compute_attention`` in ``layers/attn.py``, which takes the
per-rank offsets from ring-flash-attn's ``DATA_PARAMS`` (``llama3_flash_attn_prepare_cu_seqlens``
with ``causal=True``; :func:`prime_ops.attn.ring_shard` computes the same). On 2 gloo ranks with
the sdpa backend, compared with float64 attention over the whole packed batch (plain PyTorch).
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from prime_ops.attn import ring_shard
from tests.compat.flash_standins import install
from tests.dist_utils import run_distributed


def full_attention(q, k, v, cu, *, left, right):
    """Causal attention in float64 over the whole packed batch, window ``(left, right)``."""
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for start, end in pairwise(cu.tolist()):
        pos = torch.arange(end - start)
        behind = pos[:, None] - pos[None, :]  # how far key j lies behind query i
        seen = behind >= 0
        if left >= 0:
            seen &= behind <= left
        if right >= 0:
            seen &= -behind <= right
        keys, values = (t[start:end].repeat_interleave(groups, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), values))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def ring_varlen_attention(q, k, v, shard, heads_k_stride, group, window_size, backend):
    """``ring_attn.ring_varlen_attention`` -> ``ring_attention_forward``: the op by keyword."""
    out, _ = torch.ops.prime_rl_ring.attention(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=shard.cu_seqlens_q,
        cu_seqlens_k=shard.cu_seqlens_k,
        max_seqlen_q=shard.max_seqlen_q,
        max_seqlen_k=shard.max_seqlen_k,
        local_k_slice_start=shard.local_k_slice.start,
        local_k_slice_stop=shard.local_k_slice.stop,
        heads_k_stride=heads_k_stride,
        causal=True,
        group_name=group.group_name,
        window_size_left=window_size[0],
        window_size_right=window_size[1],
        attention_backend=backend,
    )
    return out


CASES = [  # (global cu_seqlens, heads_k_stride, window_size)
    ([0, 5, 12, 16], 1, (-1, -1)),
    ([0, 5, 12, 16], 2, (-1, -1)),
    ([0, 3, 3, 11, 16], 1, (3, 0)),  # an empty sequence, a sliding window (sliding_window - 1, 0)
    ([0, 16], 2, (-1, -1)),  # one sequence across both ranks
]


def _matches_full_attention(rank, world):
    group = dist.group.WORLD
    heads, kv_heads, head_dim, tokens = 4, 2, 8, 16
    per_rank = tokens // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for i, (bounds, stride, window) in enumerate(CASES):
        gen = torch.Generator().manual_seed(i)  # the same global batch on every rank
        cu = torch.tensor(bounds, dtype=torch.int32)
        q, k, v = (torch.randn(tokens, h, head_dim, generator=gen, dtype=torch.float64)
                   for h in (heads, kv_heads, kv_heads))  # fmt: skip
        dout = torch.randn(tokens, heads, head_dim, generator=gen, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = full_attention(*full, cu, left=window[0], right=window[1])
        (ref_out * dout).sum().backward()

        local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
        shard = ring_shard(cu, True, rank, world)
        out = ring_varlen_attention(*local, shard, stride, group, window, "sdpa")
        torch.testing.assert_close(out, ref_out[mine].detach(), atol=1e-12, rtol=1e-12)
        (out * dout[mine]).sum().backward()
        for ours, ref in zip(local, full, strict=True):
            torch.testing.assert_close(ours.grad, ref.grad[mine], atol=1e-12, rtol=1e-12)

        _, lse = torch.ops.prime_rl_ring.attention(
            *local, shard.cu_seqlens_q, shard.cu_seqlens_k, shard.max_seqlen_q,
            shard.max_seqlen_k, shard.local_k_slice.start, shard.local_k_slice.stop, stride,
            True, group.group_name, *window, "sdpa",
        )  # fmt: skip
        assert lse.dtype == torch.float64 and lse.shape == (heads, per_rank)
        torch.testing.assert_close(lse, ref_lse[:, mine], atol=1e-12, rtol=1e-12)

    args = (*local, shard.cu_seqlens_q, shard.cu_seqlens_k, shard.max_seqlen_q,
            shard.max_seqlen_k, shard.local_k_slice.start, shard.local_k_slice.stop, 1, True,
            group.group_name, -1, -1, "sdpa")  # fmt: skip
    torch.library.opcheck(torch.ops.prime_rl_ring.attention.default, args)
    out, lse = torch.ops.prime_rl_ring.attention(*args)
    detached = [t.detach() for t in local]
    backward = (torch.randn_like(out).detach(), *detached, out.detach(), lse, *args[3:])
    torch.library.opcheck(torch.ops.prime_rl_ring.attention_backward.default, backward)

    # prime-rl's backend names run the flash kernels, which refuse CPU tensors by name.
    with pytest.raises(ValueError, match="backend 'fa2' runs on cuda tensors"):
        ring_varlen_attention(*local, shard, 1, group, (-1, -1), "flash_attention_2")
    with pytest.raises(ValueError, match="attention_backend='flash_attention_5' is not"):
        ring_varlen_attention(*local, shard, 1, group, (-1, -1), "flash_attention_5")
    with pytest.raises(ValueError, match="heads_k_stride must divide k's 2 heads; got 3"):
        ring_varlen_attention(*local, shard, 3, group, (-1, -1), "sdpa")
    _through_flash_standins(rank, world)


def _through_flash_standins(rank, world):
    """prime-rl's backend names on recording stand-ins of FA2 and FA4 (bf16, as on GPUs): each
    head group's gathered key slice reaches the kernel with the per-rank offsets."""
    calls = install()  # for the rest of this child process
    group = dist.group.WORLD
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    shard = ring_shard(cu, True, rank, world)
    mine = slice(rank * 8, (rank + 1) * 8)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(16, h, 8, generator=gen).bfloat16() for h in (4, 2, 2))
    dout = torch.randn(16, 4, 8, generator=gen).bfloat16()
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = full_attention(*full, cu, left=-1, right=-1)
    (ref_out * dout.double()).sum().backward()
    for backend, unbounded in (("flash_attention_2", -1), ("flash_attention_4", None)):
        calls.clear()
        local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
        out = ring_varlen_attention(*local, shard, 1, group, (-1, -1), backend)
        (out.float() * dout[mine].float()).sum().backward()
        forwards = [kwargs for name, kwargs in calls if name == "fwd"]
        assert len(forwards) == 2  # one per kv head group (heads_k_stride 1 of 2)
        for call in forwards:
            assert call["k"].shape == (shard.local_k_slice.stop - shard.local_k_slice.start, 1, 8)
            assert call["cu_seqlens_k"] is shard.cu_seqlens_k and call["causal"] is True
            assert call["max_seqlen_k"] == shard.max_seqlen_k
            assert (call["window_size_left"], call["window_size_right"]) == (unbounded,) * 2
        assert sum(name == "bwd" for name, _ in calls) == 2
        tol = dict(atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out.double(), ref_out[mine].detach(), **tol)
        for ours, ref in zip(local, full, strict=True):
            torch.testing.assert_close(ours.grad.double(), ref.grad[mine], **tol)


@pytest.mark.slow
def test_prime_rl_ring_attention_matches_full_attention_on_2_ranks():
    run_distributed(_matches_full_attention, 2, timeout=120)


def _compiled(rank, world):
    """prime-rl compiles its decoder blocks with ``fullgraph=True``; the op traces whole."""
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    q, k, v = (torch.randn(8, h, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    shard = ring_shard(cu, True, rank, world)

    def attention(q, k, v):
        return ring_varlen_attention(q, k, v, shard, 1, group, (-1, -1), "sdpa")

    eager = attention(q, k, v)
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    grads = torch.autograd.grad(compiled.sum(), (q, k, v))
    for ours, ref in zip(grads, torch.autograd.grad(eager.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


@pytest.mark.slow
def test_prime_rl_ring_attention_compiles_with_fullgraph_on_2_ranks():
    run_distributed(_compiled, 2, timeout=180)


def test_ring_shard_gives_ring_flash_attns_offsets():
    """Written out from ``llama3_flash_attn_prepare_cu_seqlens``'s rule for 16 tokens on 2
    ranks: queries see keys from the start of their first sequence to the end of their own
    tokens (causal) or of their last sequence."""
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    expected = {
        (True, 0): ([0, 5, 8], [0, 5, 8], 5, 5, slice(0, 8)),
        (True, 1): ([0, 4, 8], [0, 7, 11], 4, 7, slice(5, 16)),
        (False, 0): ([0, 5, 8], [0, 5, 12], 5, 7, slice(0, 12)),
        (False, 1): ([0, 4, 8], [0, 7, 11], 4, 7, slice(5, 16)),
    }
    for (causal, rank), (cu_q, cu_k, max_q, max_k, keys) in expected.items():
        shard = ring_shard(cu, causal, rank, 2)
        assert shard.cu_seqlens_q.tolist() == cu_q and shard.cu_seqlens_k.tolist() == cu_k
        assert shard.cu_seqlens_q.dtype == torch.int32
        assert (shard.max_seqlen_q, shard.max_seqlen_k, shard.local_k_slice) == (
            max_q,
            max_k,
            keys,
        )
    boundary = ring_shard(torch.tensor([0, 8, 16], dtype=torch.int32), True, 1, 2)
    assert boundary.cu_seqlens_q.tolist() == [0, 8] and boundary.local_k_slice == slice(8, 16)
    with pytest.raises(ValueError, match="multiple of world_size 3; got 16"):
        ring_shard(cu, True, 0, 3)


def test_fakes_need_no_live_group():
    """Tracing (FakeTensorMode, torch.compile's first pass) must not need the group itself."""
    with FakeTensorMode():
        q = torch.empty(64, 8, 128, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(64, 2, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        args = (cu, cu, 64, 100, 0, 100, 1, True, "no-such-group", -1, -1, "flash_attention_4")
        out, lse = torch.ops.prime_rl_ring.attention(q, kv, kv, *args)
        assert (out.shape, lse.shape, lse.dtype) == ((64, 8, 128), (8, 64), torch.float32)
        grads = torch.ops.prime_rl_ring.attention_backward(out, q, kv, kv, out, lse, *args)
        assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
