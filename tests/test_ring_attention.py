"""prime_rl_attn::ring_attention on gloo ranks against single-process varlen attention."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops import collectives as C
from prime_ops.attn import ring_attention, varlen_attention
from tests.dist_utils import run_distributed

# (sequence lengths of the packed batch, q heads, kv heads, dtype, softcap); every total is a
# multiple of 4 so the same batches shard over 2 and 4 ranks. Sequences cross shard borders.
BATCHES = [
    ([5, 11, 3, 13], 4, 2, torch.float32, 0.0),  # uneven, GQA
    ([32], 2, 2, torch.float32, 0.0),  # one sequence spanning every shard
    ([1, 1, 14, 2, 6], 2, 1, torch.float32, 3.0),  # short ones, softcap, MQA
    ([7, 9, 8], 4, 4, torch.bfloat16, 0.0),
]


def _batch(lengths, h, hkv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, n, 8, generator=gen).to(dtype) for n in (h, hkv, hkv))
    dout = torch.randn(total, h, 8, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dout, cu


def _check_ring(rank, world):
    _check_errors(rank, world)
    if world == 2:
        _check_opcheck_and_gradcheck(rank, world)
    for index, (lengths, h, hkv, dtype, softcap) in enumerate(BATCHES):
        for causal in (True, False):
            q, k, v, dout, cu = _batch(lengths, h, hkv, dtype, seed=index)
            shard = slice(rank * q.shape[0] // world, (rank + 1) * q.shape[0] // world)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_out, ref_lse = varlen_attention(
                *full, cu, cu, max(lengths), max(lengths), causal=causal, softcap=softcap
            )
            (ref_out * dout).sum().backward()

            local = [t[shard].clone().requires_grad_() for t in (q, k, v)]
            out, lse = ring_attention(*local, cu, max(lengths), causal=causal, softcap=softcap)
            (out * dout[shard]).sum().backward()

            tol = (
                dict(atol=2e-2, rtol=2e-2)
                if dtype == torch.bfloat16
                else dict(atol=1e-5, rtol=1e-5)
            )
            where = f"batch {index}, causal={causal}, rank {rank}/{world}"
            torch.testing.assert_close(out, ref_out[shard].detach(), **tol, msg=where)
            torch.testing.assert_close(lse, ref_lse[:, shard], **tol, msg=where)
            for name, ours, ref in zip("qkv", local, full, strict=True):
                torch.testing.assert_close(
                    ours.grad, ref.grad[shard], **tol, msg=f"d{name}, {where}"
                )


def _check_errors(rank, world):
    q = torch.randn(8, 2, 8)
    total = 8 * world
    cu = torch.tensor([0, total], dtype=torch.int32)
    with pytest.raises(ValueError, match="same length"):
        ring_attention(q, q[:4], q[:4], cu, total)
    with pytest.raises(ValueError, match=f"end at the packed length {total}"):
        ring_attention(q, q, q, torch.tensor([0, total - 1], dtype=torch.int32), total)
    with pytest.raises(ValueError, match="not an attention backend"):
        ring_attention(q, q, q, cu, total, backend="flash")
    pair = dist.new_group([0, 1])  # a subgroup: ranks are resolved through its group_name
    if rank < 2:
        pair_cu = torch.tensor([0, 16], dtype=torch.int32)
        out, _ = ring_attention(q, q, q, pair_cu, 16, group=pair)
        assert out.shape == q.shape


def _replicated_ring(q, k, v, cu, max_seqlen, causal, softcap):
    """Full attention of full q, k, v (the same on every rank) computed by the ring: each rank
    takes its shard through a reduce-scatter of ``x / W`` (whose adjoint all-gathers the shard
    gradients) and the outputs are all-gathered. Every rank computes the same function of the
    same inputs, so gradcheck's perturbations stay in step across ranks."""
    world = dist.get_world_size()
    shards = [C.reduce_scatter_sum(t / world) for t in (q, k, v)]
    out, _ = ring_attention(*shards, cu, max_seqlen, causal=causal, softcap=softcap)
    return C.all_gather(out)


def _check_opcheck_and_gradcheck(rank, world):
    gen = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)  # the second sequence crosses the shards
    q, k, v = (torch.randn(4, heads, 2, generator=gen, dtype=torch.float64) for heads in (2, 1, 1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fn = functools.partial(_replicated_ring, cu=cu, max_seqlen=3, causal=True, softcap=2.0)
    assert torch.autograd.gradcheck(fn, leaves, atol=1e-8, rtol=1e-6)

    shard = slice(rank * 2, (rank + 1) * 2)
    local = [t[shard].float().requires_grad_() for t in (q, k, v)]
    name = dist.group.WORLD.group_name
    args = (*local, cu, 3, True, 0.4, 1.5, name, "sdpa")
    torch.library.opcheck(torch.ops.prime_rl_attn.ring_attention.default, args)
    out, lse = torch.ops.prime_rl_attn.ring_attention(*args)
    assert lse.dtype == torch.float32
    detached = [t.detach() for t in local]
    bwd_args = (torch.randn_like(out).detach(), *detached, out.detach(), lse, *args[3:])
    torch.library.opcheck(torch.ops.prime_rl_attn.ring_attention_backward.default, bwd_args)
    with pytest.raises(ValueError, match="dout on meta"):
        torch.ops.prime_rl_attn.ring_attention_backward(bwd_args[0].to("meta"), *bwd_args[1:])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_full_attention(world):
    """Outputs, lse and q/k/v gradients of every shard; invalid calls raise before any send;
    on 2 ranks also opcheck and a float64 gradcheck of the whole ring."""
    run_distributed(_check_ring, world)


def test_ring_fake_gives_local_shapes_without_a_group():
    with FakeTensorMode():
        q = torch.empty(64, 8, 128, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(64, 2, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(9, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.prime_rl_attn.ring_attention(
            q, kv, kv, cu, 100, True, 0.1, 0.0, "no-such-group", "fa3"
        )
        assert (out.shape, out.dtype, out.device.type) == ((64, 8, 128), torch.bfloat16, "cuda")
        assert (lse.shape, lse.dtype) == ((8, 64), torch.float32)
        dq, dk, dv = torch.ops.prime_rl_attn.ring_attention_backward(
            out, q, kv, kv, out, lse, cu, 100, True, 0.1, 0.0, "no-such-group", "fa3"
        )
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)


@pytest.mark.skipif(dist.is_initialized(), reason="needs an uninitialized default group")
def test_ring_without_process_group_says_how_to_fix():
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="ring_attention: .*init_process_group"):
        ring_attention(q, q, q, cu, 4)


# --- what selective checkpointing keeps on a ring step (issue 31) -------------------------------


def _storages(tensors, inputs) -> int:
    """Bytes of the distinct storages among ``tensors``, the inputs' own excluded."""
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _saved_without_ac(fn, inputs) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    return _storages(saved, inputs)


def _kept_by_selective(fn, inputs, target: str) -> int:
    """Bytes torch's own SAC keeps when ``target`` is saved and everything else recomputed."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    kept = []

    def policy(ctx, op, *args, **kwargs):
        if str(op).startswith(target):
            if ctx.is_recompute is False:
                kept.extend(t for t in ctx.op_output if isinstance(t, torch.Tensor))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    contexts = functools.partial(create_selective_checkpoint_contexts, policy)
    checkpoint(fn, *inputs, use_reentrant=False, context_fn=contexts)
    return _storages(kept, inputs)


def test_a_merge_target_keeps_what_no_ac_never_saves():
    """docs/attention.md: keeping ``prime_rl::merge_attn_states`` holds the merged out and lse
    (T * H * D + H * T fp32: 32.25 MiB at 4096 tokens of 16 heads of 128), while without AC the
    merge saves nothing but its inputs: its backward needs only them."""
    from prime_ops import native

    if not native.has_kernel("merge_attn_states", torch.device("cpu")):
        pytest.skip("the native kernels are not built (python -m prime_ops.native)")
    tokens, heads, dim = 256, 16, 128
    gen = torch.Generator().manual_seed(0)
    step = [torch.randn(tokens, heads, dim, generator=gen).requires_grad_() for _ in range(2)]
    lses = [torch.randn(heads, tokens, generator=gen).requires_grad_() for _ in range(2)]
    inputs = (step[0], lses[0], step[1], lses[1])

    def merge(out_a, lse_a, out_b, lse_b):
        out, lse = native.merge_attn_states(out_a, lse_a, out_b, lse_b)
        return out.sum() + lse.sum()

    assert _saved_without_ac(merge, inputs) == 0
    kept = _kept_by_selective(merge, inputs, "prime_rl.merge_attn_states")
    assert kept == (tokens * heads * dim + heads * tokens) * 4


def _ring_target_costs_nothing(rank, world):
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    q, k, v = (torch.randn(32, h, 16, generator=gen).requires_grad_() for h in (4, 2, 2))

    def step(q, k, v):
        out, _ = ring_attention(q, k, v, cu, 44, causal=True)
        return out.square().sum()

    no_ac = _saved_without_ac(step, (q, k, v))
    kept = _kept_by_selective(step, (q, k, v), "prime_rl_attn.ring_attention")
    out_and_lse = 32 * 4 * 16 * 4 + 4 * 32 * 4
    assert kept == out_and_lse, kept  # the op's outputs, which its own backward saves anyway
    assert no_ac == out_and_lse + cu.untyped_storage().nbytes(), no_ac  # + the offsets it saves


def _policies_see_outputs() -> bool:
    """torch's SAC hands a policy the op's output from torch 2.10 on (``ctx.op_output``)."""
    import inspect

    from torch.utils.checkpoint import SelectiveCheckpointContext

    return "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


@pytest.mark.slow
@pytest.mark.skipif(not _policies_see_outputs(), reason="this torch's SAC policies see no output")
def test_keeping_the_ring_op_holds_no_byte_beyond_its_own_backward():
    run_distributed(_ring_target_costs_nothing, 2)
